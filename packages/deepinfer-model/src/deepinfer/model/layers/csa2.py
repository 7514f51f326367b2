"""DeepSeek-V4.1 attention (CSA2, spec §2.9.2–§2.9.4): a sliding window of raw KV on every layer,
plus, on layers with a compress ratio, the compressed KV of their group's KV source.

Roles (from the config's lists):
- KV source (`kv_source_layer_ids`): owns a compressor (ratio 2: gated softmax pooling of two tokens;
  ratio 1: a per-token projection); when it is an index source too, the index-key projection
  (`indexer.wk`, `indexer.k_norm`). Each completed group's latent gives, before RoPE, the index key;
  then RoPE at the group's first position and the cache's FP4 rounding give the compressed KV row.
  They land in the source's paged streams `layers.{s}.kv` / `layers.{s}.index_k`; no other layer
  has streams of its own.
- Index source (`index_source_layer_ids`): scores its queries against the index keys of the last
  layer that publishes keys (`key_source_of`) and publishes its top-k (ties to the lowest entry);
  the picks name rows of the layer's KV source. The candidate source
  (`candidate_source_layer_id`) also publishes its candidate blocks, and every later index source
  scores only inside them (two-level top-k).
- Every other layer with a ratio reuses the last published top-k over its KV source's entries.

The published top-k and candidates live for one forward (`Published`); the persistent state (window
rings, compressor rings, paged rows) is in the cache, so chunked prefill and decode give what one
prefill gives. With no index source before it, a layer attends to its window only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet
from deepinfer.kernels.reference.paged import entry_location

from ..batch import ForwardBatch
from ..cache import ModelCache
from ..config_v41 import DeepseekV41Config
from . import csa2_decode
from .attention import init_projections
from .common import RMSNorm, linear
from .csa2_decode import Published
from .v41_codecs import Codecs

PREFILL_QUERY_BLOCK = 1024     # queries gathered at once (their rows are the prefill's largest transient)
INDEX_QUERY_BLOCK = 128        # queries scored at once by an indexer ([queries, heads, keys] float32)


class Compressor(nn.Module):
    """`wkv` [head_dim, hidden], `wgate` (ratio 2 only), `norm` [head_dim]."""

    def __init__(self, cfg: DeepseekV41Config, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = linear(cfg.hidden_size, cfg.head_dim)
        self.wgate = linear(cfg.hidden_size, cfg.head_dim) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Indexer(nn.Module):
    """`wq_b` [heads·dim, q_lora], `weights_proj` [heads, hidden]; on KV sources also `wk`
    [dim, head_dim] and `k_norm` [dim] (the index keys)."""

    def __init__(self, cfg: DeepseekV41Config, owns_keys: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)
        if owns_keys:
            self.wk = linear(cfg.head_dim, cfg.index_head_dim)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)


class Attention(nn.Module):
    """One V4.1 layer's attention; parameter names are the official checkpoint's."""

    def __init__(self, cfg: DeepseekV41Config, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ratio = cfg.compress_ratios[layer]
        self.source = cfg.kv_source_of(layer)
        init_projections(self, cfg)
        is_kv_source = layer in cfg.kv_source_layer_ids
        self.compressor = Compressor(cfg, self.ratio) if is_kv_source else None
        self.indexer = Indexer(cfg, is_kv_source) if layer in cfg.index_source_layer_ids else None

    def forward(self, x: Tensor, batch: ForwardBatch, cache: ModelCache, ops: KernelSet, inv_freq: Tensor,
                codecs: Codecs, published: Published, prefix: tuple[Tensor, Tensor, tuple[int, ...]] | None = None,
                ) -> Tensor:
        """x [num_tokens, hidden] (normed) → [num_tokens, hidden]; reads and writes this layer's cache
        (and, on a KV source, its paged streams). `prefix` (prefill truncation): the normed inputs
        [n, hidden], positions [n] and per-sequence row offsets of rows just before each sequence's
        rows in `batch`, whose window KV is written to the rings first."""
        cfg, eps, pos = self.cfg, self.cfg.rms_norm_eps, batch.positions
        if prefix is not None:
            self._write_prefix(prefix, batch, cache, ops, inv_freq, codecs)
        t, h, d = x.shape[0], cfg.num_attention_heads, cfg.head_dim
        qr = ops.rms_norm(ops.linear(x, self.wq_a.weight), self.q_norm.weight, eps)
        q = ops.apply_rope(ops.linear(qr, self.wq_b.weight).view(t, h, d), pos, inv_freq)
        kv = ops.apply_rope(ops.rms_norm(ops.linear(x, self.wkv.weight), self.kv_norm.weight, eps), pos, inv_freq)
        kv = codecs.window.round_trip(kv)
        index_q = index_w = None
        if self.indexer is not None:
            ix = self.indexer
            index_q = ops.apply_rope(ops.linear(qr, ix.wq_b.weight).view(t, ix.num_heads, ix.head_dim), pos, inv_freq)
            index_q = codecs.index.round_trip(index_q)
            index_w = ops.linear(x, ix.weights_proj.weight).float() * ix.num_heads**-0.5
        comp = self._compressor_inputs(x, ops) if self.compressor is not None else None
        if batch.uniform_decode:
            out = csa2_decode.attention(self, q, kv, index_q, index_w, comp, batch, cache, ops, inv_freq, codecs,
                                        published)
        else:
            out = self._per_sequence(q, kv, index_q, index_w, comp, batch, cache, ops, inv_freq, codecs, published)
        out = ops.apply_rope(out, pos, inv_freq, inverse=True)
        grouped = ops.grouped_linear(out.reshape(t, cfg.o_groups, -1), self.wo_a.weight)
        return ops.linear(grouped.flatten(1), self.wo_b.weight)

    def _per_sequence(self, q: Tensor, kv: Tensor, index_q: Tensor | None, index_w: Tensor | None,
                      comp: tuple[Tensor, Tensor | None] | None, batch: ForwardBatch, cache: ModelCache,
                      ops: KernelSet, inv_freq: Tensor, codecs: Codecs, published: Published) -> Tensor:
        """Any query lengths: one sequence at a time, in blocks of at most PREFILL_QUERY_BLOCK queries."""
        cfg, pos, d = self.cfg, batch.positions, self.cfg.head_dim
        out = torch.empty_like(q)
        rings = cache.state[f"layers.{self.layer}.window"]
        for i in range(batch.num_seqs):
            a, b = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
            start, slot, table = batch.start_positions[i], batch.state_slots[i], batch.block_tables[i]
            num_entries, num_keys, key_source, picks, candidates = 0, 0, None, [], []
            if self.ratio and self.source is not None:    # a layer with a ratio has a KV source (config check)
                if comp is not None:
                    self._compress(comp[0][a:b], None if comp[1] is None else comp[1][a:b], start, slot, table,
                                   cache, ops, inv_freq, codecs)
                num_entries = (start + b - a) // cfg.compress_ratios[self.source]
                key_source = cfg.key_source_of(self.layer)
                if self.indexer is not None and key_source is not None:
                    num_keys = (start + b - a) // cfg.compress_ratios[key_source]
            for lo in range(a, b, PREFILL_QUERY_BLOCK):
                hi = min(b, lo + PREFILL_QUERY_BLOCK)
                block_picks = None
                if num_keys and key_source is not None and index_q is not None and index_w is not None:
                    block_picks, block_candidates = self._select(i, index_q[lo:hi], index_w[lo:hi], pos[lo:hi],
                                                                 lo - a, key_source, num_keys, table, cache, ops,
                                                                 published)
                    picks.append(block_picks)
                    candidates.append(block_candidates)
                elif (published_picks := published.picks[i]) is not None:
                    block_picks = published_picks[lo - a:hi - a]
                # The window comes from this chunk's rows and, before the chunk, the ring (not yet overwritten).
                paged = tables = ids = None
                ratio = 1
                if block_picks is not None and num_entries and self.source is not None:
                    ratio = cfg.compress_ratios[self.source]
                    ids = torch.where((block_picks >= 0) & (block_picks < num_entries), block_picks, -1)
                    paged, tables = cache.paged[f"layers.{self.source}.kv"], table.expand(hi - lo, -1)
                out[lo:hi] = ops.v41_attention(q[lo:hi], pos[lo:hi], rings, slot.expand(hi - lo), cfg.sliding_window,
                                               self.attn_sink, d**-0.5, kv[a:b], start, paged, tables, ids, ratio)
            if picks:
                published.picks[i] = torch.cat(picks)
                if candidates[0] is not None:
                    published.candidates[i] = torch.cat(candidates)
            ring = rings[slot]
            keep = max(start, start + b - a - ring.shape[0])
            write = torch.arange(keep, start + b - a, device=kv.device)
            ring[write % ring.shape[0]] = codecs.window.encode(kv[a + keep - start:b])
        return out

    # --- window -------------------------------------------------------------------------------------
    def _write_prefix(self, prefix: tuple[Tensor, Tensor, tuple[int, ...]], batch: ForwardBatch, cache: ModelCache,
                      ops: KernelSet, inv_freq: Tensor, codecs: Codecs) -> None:
        x, pos, cu = prefix
        if not x.shape[0]:
            return
        eps = self.cfg.rms_norm_eps
        kv = ops.apply_rope(ops.rms_norm(ops.linear(x, self.wkv.weight), self.kv_norm.weight, eps), pos, inv_freq)
        rows = codecs.window.encode(kv)
        rings = cache.state[f"layers.{self.layer}.window"]
        for i in range(batch.num_seqs):
            a, b = cu[i], cu[i + 1]
            keep = max(a, b - rings.shape[1])
            rings[batch.state_slots[i], pos[keep:b] % rings.shape[1]] = rows[keep:b]

    # --- KV source: compression and index keys ------------------------------------------------------
    def _compressor_inputs(self, x: Tensor, ops: KernelSet) -> tuple[Tensor, Tensor | None]:
        """Ratio 1: the normed latent of every token (model dtype). Ratio 2: (kv, gate) in float32."""
        c = self.compressor
        assert c is not None, "called on KV sources only"
        if c.wgate is None:
            return ops.rms_norm(ops.linear(x, c.wkv.weight), c.norm.weight, self.cfg.rms_norm_eps), None
        xf = x.float()
        return xf @ c.wkv.weight.float().t(), xf @ c.wgate.weight.float().t()     # pooled in float32

    def _compress(self, kv: Tensor, gate: Tensor | None, start: int, slot: Tensor, table: Tensor, cache: ModelCache,
                  ops: KernelSet, inv_freq: Tensor, codecs: Codecs) -> None:
        """Emit the groups that complete in this chunk of one sequence into the layer's paged streams."""
        r, end = self.ratio, start + kv.shape[0]
        assert self.compressor is not None, "called on KV sources only"
        if gate is None:
            latents, ids = kv, torch.arange(start, end, device=kv.device)
        else:
            ring_k = cache.state[f"layers.{self.layer}.compressor.kv"][slot]
            ring_g = cache.state[f"layers.{self.layer}.compressor.gate"][slot]
            ring_len = ring_k.shape[0]
            first, stop = start // r, end // r
            ids = torch.arange(first, stop, device=kv.device)
            latents = None
            if stop > first:
                p = torch.arange(first * r, stop * r, device=kv.device)
                inside = (p >= start)[:, None]
                kk = torch.where(inside, kv[(p - start).clamp(min=0)], ring_k[p % ring_len]).view(-1, r, kv.shape[1])
                gg = torch.where(inside, gate[(p - start).clamp(min=0)], ring_g[p % ring_len]).view(-1, r, kv.shape[1])
                pooled = (kk * gg.softmax(dim=1)).sum(dim=1)
                latents = ops.rms_norm(pooled.to(self.wq_a.weight.dtype), self.compressor.norm.weight,
                                       self.cfg.rms_norm_eps)
            keep = max(start, end - ring_len)
            write = torch.arange(keep, end, device=kv.device)
            ring_k[write % ring_len] = kv[keep - start:]
            ring_g[write % ring_len] = gate[keep - start:]
            if latents is None:
                return
        positions = ids * r
        blocks, slots, _ = entry_location(table, ids, r, cache.spec.block_size)
        ix = self.indexer
        if ix is not None:
            keys = ops.rms_norm(ops.linear(latents, ix.wk.weight), ix.k_norm.weight, self.cfg.rms_norm_eps)
            keys = ops.apply_rope(keys, positions, inv_freq)
            cache.paged[f"layers.{self.layer}.index_k"][blocks, slots] = codecs.index.encode(keys)
        rows = ops.apply_rope(latents, positions, inv_freq)
        cache.paged[f"layers.{self.layer}.kv"][blocks, slots] = codecs.kv.encode(rows)

    # --- index sources ------------------------------------------------------------------------------
    def _select(self, i: int, index_q: Tensor, index_w: Tensor, pos: Tensor, row: int, key_source: int,
                num_keys: int, table: Tensor, cache: ModelCache, ops: KernelSet,
                published: Published) -> tuple[Tensor, Tensor | None]:
        """Top-k of queries `row` … of sequence i against the first `num_keys` index keys of `key_source`
        (read packed through `table` by `ops.v41_index_scores`) and, at the candidate source, their
        candidate mask; in sub-blocks of INDEX_QUERY_BLOCK queries (the [queries, heads, keys] scores
        are the indexer's largest transient)."""
        cfg = self.cfg
        assert self.indexer is not None, "called on index sources only"
        picks, masks = [], []
        ids = torch.arange(num_keys, device=table.device)
        keys = cache.paged[f"layers.{key_source}.index_k"]
        candidate = cfg.candidate_source_layer_id
        for lo in range(0, index_q.shape[0], INDEX_QUERY_BLOCK):
            hi = min(index_q.shape[0], lo + INDEX_QUERY_BLOCK)
            scores = ops.v41_index_scores(index_q[lo:hi], keys, table, num_keys, index_w[lo:hi],
                                          self.indexer.head_dim**-0.5, cfg.compress_ratios[key_source])
            visible = torch.div(pos[lo:hi] + 1, self.ratio, rounding_mode="floor")
            scores = scores.masked_fill(ids[None, :] >= visible[:, None], float("-inf"))
            if self.layer == candidate:
                masks.append(ops.candidate_blocks(scores, visible, cfg.candidate_topk_blocks,
                                                  cfg.candidate_block_size))
            elif 0 <= candidate < self.layer and (published_mask := published.candidates[i]) is not None:
                allowed = published_mask[row + lo:row + hi]
                width = min(allowed.shape[1], num_keys)
                outside = torch.ones_like(scores, dtype=torch.bool)
                outside[:, :width] = ~allowed[:, :width]
                scores = scores.masked_fill(outside, float("-inf"))
            picks.append(ops.topk_finite(scores, cfg.index_topk))
        return torch.cat(picks), (torch.cat(masks) if masks else None)
