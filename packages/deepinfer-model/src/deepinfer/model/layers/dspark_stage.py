"""The blocks of the DSpark draft head (see `deepinfer.model.dspark`): a stage's attention over its
window ring of target-feature keys plus the bidirectional draft block, the Markov and confidence
heads, and one stage (V4: per-site mHC and the backbone's MoE; V4.1: single-pass mHC and the
draft's own MoE)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet

from ..config import DeepseekV4Config
from ..config_v41 import DeepseekV41Config
from ..model_v41 import MoE as MoEV41
from .attention import init_projections
from .common import RMSNorm, linear
from .moe import MoE
from .v41_codecs import RowCodec


class DraftAttention(nn.Module):
    """A stage's attention (official names `wq_a`, `q_norm`, `wq_b`, `wkv`, `kv_norm`, `wo_a`,
    `wo_b`, `attn_sink`): V4 window attention whose ring holds target-feature keys."""

    def __init__(self, cfg: DeepseekV4Config | DeepseekV41Config, codec: RowCodec | None) -> None:
        super().__init__()
        self.cfg, self.codec = cfg, codec          # codec: V4.1's window row format; None = V4 plain rows
        init_projections(self, cfg)

    def keys(self, x: Tensor, positions: Tensor, ops: KernelSet, inv_freq: Tensor, kv_quant: bool) -> Tensor:
        """[t, hidden] → window keys [t, head_dim]: rope(kv_norm(wkv x)); V4 with kv_quant: FP8 on the
        nope dims; V4.1: as its window rows give them back (MXFP8)."""
        kv = ops.norm_rope(ops.linear(x, self.wkv.weight), self.kv_norm.weight, self.cfg.rms_norm_eps, positions,
                           inv_freq)
        if self.codec is not None:
            return self.codec.round_trip(kv)
        if kv_quant:
            rope = self.cfg.qk_rope_head_dim
            kv = torch.cat((ops.fake_quant_fp8(kv[..., :-rope], 64), kv[..., -rope:]), dim=-1)
        return kv

    def forward(self, x: Tensor, anchor_positions: Tensor, slots: Tensor, ring: Tensor, ops: KernelSet,
                inv_freq: Tensor, kv_quant: bool) -> Tensor:
        """x [num_seqs · k, hidden] (normed; sequence-major blocks) → [num_seqs · k, hidden]; writes the
        block's keys into `ring` [num_slots, ring_len, head_dim] at their positions."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        num_seqs = anchor_positions.shape[0]
        k = x.shape[0] // num_seqs
        window, ring_len = cfg.sliding_window, ring.shape[1]
        offsets = torch.arange(k, device=x.device)
        positions = (anchor_positions[:, None] + offsets[None, :]).flatten()
        h, d = cfg.num_attention_heads, cfg.head_dim
        qr = ops.rms_norm(ops.linear(x, self.wq_a.weight), self.q_norm.weight, eps)
        q = ops.linear(qr, self.wq_b.weight).view(-1, h, d)
        if self.codec is None:                         # V4 normalises each query head; V4.1 does not
            q = ops.norm_rope(q, None, eps, positions, inv_freq)
        else:
            q = ops.apply_rope(q, positions, inv_freq)
        kv = self.keys(x, positions, ops, inv_freq, kv_quant)
        ring[slots[:, None], (positions.view(num_seqs, k) % ring_len)] = self.encode(kv.view(num_seqs, k, d), ring)
        # Committed positions a − W … a − 1, then the block a … a + k − 1: every block query sees all.
        key_pos = anchor_positions[:, None] - window + torch.arange(window + k, device=x.device)[None, :]
        rows = self.decode(ring[slots[:, None], key_pos.clamp(min=0) % ring_len], q.dtype)   # [n, W + k, d]
        rows = rows[:, None].expand(-1, k, -1, -1).reshape(num_seqs * k, window + k, d)
        valid = (key_pos >= 0)[:, None].expand(-1, k, -1).reshape(num_seqs * k, window + k)
        out = ops.sparse_attention(q, rows, valid, self.attn_sink, d**-0.5)
        out = ops.apply_rope(out, positions, inv_freq, inverse=True)
        grouped = ops.grouped_linear(out.reshape(x.shape[0], cfg.o_groups, -1), self.wo_a.weight)
        return ops.linear(grouped.flatten(1), self.wo_b.weight)

    def encode(self, kv: Tensor, ring: Tensor) -> Tensor:
        """Keys [..., head_dim] → ring rows (V4: the ring's dtype; V4.1: packed by its codec)."""
        return kv.to(ring.dtype) if self.codec is None else self.codec.encode(kv)

    def decode(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        return rows.to(dtype) if self.codec is None else self.codec.decode(rows, dtype)


class MarkovHead(nn.Module):
    """Low-rank transition bias: an embedding [vocab, rank] of the previous token and a projection
    [vocab, rank] to a bias over the vocabulary (V4: `markov_w1` / `markov_w2`; V4.1: `embed` / `head`)."""

    def __init__(self, vocab_size: int, rank: int, v41: bool) -> None:
        super().__init__()
        self.names = ("embed", "head") if v41 else ("markov_w1", "markov_w2")
        self.add_module(self.names[0], nn.Embedding(vocab_size, rank))
        self.add_module(self.names[1], linear(rank, vocab_size))

    @property
    def embedding(self) -> nn.Embedding:
        return getattr(self, self.names[0])

    @property
    def projection(self) -> nn.Linear:
        return getattr(self, self.names[1])


class ConfidenceHead(nn.Module):
    """`proj` [1, hidden + rank]: acceptance logit of a draft from [x_j; e_j] (float32)."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.proj = linear(hidden + rank, 1)


class DraftStage(nn.Module):
    """One draft block (`mtp.{i}`): mHC sites around attention and MoE; stage 0 also owns the
    context projection, the last stage the head parts."""

    def __init__(self, cfg: DeepseekV4Config | DeepseekV41Config, index: int, num_stages: int,
                 expert_dtype: str | None, codec: RowCodec | None) -> None:
        super().__init__()
        self.cfg, self.v41 = cfg, codec is not None
        mix = (2 + cfg.hc_mult) * cfg.hc_mult
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DraftAttention(cfg, codec)
        if self.v41:
            assert isinstance(cfg, DeepseekV41Config), "a V4.1 draft stage (codec given) needs a V4.1 config"
            draft_moe = dataclasses.replace(cfg, n_routed_experts=cfg.dspark_n_routed_experts,
                                            num_experts_per_tok=cfg.dspark_num_experts_per_tok)
            self.ffn = MoEV41(draft_moe, expert_dtype)
        else:
            assert isinstance(cfg, DeepseekV4Config), "a V4 draft stage (no codec) needs a V4 config"
            self.ffn = MoE(cfg, cfg.num_hidden_layers + index, expert_dtype)    # after the hash layers
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, cfg.hc_mult * cfg.hidden_size)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        if index == 0:
            self.main_proj = linear(cfg.hidden_size * len(cfg.dspark_target_layer_ids), cfg.hidden_size)
            self.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if index == num_stages - 1:
            rank = cfg.dspark_markov_rank
            assert rank is not None, "DSparkDraft checks the config has a draft head"
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if not self.v41:                           # V4.1 collapses with the last FFN pre-mix instead
                self.hc_head_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
                self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
                self.hc_head_scale = nn.Parameter(torch.ones(1))
            self.markov_head = MarkovHead(cfg.vocab_size, rank, self.v41)
            self.confidence_head = ConfidenceHead(cfg.hidden_size, rank)

    def _site(self, h: Tensor, site: str, ops: KernelSet) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.cfg
        return ops.hc_pre(h, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"),
                          getattr(self, f"hc_{site}_base"), sinkhorn_iters=cfg.hc_sinkhorn_iters,
                          hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)

    def forward(self, h: Tensor, pre_mix: Tensor | None, token_ids: Tensor, anchor_positions: Tensor, slots: Tensor,
                ring: Tensor, ops: KernelSet, inv_freq: Tensor, kv_quant: bool) -> tuple[Tensor, Tensor | None]:
        """(streams, carried pre-mix) → the same after this block; the pre-mix is None for V4."""
        eps = self.cfg.rms_norm_eps
        if self.v41:
            return self._forward_single_pass(h, pre_mix, anchor_positions, slots, ring, ops, inv_freq)
        x, post, comb = self._site(h, "attn", ops)
        x = self.attn(ops.rms_norm(x, self.attn_norm.weight, eps), anchor_positions, slots, ring, ops, inv_freq,
                      kv_quant)
        h = ops.hc_post(x, h, post, comb)
        x, post, comb = self._site(h, "ffn", ops)
        return ops.hc_post(self.ffn(ops.rms_norm(x, self.ffn_norm.weight, eps), token_ids, ops), h, post, comb), None

    def _forward_single_pass(self, h: Tensor, pre_mix: Tensor, anchor_positions: Tensor, slots: Tensor,
                             ring: Tensor, ops: KernelSet, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        """V4.1's block: each sublayer input is collapsed with the pre-mix of the site before."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps

        def mixes(site: str, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return ops.hc_mixes(streams, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"),
                                getattr(self, f"hc_{site}_base"), sinkhorn_iters=cfg.hc_sinkhorn_iters,
                                hc_eps=cfg.hc_eps, norm_eps=eps)

        attn_pre, post, comb = mixes("attn", h)
        x = ops.rms_norm(ops.hc_collapse(h, pre_mix), self.attn_norm.weight, eps)
        h = ops.hc_expand(self.attn(x, anchor_positions, slots, ring, ops, inv_freq, False), h, post, comb)
        ffn_pre, post, comb = mixes("ffn", h)
        x = ops.rms_norm(ops.hc_collapse(h, attn_pre), self.ffn_norm.weight, eps)
        return ops.hc_expand(self.ffn(x, ops), h, post, comb), ffn_pre
