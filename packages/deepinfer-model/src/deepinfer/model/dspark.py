"""DSpark draft head of DeepSeek-V4-Flash-DSpark / -0731 and DeepSeek-V4.1-Flash (spec §2.8,
§2.9.8): parallel drafting of a whole block in one forward, then a sequential low-rank Markov
correction.

V4.1 differences (the same class, chosen by the target's config): the captured features are the
hc-means of the streams *entering* the target layers; stages use single-pass mHC (the block starts
from the stream-0 pre-mix, the head collapses with the last FFN pre-mix, no `hc_head`), no per-head
q norm, MXFP8 window rows (the target's window codec), their own MoE (`dspark_n_routed_experts`,
top `dspark_num_experts_per_tok`, V4.1 router), and the Markov factors are named
`markov_head.embed` / `markov_head.head`.

Context. The target's forward captures the hc-mean of the outputs of `dspark_target_layer_ids`
(`DeepseekV4ForCausalLM.attach_draft` turns the capture on; off, it costs one `if`), projects it once
(`main_x = main_norm(main_proj(concat))`, stage 0's weights) and writes, for every stage, the key
`rope(kv_norm(wkv(main_x)))` of each position into that stage's own window ring (`mtp.{i}.window`
in the model's cache spec: `sliding_window + max_backtracking` rows, slot = position mod ring
length). Rejected positions are never read and get overwritten by the next forward: no copy back.

Draft. Input per sequence: [anchor, noise × (k − 1)] at positions a … a + k − 1 (anchor = the token
the target just sampled, at position a; k = `dspark_block_size`). Each stage is a window-only V4
block (ratio 0, main RoPE, mHC sites, the backbone's MoE) whose attention writes the block's keys
into its ring and lets every block query see the `sliding_window` committed positions a − W … a − 1
plus all k block keys (bidirectional inside the block). The last stage collapses with its learned
`hc_head`, then `norm` and the target's shared `head` give base logits U_j. Sequentially, from
out_0 = anchor: e_j = markov_w1[out_j], logits_j = U_j + markov_w2 · e_j, out_{j+1} = sample(logits_j),
and the confidence sigmoid(proj([x_j; e_j])) predicts that draft's acceptance (x_j = the collapsed,
pre-norm hidden). Draft j is the guess for position a + j + 1.

Names: the official `mtp.{i}.…` keys (`mtp.0.main_proj`, `mtp.0.main_norm`; last stage `norm`,
`hc_head_*`, `markov_head.markov_w1/markov_w2`, `confidence_head.proj`), experts stacked per stage
as the backbone's (`mtp.{i}.ffn.experts.w13` / `.w2`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet, kernels_for

from .batch import ForwardBatch
from .cache import ModelCache, StateSpec
from .checkpoint import WeightError
from .config import ConfigError, DeepseekV4Config
from .config_v41 import DeepseekV41Config
from .layers.common import RMSNorm, linear, matmul_t
from .layers.moe import Experts, MoE
from .layers.v41_codecs import RowCodec

Sampler = Callable[[int, Tensor], Tensor]     # (draft index j, logits [num_seqs, vocab]) -> ids [num_seqs]
_STAGE = re.compile(r"^mtp\.(\d+)\.")
_EXPERT = re.compile(r"^(mtp\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


@dataclass(frozen=True, slots=True)
class DraftProposal:
    """One draft block per sequence; draft j is the guess for position anchor_position + j + 1."""

    token_ids: Tensor     # [num_seqs, k] int64
    logits: Tensor        # [num_seqs, k, vocab] float32, the Markov-corrected logits each draft was drawn from
    confidence: Tensor    # [num_seqs, k] float32, predicted acceptance probability of each draft


def greedy_sampler(step: int, logits: Tensor) -> Tensor:
    """The default draft sampler: argmax of each row."""
    return logits.argmax(dim=-1)


class DraftAttention(nn.Module):
    """A stage's attention (official names `wq_a`, `q_norm`, `wq_b`, `wkv`, `kv_norm`, `wo_a`,
    `wo_b`, `attn_sink`): V4 window attention whose ring holds target-feature keys."""

    def __init__(self, cfg: DeepseekV4Config | DeepseekV41Config, codec: RowCodec | None) -> None:
        super().__init__()
        self.cfg, self.codec = cfg, codec          # codec: V4.1's window row format; None = V4 plain rows
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, h * d)
        self.wkv = linear(cfg.hidden_size, d)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))

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
            from .model_v41 import MoE as MoEV41
            draft_moe = dataclasses.replace(cfg, n_routed_experts=cfg.dspark_n_routed_experts,
                                            num_experts_per_tok=cfg.dspark_num_experts_per_tok)
            self.ffn = MoEV41(draft_moe, expert_dtype)
        else:
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


class DSparkDraft(nn.Module):
    """The draft head over a target `DeepseekV4ForCausalLM` (whose `embed` and `head` it shares).

    Args:
        target: the target model (V4; its config carries the `dspark_*` fields).
        num_stages: draft blocks `mtp.0 … mtp.{num_stages − 1}` (count them in the checkpoint:
            `num_stages_in`; V4-0731's config says 1 where the checkpoint has 3).
        expert_dtype: the stages' routed experts kept "fp8" / "fp4" in memory, None = model dtype.
    Raises:
        ConfigError: the config lacks a DSpark field, or the noise token is outside the vocabulary.
    """

    def __init__(self, target: nn.Module, num_stages: int, *, expert_dtype: str | None = None) -> None:
        super().__init__()
        cfg = target.cfg
        for name in ("dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank"):
            if getattr(cfg, name) is None:
                raise ConfigError(f"{name} is not set: the config has no DSpark draft head")
        if not cfg.dspark_target_layer_ids:
            raise ConfigError("dspark_target_layer_ids is empty: the config has no DSpark draft head")
        if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size or num_stages < 1:
            raise ConfigError(f"dspark_noise_token_id={cfg.dspark_noise_token_id} outside the vocabulary "
                              f"[0, {cfg.vocab_size}) or num_stages={num_stages} < 1")
        self.cfg, self.block_size, self.expert_dtype = cfg, cfg.dspark_block_size, expert_dtype
        self.v41 = isinstance(cfg, DeepseekV41Config)
        self.__dict__["target"] = target               # shared embed / head; not a submodule (names stay mtp.*)
        device, dtype = target.embed.weight.device, target.embed.weight.dtype
        self.codec = target.codecs().window if self.v41 else None
        with torch.device(device):
            self.mtp = nn.ModuleList(DraftStage(cfg, i, num_stages, expert_dtype, self.codec)
                                     for i in range(num_stages))
        for name, p in self.named_parameters():
            if p.dtype.is_floating_point and p.dtype != torch.float8_e4m3fn and not self._keeps_fp32(name):
                p.data = p.data.to(dtype)

    @property
    def num_stages(self) -> int:
        return len(self.mtp)

    def ring_names(self) -> tuple[str, ...]:
        return tuple(f"mtp.{i}.window" for i in range(self.num_stages))

    def state_specs(self, max_backtracking: int, dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """The stages' window rings (dropped state: rebuilt from the target's features).

        Raises:
            ValueError: max_backtracking < block_size + 1 (a verify step writes block_size + 1
                positions past the committed ones; they must not reach a live window row).
        """
        if max_backtracking < self.block_size + 1:
            raise ValueError(f"max_backtracking={max_backtracking} must be >= dspark_block_size + 1 = "
                             f"{self.block_size + 1} for the DSpark rings")
        rows = self.cfg.sliding_window + max_backtracking
        if self.codec is not None:
            shape, dtype = (rows, self.codec.row_dim), self.codec.dtype
        else:
            shape = (rows, self.cfg.head_dim)
        return tuple(StateSpec(name, shape, dtype, False) for name in self.ring_names())

    def write_context(self, features: Tensor, batch: ForwardBatch, cache: ModelCache, ops: KernelSet) -> None:
        """Project the captured target features [num_tokens, hidden · num_targets] and write every
        stage's key of each token into its ring (the target forward calls this)."""
        target, stage0 = self.target, self.mtp[0]
        main_x = ops.rms_norm(ops.linear(features, stage0.main_proj.weight), stage0.main_norm.weight,
                              self.cfg.rms_norm_eps)
        for i, stage in enumerate(self.mtp):
            ring = cache.state[f"mtp.{i}.window"]
            kv = stage.attn.keys(main_x, batch.positions, ops, target.main_inv_freq, self._kv_quant)
            _write_ring(ring, stage.attn.encode(kv, ring), batch)

    @torch.no_grad()
    def propose(self, anchor_ids: Tensor, anchor_positions: Tensor, state_slots: Tensor, cache: ModelCache, *,
                sample: Sampler = greedy_sampler, ops: KernelSet | None = None) -> DraftProposal:
        """Draft k = block_size tokens per sequence in one forward, then the Markov walk.

        Args:
            anchor_ids: [num_seqs] int64, the token the target just sampled for each sequence.
            anchor_positions: [num_seqs] int64, its position (= tokens committed before it); the
                rings must hold the target's features of every position before it.
            state_slots: [num_seqs] int64 state slots.
            sample: picks draft j from the corrected logits (default argmax; deepinfer.spec's
                `DraftSampler` for seeded temperature sampling).
        Returns:
            the drafts, their logits and confidences; the rings now hold the block's keys at
            positions anchor … anchor + k − 1, overwritten by the next target forward.
        """
        cfg, target = self.cfg, self.target
        ops = ops or kernels_for(anchor_ids.device)
        num_seqs, k = anchor_ids.shape[0], self.block_size
        tokens = torch.full((num_seqs, k), cfg.dspark_noise_token_id, dtype=torch.int64, device=anchor_ids.device)
        tokens[:, 0] = anchor_ids
        tokens = tokens.flatten()
        h = target.embed(tokens).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre_mix = None
        if self.v41:                                       # identity pre-mix: stream 0
            pre_mix = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.float32, device=h.device)
            pre_mix[:, 0] = 1.0
        for i, stage in enumerate(self.mtp):
            h, pre_mix = stage(h, pre_mix, tokens, anchor_positions, state_slots, cache.state[f"mtp.{i}.window"], ops,
                               target.main_inv_freq, self._kv_quant)
        last = self.mtp[-1]
        if self.v41:
            x = ops.hc_collapse(h, pre_mix)
        else:
            x = ops.hc_head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, hc_eps=cfg.hc_eps,
                            norm_eps=cfg.rms_norm_eps)
        base = matmul_t(ops.rms_norm(x, last.norm.weight, cfg.rms_norm_eps), target.head.weight, ops).float()
        base, x = base.view(num_seqs, k, -1), x.view(num_seqs, k, -1).float()
        markov, proj = last.markov_head, last.confidence_head.proj.weight.float()
        prev, drafts, logits, confidence = anchor_ids, [], [], []
        for j in range(k):
            e = markov.embedding(prev)
            step_logits = base[:, j] + matmul_t(e, markov.projection.weight, ops).float()
            confidence.append(torch.sigmoid(torch.cat((x[:, j], e.float()), dim=-1) @ proj.t()).squeeze(-1))
            prev = sample(j, step_logits)
            drafts.append(prev)
            logits.append(step_logits)
        return DraftProposal(torch.stack(drafts, 1), torch.stack(logits, 1), torch.stack(confidence, 1))

    def _keeps_fp32(self, name: str) -> bool:
        """As the backbone (`keeps_fp32` / `keeps_fp32_v41`), and the confidence projection, which runs
        in float32."""
        from .model import keeps_fp32
        from .model_v41 import keeps_fp32_v41
        return (keeps_fp32_v41 if self.v41 else keeps_fp32)(name) or "confidence_head" in name

    @property
    def _kv_quant(self) -> bool:
        return bool(getattr(self.target, "kv_quant", False))

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Random weights for tests: normal(0, std) matrices, unit norms and mHC scales, zero biases."""
        gen = torch.Generator(device=self.mtp[0].hc_attn_fn.device).manual_seed(seed)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if not p.dtype.is_floating_point or p.dtype == torch.float8_e4m3fn:
                continue
            if "norm" in name or name.endswith("_scale"):
                p.fill_(1.0)
            elif leaf in ("attn_sink", "bias") or name.endswith("_base"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)

    @torch.no_grad()
    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        """Fill the stages from official `mtp.{i}.…` tensors (float, e.g. `model.draft_weights`; per-expert
        `ffn.experts.{e}.w1/w2/w3` or stacked `w13` / `w2`).

        Raises:
            WeightError: a key this head does not have, a shape that differs, or a missing tensor.
        """
        state = self.state_dict()
        filled: set[str] = set()
        per_expert: dict[tuple[str, int], dict[str, Tensor]] = {}
        for key, value in tensors.items():
            hit = _EXPERT.match(key)
            if hit is not None:
                per_expert.setdefault((hit.group(1), int(hit.group(2))), {})[hit.group(3)] = value
                continue
            if key not in state:
                raise WeightError(f"unexpected draft weight {key!r} (shape {tuple(value.shape)})")
            if tuple(value.shape) != tuple(state[key].shape):
                raise WeightError(f"draft weight {key!r}: shape {tuple(value.shape)} != expected "
                                  f"{tuple(state[key].shape)}")
            state[key].copy_(value.to(state[key].dtype))
            filled.add(key)
        for (prefix, expert), parts in per_expert.items():
            experts = self.get_submodule(prefix)
            num_experts, rows, cols = experts.w13.shape
            if set(parts) != {"w1", "w2", "w3"} or expert >= num_experts:
                raise WeightError(f"draft expert {prefix}.{expert}: needs w1, w2 and w3 "
                                  f"(got {sorted(parts)}; {num_experts} experts)")
            w13 = torch.cat((parts["w1"], parts["w3"]))
            if tuple(w13.shape) != (rows, self.cfg.hidden_size):
                raise WeightError(f"draft expert {prefix}.{expert}: w1/w3 shape {tuple(parts['w1'].shape)}")
            _fill_expert(experts, expert, w13, parts["w2"])
            filled.update({f"{prefix}.w13", f"{prefix}.w2", f"{prefix}.w13_scale", f"{prefix}.w2_scale"})
        missing = sorted(k for k in state if k not in filled)
        if missing:
            raise WeightError("missing draft weight(s): " + ", ".join(missing[:5])
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

    @classmethod
    def from_model(cls, target: nn.Module, *, expert_dtype: str | None = None) -> DSparkDraft:
        """The draft head of a loaded target, from its `draft_weights` (the `mtp.*` tensors).

        Raises:
            WeightError: the checkpoint has no `mtp.*` tensors, or they do not fit this head.
            ConfigError: the config has no DSpark fields.
        """
        num_stages = num_stages_in(target.draft_weights)
        if num_stages == 0:
            raise WeightError("the checkpoint has no mtp.* draft weights (needed for speculative decoding)")
        draft = cls(target, num_stages, expert_dtype=expert_dtype)
        draft.load_weights(target.draft_weights)
        return draft.eval()


def num_stages_in(tensors: Mapping[str, Tensor]) -> int:
    """Draft stages in a set of `mtp.{i}.…` tensors (1 + the largest i; 0 when there are none)."""
    stages = [int(m.group(1)) for key in tensors if (m := _STAGE.match(key))]
    return max(stages) + 1 if stages else 0


def _fill_expert(experts: Experts, expert: int, w13: Tensor, w2: Tensor) -> None:
    if experts.expert_dtype is None:
        experts.w13[expert].copy_(w13)
        experts.w2[expert].copy_(w2)
    else:
        experts.quantise_(expert, w13.to(experts.w13_scale.device), w2.to(experts.w13_scale.device))


def _write_ring(ring: Tensor, kv: Tensor, batch: ForwardBatch) -> None:
    """Write each token's key at (its slot, position mod ring length); of a chunk longer than the ring
    only the last ring-length rows (the others would be overwritten anyway)."""
    ring_len = ring.shape[1]
    if batch.uniform_decode:
        ring[batch.state_slots, batch.positions % ring_len] = kv.to(ring.dtype)
        return
    for i in range(batch.num_seqs):
        a, b = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
        a = max(a, b - ring_len)
        ring[batch.state_slots[i], batch.positions[a:b] % ring_len] = kv[a:b].to(ring.dtype)
