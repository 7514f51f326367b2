"""DeepSeek-V4 attention: single-latent MQA over the sliding window ∪ compressed rows.

Every layer keeps a window ring of raw KV; CSA layers add an overlapping ratio-r compressor and a
lightning indexer that picks `index_topk` compressed rows per query; HCA layers attend to every
visible compressed row. K = V = the 512-d latent with RoPE on its trailing dims, so the output's
rope dims are rotated back at the query position before the grouped low-rank output projection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet
from deepinfer.kernels.reference.paged import entry_location

from ..batch import ForwardBatch
from ..cache import ModelCache
from ..config import CSA, HCA, DeepseekV4Config

if TYPE_CHECKING:
    from ..config_v41 import DeepseekV41Config
from . import batched_decode
from .common import RMSNorm, hadamard, linear, matmul_t, stacked_weight
from .compressor import Compressor

RowPost = Callable[[Tensor, KernelSet], Tensor]   # quantisation applied to freshly compressed rows


class Projections(NamedTuple):
    """A layer's projections of its input tokens (num_tokens = t):
    q [t, heads, head_dim] and kv [t, head_dim] (RMSNorm + RoPE applied, KV-quantised when asked);
    index_q [t, index heads, index dim] and index_w [t, index heads] float32 (CSA only); the
    compressors' (kv, gate) inputs [t, mult·width] in the model dtype (column views of one GEMM
    output), for the layer's compressor and the indexer's (None where absent)."""

    q: Tensor
    kv: Tensor
    index_q: Tensor | None
    index_w: Tensor | None
    comp: tuple[Tensor, Tensor] | None
    index_comp: tuple[Tensor, Tensor] | None

# Prefill queries gathered at once: their [queries, window + picks, head_dim] rows (and float32
# copies) are the prefill's largest transient, ≈ 3 MB per query at V4-Flash sizes (≈ 3 GB per block).
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
        """Any query lengths: one sequence at a time, in blocks of at most PREFILL_QUERY_BLOCK queries
        (each block is a prefill chunk of its own, so the gathered rows stay small)."""
        out = torch.empty_like(p.q)
        for i in range(batch.num_seqs):
            a, b = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
            for lo in range(a, b, PREFILL_QUERY_BLOCK):
                hi = min(b, lo + PREFILL_QUERY_BLOCK)
                start = batch.start_positions[i] + lo - a
                rows, valid = self._gather_rows(i, lo, hi, start, p, batch, cache, ops, inv_freq, kv_quant)
                out[lo:hi] = ops.sparse_attention(p.q[lo:hi], rows, valid, self.attn_sink, self.cfg.head_dim**-0.5)
        return out

    def _quant_index(self, x: Tensor, ops: KernelSet) -> Tensor:
        """Official V4 numerics of index queries and keys: Hadamard rotation, then FP4 (block 32)."""
        return ops.fake_quant_fp4(matmul_t(x, hadamard(x.shape[-1], x.device).to(x.dtype), ops), 32)   # Hᵀ = H

    def _quant_kv(self, kv: Tensor, ops: KernelSet) -> Tensor:
        """Official V4 numerics: FP8 (block 64, ue8m0) on the nope dims; rope dims untouched."""
        rope = self.cfg.qk_rope_head_dim
        return torch.cat((ops.fake_quant_fp8(kv[..., :-rope], 64), kv[..., -rope:]), dim=-1)

    def _gather_rows(
        self, i: int, a: int, b: int, start: int, p: Projections, batch: ForwardBatch, cache: ModelCache,
        ops: KernelSet, inv_freq: Tensor, kv_quant: bool,
    ) -> tuple[Tensor, Tensor]:
        """KV rows each query of rows a … b − 1 (sequence i, positions from `start`) attends to:
        [q, rows, head_dim] and a validity mask."""
        window, kv = self.cfg.sliding_window, p.kv
        q_len = b - a
        slot = batch.state_slots[i]
        pos = batch.positions[a:b]
        # Window: the ring holds positions < start; this chunk's rows come from kv directly.
        ring = cache.state[f"layers.{self.layer}.window"][slot]
        ring_len = ring.shape[0]
        key_pos = pos[:, None] - window + 1 + torch.arange(window, device=kv.device)[None, :]   # [q, W]
        in_chunk = key_pos >= start
        win_rows = torch.where(
            in_chunk[..., None],
            kv[a + (key_pos - start).clamp(0, q_len - 1)],
            ring[key_pos.clamp(min=0) % ring_len],
        )
        win_valid = key_pos >= 0
        keep = max(start, start + q_len - ring_len)
        ring[torch.arange(keep, start + q_len, device=kv.device) % ring_len] = kv[a + keep - start:b]
        if self.compressor is None:
            return win_rows, win_valid
        table = batch.block_tables[i]
        comp_rows, comp_valid = self._compressed_rows(a, b, p, table, slot, start, pos, cache, ops, inv_freq,
                                                      kv_quant)
        return torch.cat((win_rows, comp_rows), dim=1), torch.cat((win_valid, comp_valid), dim=1)

    def _compress_chunk(
        self, comp: Compressor, stream: str, state: str, inputs: tuple[Tensor, Tensor], pos: Tensor, start: int,
        slot: Tensor, table: Tensor, cache: ModelCache, ops: KernelSet, inv_freq: Tensor, post: RowPost | None,
    ) -> Tensor:
        """Run one compressor over a sequence's chunk (its projected (kv, gate) rows), write the
        windows it closes into the paged `stream`, and return every compressed row of the sequence
        so far [entries, width]."""
        r, block_size = self.ratio, cache.spec.block_size
        paged = cache.paged[stream]
        k, g = comp.pool_inputs(*inputs, pos)
        ring_k, ring_g = cache.state[f"{state}.kv"][slot], cache.state[f"{state}.gate"][slot]
        ids, new_rows = comp.compress(k, g, start, ring_k, ring_g, ops, inv_freq, self.cfg.rms_norm_eps)
        if post is not None and len(ids):
            new_rows = post(new_rows, ops)
        blocks, rows, _ = entry_location(table, ids, r, block_size)
        paged[blocks, rows] = new_rows.to(paged.dtype)
        all_ids = torch.arange((start + k.shape[0]) // r, device=k.device)
        blocks, rows, _ = entry_location(table, all_ids, r, block_size)
        return paged[blocks, rows]

    def _compressed_rows(
        self, a: int, b: int, p: Projections, table: Tensor, slot: Tensor, start: int, pos: Tensor,
        cache: ModelCache, ops: KernelSet, inv_freq: Tensor, kv_quant: bool,
    ) -> tuple[Tensor, Tensor]:
        layer = self.layer
        entries = self._compress_chunk(self.compressor, f"layers.{layer}.kv", f"layers.{layer}.compressor",
                                       (p.comp[0][a:b], p.comp[1][a:b]), pos, start, slot, table, cache, ops,
                                       inv_freq, self._quant_kv if kv_quant else None)
        visible = (pos + 1) // self.ratio                                  # entries usable per query
        if self.kind == HCA:
            ids = torch.arange(entries.shape[0], device=entries.device)
            return entries.unsqueeze(0).expand(b - a, -1, -1), ids[None, :] < visible[:, None]
        ix = self.indexer
        keys = self._compress_chunk(ix.compressor, f"layers.{layer}.index_k", f"layers.{layer}.indexer",
                                    (p.index_comp[0][a:b], p.index_comp[1][a:b]), pos, start, slot, table, cache,
                                    ops, inv_freq, self._quant_index if kv_quant else None)
        scores = ops.indexer_scores(p.index_q[a:b], keys, p.index_w[a:b], ix.head_dim**-0.5)
        picks = ops.topk_lowest_index(scores, visible, ix.topk)            # [q, k], −1 = none
        return entries[picks.clamp(min=0)], picks >= 0
