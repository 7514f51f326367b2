"""DeepSeek-V4 attention: single-latent MQA over the sliding window ∪ compressed rows.

Every layer keeps a window ring of raw KV; CSA layers add an overlapping ratio-r compressor and a
lightning indexer that picks `index_topk` compressed rows per query; HCA layers attend to every
visible compressed row. K = V = the 512-d latent with RoPE on its trailing dims, so the output's
rope dims are rotated back at the query position before the grouped low-rank output projection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet
from deepinfer.kernels.reference.paged import entry_location

from ..batch import ForwardBatch
from ..cache import ModelCache
from ..config import CSA, DeepseekV4Config

if TYPE_CHECKING:
    from ..config_v41 import DeepseekV41Config
from . import batched_decode
from .common import RMSNorm, hadamard, linear, matmul_t, stacked_weight
from .compressor import Compressor
from .projections import Projections

RowPost = Callable[[Tensor, KernelSet], Tensor]   # quantisation applied to freshly compressed rows


# Prefill queries the indexer scores at once, against the entries the block's last query sees: bounds
# the [queries, entries] float32 scores, and skips the entries no query of a block can pick (at one
# 8K chunk it scores 56% of what scoring every query against every entry would: 44% skipped).
PREFILL_QUERY_BLOCK = 1024


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: `wq_b` [heads·dim, q_lora], `weights_proj` [heads, hidden],
    and its own overlapping compressor of width `index_head_dim` (the index keys)."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, ratio, True, cfg.rms_norm_eps)


def init_projections(module: nn.Module, cfg: DeepseekV4Config | DeepseekV41Config) -> None:
    """Give `module` the projections every V4-family attention has, under the official names:
    `wq_a`, `q_norm`, `wq_b` (queries through the q LoRA), `wkv`, `kv_norm` (the one KV head),
    `wo_a`, `wo_b` (grouped output LoRA) and the per-head `attn_sink` (float32)."""
    h, d = cfg.num_attention_heads, cfg.head_dim
    module.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
    module.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
    module.wq_b = linear(cfg.q_lora_rank, h * d)
    module.wkv = linear(cfg.hidden_size, d)
    module.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
    module.wo_a = linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
    module.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
    module.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))


class Attention(nn.Module):
    """One layer's attention. Parameter names follow the official checkpoint (`wq_a`, `q_norm`,
    `wq_b`, `wkv`, `kv_norm`, `wo_a`, `wo_b`, `attn_sink`, `compressor.*`, `indexer.*`)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.kind, self.ratio = cfg.attention_types[layer], cfg.compress_ratios[layer]
        d = cfg.head_dim
        init_projections(self, cfg)
        self.compressor = Compressor(cfg.hidden_size, d, self.ratio, self.kind == CSA, cfg.rms_norm_eps) \
            if self.ratio else None
        self.indexer = Indexer(cfg, self.ratio) if self.kind == CSA else None

    def forward(
        self, x: Tensor, batch: ForwardBatch, cache: ModelCache, ops: KernelSet, inv_freq: Tensor, kv_quant: bool
    ) -> Tensor:
        """x [num_tokens, hidden] (normed) → [num_tokens, hidden]; reads and writes this layer's cache."""
        cfg = self.cfg
        p = self._project(x, batch.positions, ops, inv_freq, kv_quant)
        if batch.uniform_decode:
            out = batched_decode.attention(self, p, batch, cache, ops, inv_freq, kv_quant)
        else:
            out = self._prefill_attention(p, batch, cache, ops, inv_freq, kv_quant)
        out = ops.apply_rope(out, batch.positions, inv_freq, inverse=True)
        grouped = ops.grouped_linear(out.reshape(x.shape[0], cfg.o_groups, -1), self.wo_a.weight)
        return ops.linear(grouped.flatten(1), self.wo_b.weight)

    def _project(self, x: Tensor, pos: Tensor, ops: KernelSet, inv_freq: Tensor, kv_quant: bool) -> Projections:
        """Every projection of x, in two stacked GEMMs: x → [wq_a; wkv; indexer weights; compressors'
        wkv, wgate], then the query latent → [wq_b; indexer wq_b]."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        num_tokens = x.shape[0]
        x_projs = self._x_projections()
        parts = dict(zip(x_projs, ops.linear(x, stacked_weight(self, "_x_weight", list(x_projs.values())))
                         .split([m.out_features for m in x_projs.values()], dim=-1), strict=True))
        qr = ops.rms_norm(parts["wq_a"], self.q_norm.weight, eps)
        q_projs = [self.wq_b] + ([self.indexer.wq_b] if self.indexer is not None else [])
        qq = ops.linear(qr, stacked_weight(self, "_q_weight", q_projs))
        h, d = cfg.num_attention_heads, cfg.head_dim
        q = ops.norm_rope(qq[:, :h * d].view(num_tokens, h, d), None, eps, pos, inv_freq)
        kv = ops.norm_rope(parts["wkv"], self.kv_norm.weight, eps, pos, inv_freq)
        if kv_quant:
            kv = self._quant_kv(kv, ops)
        index_q = index_w = None
        if self.indexer is not None:
            ix = self.indexer
            index_q = ops.apply_rope(qq[:, h * d:].view(num_tokens, ix.num_heads, ix.head_dim), pos, inv_freq)
            index_w = parts["weights_proj"].float() * ix.num_heads**-0.5
            if kv_quant:
                index_q = self._quant_index(index_q, ops)
        comp = (parts["comp.wkv"], parts["comp.wgate"]) if self.compressor is not None else None
        index_comp = (parts["index.wkv"], parts["index.wgate"]) if self.indexer is not None else None
        return Projections(q, kv, index_q, index_w, comp, index_comp)

    def _x_projections(self) -> dict[str, nn.Linear]:
        """The projections of the layer's input, in stacking order."""
        projs = {"wq_a": self.wq_a, "wkv": self.wkv}
        if self.indexer is not None:
            projs["weights_proj"] = self.indexer.weights_proj
        if self.compressor is not None:
            projs["comp.wkv"], projs["comp.wgate"] = self.compressor.wkv, self.compressor.wgate
        if self.indexer is not None:
            projs["index.wkv"], projs["index.wgate"] = self.indexer.compressor.wkv, self.indexer.compressor.wgate
        return projs

    def _prefill_attention(self, p: Projections, batch: ForwardBatch, cache: ModelCache, ops: KernelSet,
                           inv_freq: Tensor, kv_quant: bool) -> Tensor:
        """Any query lengths, one sequence at a time: the window ring and the compressors advance over
        the sequence's whole chunk at once, the entries are picked (`_entry_ids`), then all its queries
        attend to their window and entries read in place (`ops.prefill_attention`, one launch)."""
        window, scale = self.cfg.sliding_window, self.cfg.head_dim**-0.5
        outs = []
        for i in range(batch.num_seqs):
            a, b = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
            start, slot, table = batch.start_positions[i], batch.state_slots[i:i + 1], batch.block_tables[i]
            window_kv = self._advance_window(p.kv[a:b], start, slot, cache)
            paged = keys = None
            if self.compressor is not None:
                paged, keys = self._compress_sequence(a, b, p, start, slot, table, cache, ops, inv_freq, kv_quant)
            ids = None if paged is None else self._entry_ids(p, a, b, start, batch.positions[a:b], keys, ops)
            outs.append(ops.prefill_attention(p.q[a:b], window_kv, start, window, self.attn_sink, scale, paged,
                                              table, ids, self.ratio))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _advance_window(self, kv: Tensor, start: int, slot: Tensor, cache: ModelCache) -> Tensor:
        """The KV rows of positions start − window … start + len(kv) − 1 as `ops.prefill_attention` reads
        them ([window + len(kv), head_dim]: the ring's last `window` rows, then the chunk's), read before
        the chunk's last rows overwrite the ring."""
        window = self.cfg.sliding_window
        ring = cache.state[f"layers.{self.layer}.window"]                # [num_slots, ring, head_dim]
        ring_len, end = ring.shape[1], start + kv.shape[0]
        earlier = torch.arange(start - window, start, device=kv.device).clamp(min=0) % ring_len
        window_kv = torch.cat((ring[slot, earlier].to(kv.dtype), kv))
        keep = max(start, end - ring_len)
        ring[slot, torch.arange(keep, end, device=kv.device) % ring_len] = kv[keep - start:].to(ring.dtype)
        return window_kv

    def _quant_index(self, x: Tensor, ops: KernelSet) -> Tensor:
        """Official V4 numerics of index queries and keys: Hadamard rotation, then FP4 (block 32)."""
        return ops.fake_quant_fp4(matmul_t(x, hadamard(x.shape[-1], x.device).to(x.dtype), ops), 32)   # Hᵀ = H

    def _quant_kv(self, kv: Tensor, ops: KernelSet) -> Tensor:
        """Official V4 numerics: FP8 (block 64, ue8m0) on the nope dims; rope dims untouched."""
        rope = self.cfg.qk_rope_head_dim
        return torch.cat((ops.fake_quant_fp8(kv[..., :-rope], 64), kv[..., -rope:]), dim=-1)

    def _compress_chunk(
        self, comp: Compressor, stream: str, state: str, inputs: tuple[Tensor, Tensor], pos: Tensor, start: int,
        slot: Tensor, table: Tensor, cache: ModelCache, ops: KernelSet, inv_freq: Tensor, post: RowPost | None,
    ) -> Tensor:
        """Run one compressor over a sequence's chunk (its projected (kv, gate) rows) and write the
        windows it closes into the paged `stream`; returns the stream [num_blocks, rows, width]."""
        paged = cache.paged[stream]
        ids, new_rows = comp.compress(*inputs, pos, start, cache.state[f"{state}.kv"], cache.state[f"{state}.gate"],
                                      slot, ops, inv_freq, self.cfg.rms_norm_eps)
        if post is not None and len(ids):
            new_rows = post(new_rows, ops)
        blocks, rows, _ = entry_location(table, ids, self.ratio, cache.spec.block_size)
        paged[blocks, rows] = new_rows.to(paged.dtype)
        return paged

    def _compress_sequence(
        self, a: int, b: int, p: Projections, start: int, slot: Tensor, table: Tensor, cache: ModelCache,
        ops: KernelSet, inv_freq: Tensor, kv_quant: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Advance the layer's compressors over rows a … b − 1 (one sequence's chunk): the paged KV
        stream, and on CSA layers the index keys of every entry so far [entries, index_head_dim]."""
        layer = self.layer
        assert self.compressor is not None and p.comp is not None, "called on compressed layers only"
        pos = torch.arange(start, start + b - a, device=p.kv.device)
        paged = self._compress_chunk(self.compressor, f"layers.{layer}.kv", f"layers.{layer}.compressor",
                                     (p.comp[0][a:b], p.comp[1][a:b]), pos, start, slot, table, cache, ops, inv_freq,
                                     self._quant_kv if kv_quant else None)
        if self.indexer is None or p.index_comp is None:
            return paged, None
        index_paged = self._compress_chunk(self.indexer.compressor, f"layers.{layer}.index_k",
                                           f"layers.{layer}.indexer", (p.index_comp[0][a:b], p.index_comp[1][a:b]),
                                           pos, start, slot, table, cache, ops, inv_freq,
                                           self._quant_index if kv_quant else None)
        ids = torch.arange((start + b - a) // self.ratio, device=pos.device)
        blocks, rows, _ = entry_location(table, ids, self.ratio, cache.spec.block_size)
        return paged, index_paged[blocks, rows]

    def _entry_ids(self, p: Projections, a: int, b: int, start: int, pos: Tensor, keys: Tensor | None,
                   ops: KernelSet) -> Tensor:
        """The compressed entries rows a … b − 1 (one sequence's chunk from position `start`; `pos` their
        positions) attend to, [b − a, k] int64 with −1 = none: every visible one (HCA), or the indexer's
        top-k (CSA), scored PREFILL_QUERY_BLOCK queries at a time against the entries they can see."""
        r = self.ratio
        visible = (pos + 1) // r                                           # entries usable per query
        if self.indexer is None:
            ids = torch.arange((start + b - a) // r, device=pos.device)[None, :]
            return torch.where(ids < visible[:, None], ids, -1)
        ix = self.indexer
        assert keys is not None and p.index_q is not None and p.index_w is not None, "CSA layers project these"
        picks = None
        for lo in range(0, b - a, PREFILL_QUERY_BLOCK):
            hi = min(b - a, lo + PREFILL_QUERY_BLOCK)
            seen = (start + hi) // r                                        # entries the block's last query sees
            scores = ops.indexer_scores(p.index_q[a + lo:a + hi], keys[:seen], p.index_w[a + lo:a + hi],
                                        ix.head_dim**-0.5)
            block = ops.topk_lowest_index(scores, visible[lo:hi], ix.topk)   # [hi − lo, min(k, seen)]
            if hi - lo == b - a:
                return block
            if picks is None:
                picks = torch.full((b - a, min(ix.topk, (start + b - a) // r)), -1, dtype=torch.int64,
                                   device=pos.device)
            picks[lo:hi, :block.shape[1]] = block
        return picks
