"""Attention rows of a decode step, for all sequences at once (one query token each).

Same result as the per-sequence path of `Attention`, but with static shapes: the number of
compressed entries gathered per sequence is `max_context_len // ratio` for every sequence (masked by
visibility), and a window that did not close writes its pooled row to the reserved block 0. No host
synchronisation, so the step can be captured in a CUDA graph keyed by the number of sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.kernels import KernelSet

from ..batch import ForwardBatch
from ..cache import ModelCache
from .common import table_rows


def window_rows(attn, kv: Tensor, batch: ForwardBatch, cache: ModelCache) -> tuple[Tensor, Tensor]:
    """Write each token's KV into its ring, then gather its window: ([B, W, d], valid [B, W])."""
    window = attn.cfg.sliding_window
    ring = cache.state[f"layers.{attn.layer}.window"]
    ring_len = ring.shape[1]
    pos, slots = batch.positions, batch.state_slots
    ring[slots, pos % ring_len] = kv.to(ring.dtype)
    key_pos = pos[:, None] - window + 1 + torch.arange(window, device=kv.device)[None, :]
    rows = ring[slots[:, None], key_pos.clamp(min=0) % ring_len]
    return rows.to(kv.dtype), key_pos >= 0


def _compress_decode(comp, x: Tensor, prefix: str, paged: Tensor, batch: ForwardBatch, cache: ModelCache,
                     ops: KernelSet, inv_freq: Tensor, eps: float, post=None) -> None:
    """Advance one compressor by one token per sequence; closed windows land in `paged`."""
    pos, slots = batch.positions, batch.state_slots
    k, g = comp.project(x, pos)
    ring_k, ring_g = cache.state[f"{prefix}.kv"], cache.state[f"{prefix}.gate"]
    ring_len = ring_k.shape[1]
    ring_k[slots, pos % ring_len] = k
    ring_g[slots, pos % ring_len] = g
    entries, rows, done = comp.decode_step(k, g, pos, ring_k[slots], ring_g[slots], ops, inv_freq, eps)
    if post is not None:
        rows = post(rows)
    blocks, in_block, inside = table_rows(batch.block_tables, entries[:, None], comp.ratio, cache.spec.block_size)
    keep = done & inside[:, 0]
    paged[torch.where(keep, blocks[:, 0], 0), torch.where(keep, in_block[:, 0], 0)] = rows.to(paged.dtype)


def compressed_rows(attn, x: Tensor, index_q: Tensor | None, index_w: Tensor | None, batch: ForwardBatch,
                    cache: ModelCache, ops: KernelSet, inv_freq: Tensor, kv_quant: bool) -> tuple[Tensor, Tensor]:
    """Compressed KV rows each sequence's token attends to: ([B, n, d], valid [B, n])."""
    eps, r, layer = attn.cfg.rms_norm_eps, attn.ratio, attn.layer
    paged_kv = cache.paged[f"layers.{layer}.kv"]
    quant = (lambda rows: attn._quant_kv(rows, ops)) if kv_quant else None
    _compress_decode(attn.compressor, x, f"layers.{layer}.compressor", paged_kv, batch, cache, ops, inv_freq, eps,
                     quant)
    num_entries = max(batch.max_context_len // r, 1)
    ids = torch.arange(num_entries, device=x.device)[None, :].expand(x.shape[0], -1)
    blocks, in_block, inside = table_rows(batch.block_tables, ids, r, cache.spec.block_size)
    visible = (batch.positions + 1) // r
    entries = paged_kv[blocks, in_block].to(x.dtype)                                  # [B, n, d]
    if attn.indexer is None:
        return entries, (ids < visible[:, None]) & inside
    ix = attn.indexer
    paged_ik = cache.paged[f"layers.{layer}.index_k"]
    key_post = (lambda keys: attn._quant_index(keys, ops)) if kv_quant else None
    _compress_decode(ix.compressor, x, f"layers.{layer}.indexer", paged_ik, batch, cache, ops, inv_freq, eps,
                     key_post)
    keys = paged_ik[blocks, in_block].to(x.dtype)
    scores = ops.indexer_scores(index_q, keys, index_w, ix.head_dim**-0.5)              # [B, n]
    picks = ops.topk_lowest_index(scores, visible, ix.topk)
    rows = entries.gather(1, picks.clamp(min=0)[..., None].expand(-1, -1, entries.shape[-1]))
    return rows, picks >= 0
