"""Attention of a decode step, for all sequences at once (one query token each).

Same result as the per-sequence path of `Attention`, but with static shapes and through the ops that
read the cache in place (`deepinfer.kernels.reference.paged` and their fused twins): the compressed
entries a sequence may attend to are `max_context_len // ratio` for every sequence (masked by
visibility), and a window that did not close writes nothing. No host synchronisation, so the step
can be captured in a CUDA graph keyed by the number of sequences.

Multi-token decode (`ForwardBatch.multi_decode`, `max_query_len` > 1: the verify rows of speculative
decoding) runs through the same code with one virtual sequence per token, several sharing a row's
state slot and block table. It stays exact because every write a token's reads depend on lands
before any read:

- the window ring: every token's row is written (one scatter) before attention; a later token of
  the same row at p' <= p + max_query_len − 1 overwrites only the ring row of position
  p' − ring_len < p − window + 1, older than anything the token at p reads, as long as the ring has
  window + max_query_len − 1 rows or more;
- the compressors: a window closed by the token at p pools positions down to p − span + 1
  (span = ratio, 2·ratio on overlapping CSA compressors), some of them fed by earlier tokens of the
  same step. The fused kernel runs one program per token, so these rows are first written to the
  compressor rings by a separate scatter (`_prewrite`; the kernel then rewrites the same values)
  — the ring must hold span + max_query_len − 1 rows;
- closed windows land in the paged streams inside the compressor launch, before the indexer scores
  and the attention read them; an entry closed by a later token of the row is beyond what an
  earlier token may see ((p + 1) // ratio entries), so it is masked like any future entry.

Rejected drafts need nothing: the next step rewrites their positions (ring rows, compressor rows,
closed entries) before any token reads them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.kernels import KernelSet
from deepinfer.kernels.reference.paged import store_closed_rows

from ..batch import ForwardBatch
from ..cache import ModelCache
from .projections import Projections


def _compress(comp, inputs: tuple[Tensor, Tensor], prefix: str, paged: Tensor, batch: ForwardBatch,
              cache: ModelCache, ops: KernelSet, inv_freq: Tensor, eps: float, post=None) -> None:
    """Advance one compressor by one token per sequence, given its projected (kv, gate) rows; closed
    windows land in `paged` (after `post`, the KV quantisation, when given)."""
    pos = batch.positions
    k, g = inputs
    if batch.max_query_len > 1:
        _prewrite(comp, k, g, pos, batch.state_slots, cache.state[f"{prefix}.kv"], cache.state[f"{prefix}.gate"],
                  batch.max_query_len, prefix)
    rows = ops.compress_decode(k, g, comp.ape, pos, batch.state_slots, cache.state[f"{prefix}.kv"],
                               cache.state[f"{prefix}.gate"], comp.norm.weight, inv_freq, eps, overlap=comp.overlap,
                               paged=None if post else paged, block_tables=None if post else batch.block_tables)
    if post is not None:
        store_closed_rows(paged, post(rows), pos, batch.block_tables, comp.ratio)


def _prewrite(comp, k: Tensor, g: Tensor, pos: Tensor, slots: Tensor, ring_k: Tensor, ring_g: Tensor,
              max_query_len: int, prefix: str) -> None:
    """Write every token's float32 (kv, gate + ape) compressor rows at position mod ring, as
    `compress_decode` does, so a window closed by one token sees the rows of the step's earlier tokens
    of its row whatever order the kernel's programs run in."""
    ring = ring_k.shape[1]
    need = comp.ring_len + max_query_len - 1
    if ring < need:
        raise ValueError(f"{prefix}: a ring of {ring} rows cannot hold {max_query_len} query tokens per row "
                         f"(needs {need}: cache_spec(max_backtracking >= {max_query_len - 1}))")
    at = pos % ring
    ring_k[slots, at] = k.float()
    ring_g[slots, at] = g.float() + comp.ape[pos % comp.ratio]


def attention(attn, p: Projections, batch: ForwardBatch, cache: ModelCache, ops: KernelSet, inv_freq: Tensor,
              kv_quant: bool) -> Tensor:
    """Write each token's KV into its window ring, advance the compressors, pick the compressed
    entries (CSA: indexer top-k; HCA: all visible) and attend: [num_seqs, heads, head_dim].
    `p`: the layer's `Projections` of the step's tokens."""
    cfg, layer, r = attn.cfg, attn.layer, attn.ratio
    pos, slots, q, kv = batch.positions, batch.state_slots, p.q, p.kv
    ring = cache.state[f"layers.{layer}.window"]
    if ring.shape[1] < cfg.sliding_window + batch.max_query_len - 1:
        raise ValueError(f"layers.{layer}.window: a ring of {ring.shape[1]} rows cannot hold {batch.max_query_len} "
                         f"query tokens per row (needs window + {batch.max_query_len - 1}: "
                         f"cache_spec(max_backtracking >= {batch.max_query_len - 1}))")
    ring[slots, pos % ring.shape[1]] = kv.to(ring.dtype)
    sink, scale = attn.attn_sink, cfg.head_dim**-0.5
    if attn.compressor is None or p.comp is None:     # both or neither (`Projections`)
        return ops.paged_decode_attention(q, ring, slots, pos, cfg.sliding_window, sink, scale)
    eps = cfg.rms_norm_eps
    paged_kv = cache.paged[f"layers.{layer}.kv"]
    quant = (lambda rows: attn._quant_kv(rows, ops)) if kv_quant else None
    _compress(attn.compressor, p.comp, f"layers.{layer}.compressor", paged_kv, batch, cache, ops, inv_freq, eps,
              quant)
    num_entries = max(batch.max_context_len // r, 1)
    visible = (pos + 1) // r
    if attn.indexer is None or p.index_comp is None:
        ids = torch.arange(num_entries, device=q.device)[None, :]
        picks = torch.where(ids < visible[:, None], ids, -1)
    else:
        ix = attn.indexer
        paged_ik = cache.paged[f"layers.{layer}.index_k"]
        key_post = (lambda keys: attn._quant_index(keys, ops)) if kv_quant else None
        _compress(ix.compressor, p.index_comp, f"layers.{layer}.indexer", paged_ik, batch, cache, ops, inv_freq, eps,
                  key_post)
        scores = ops.paged_indexer_scores(p.index_q, paged_ik, batch.block_tables, num_entries, p.index_w,
                                          ix.head_dim**-0.5, r)
        picks = ops.topk_lowest_index(scores, visible, ix.topk)
    return ops.paged_decode_attention(q, ring, slots, pos, cfg.sliding_window, sink, scale, paged_kv,
                                      batch.block_tables, picks, r)
