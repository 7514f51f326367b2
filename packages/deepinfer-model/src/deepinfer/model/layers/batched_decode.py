"""Attention of a decode step, for all sequences at once (one query token each).

Same result as the per-sequence path of `Attention`, but with static shapes and through the ops that
read the cache in place (`deepinfer.kernels.reference.paged` and their fused twins): the compressed
entries a sequence may attend to are `max_context_len // ratio` for every sequence (masked by
visibility), and a window that did not close writes nothing. No host synchronisation, so the step
can be captured in a CUDA graph keyed by the number of sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from deepinfer.kernels import KernelSet
from deepinfer.kernels.reference.paged import store_closed_rows

from ..batch import ForwardBatch
from ..cache import ModelCache

if TYPE_CHECKING:
    from .attention import Projections


def _compress(comp, inputs: tuple[Tensor, Tensor], prefix: str, paged: Tensor, batch: ForwardBatch,
              cache: ModelCache, ops: KernelSet, inv_freq: Tensor, eps: float, post=None) -> None:
    """Advance one compressor by one token per sequence, given its projected (kv, gate) rows; closed
    windows land in `paged` (after `post`, the KV quantisation, when given)."""
    pos = batch.positions
    k, g = inputs
    rows = ops.compress_decode(k, g, comp.ape, pos, batch.state_slots, cache.state[f"{prefix}.kv"],
                               cache.state[f"{prefix}.gate"], comp.norm.weight, inv_freq, eps, overlap=comp.overlap,
                               paged=None if post else paged, block_tables=None if post else batch.block_tables)
    if post is not None:
        store_closed_rows(paged, post(rows), pos, batch.block_tables, comp.ratio)


def attention(attn, p: Projections, batch: ForwardBatch, cache: ModelCache, ops: KernelSet, inv_freq: Tensor,
              kv_quant: bool) -> Tensor:
    """Write each token's KV into its window ring, advance the compressors, pick the compressed
    entries (CSA: indexer top-k; HCA: all visible) and attend: [num_seqs, heads, head_dim].
    `p`: the layer's `Projections` of the step's tokens."""
    cfg, layer, r = attn.cfg, attn.layer, attn.ratio
    pos, slots, q, kv = batch.positions, batch.state_slots, p.q, p.kv
    ring = cache.state[f"layers.{layer}.window"]
    ring[slots, pos % ring.shape[1]] = kv.to(ring.dtype)
    sink, scale = attn.attn_sink, cfg.head_dim**-0.5
    if attn.compressor is None:
        return ops.paged_decode_attention(q, ring, slots, pos, cfg.sliding_window, sink, scale)
    eps = cfg.rms_norm_eps
    paged_kv = cache.paged[f"layers.{layer}.kv"]
    quant = (lambda rows: attn._quant_kv(rows, ops)) if kv_quant else None
    _compress(attn.compressor, p.comp, f"layers.{layer}.compressor", paged_kv, batch, cache, ops, inv_freq, eps,
              quant)
    num_entries = max(batch.max_context_len // r, 1)
    visible = (pos + 1) // r
    if attn.indexer is None:
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
