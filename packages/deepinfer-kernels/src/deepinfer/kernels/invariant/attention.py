"""Attention, indexer scores and compressor pooling whose rows do not depend on the batch.

Each query's logits are products summed over the head dimension alone (an inner reduction per
(query, head, key): the same at any batch), its softmax runs from the exact maximum, and the sums over
keys are taken KEY_BLOCK keys at a time, the blocks added one after another: keys a longer batch pads
on (invalid rows, weight exactly 0) only append blocks that add exact zeros. Queries go a few at a
time, to bound the [queries, heads, keys, head_dim] products (each query's result is its own either way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..reference import paged as reference_paged
from ..reference.norm import rms_norm
from ..reference.rope import apply_rope
from ._pointwise import sum_along
from .linear import Linear, linear

KEY_BLOCK = 32
PRODUCT_ELEMENTS = 1 << 22   # bound on the [queries, heads, keys, head_dim] products held at once


def sparse_attention(q: Tensor, kv: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Same contract as `reference.sparse_attention`."""
    out = torch.empty_like(q)
    num_queries, num_heads, head_dim = q.shape
    step = max(1, PRODUCT_ELEMENTS // max(1, num_heads * kv.shape[1] * head_dim))
    for lo in range(0, num_queries, step):
        out[lo:lo + step] = _attend(q[lo:lo + step], kv[lo:lo + step], valid[lo:lo + step], sink, scale)
    return out


def _attend(q: Tensor, kv: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    num_queries, num_heads, head_dim = q.shape
    pad = -kv.shape[1] % KEY_BLOCK if kv.shape[1] else KEY_BLOCK
    valid = F.pad(valid, (0, pad), value=False)
    rows = F.pad(kv.float(), (0, 0, 0, pad)).masked_fill(~valid[..., None], 0.0)          # [q, keys, head_dim]
    logits = (q.float()[:, :, None, :] * rows[:, None, :, :]).sum(-1) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))                        # [q, heads, keys]
    sink = sink.float()[None, :]
    top = torch.maximum(logits.amax(-1), sink)
    probs = torch.exp(logits - top[..., None])                                            # 0 where invalid
    num_blocks = rows.shape[1] // KEY_BLOCK
    # per key block: Σ p and Σ p·v (inner reductions of KEY_BLOCK), then the blocks added in order
    block_totals = probs.view(num_queries, num_heads, num_blocks, KEY_BLOCK).sum(-1)
    values = rows.transpose(1, 2).reshape(num_queries, 1, head_dim, num_blocks, KEY_BLOCK)
    block_sums = (probs.view(num_queries, num_heads, 1, num_blocks, KEY_BLOCK) * values).sum(-1)
    total = torch.exp(sink - top) + sum_along(block_totals, -1)
    return (sum_along(block_sums, -1) / total[..., None]).to(q.dtype)


def paged_decode_attention(
    q: Tensor, ring: Tensor, slots: Tensor, positions: Tensor, window: int, sink: Tensor, scale: float,
    paged: Tensor | None = None, block_tables: Tensor | None = None, entry_ids: Tensor | None = None,
    ratio: int = 1,
) -> Tensor:
    """Same contract as `reference.paged_decode_attention` (the rows gathered as there, attended by
    this module's `sparse_attention`)."""
    rows, valid = reference_paged.decode_attention_rows(q, ring, slots, positions, window, paged, block_tables,
                                                        entry_ids, ratio)
    return sparse_attention(q, rows, valid, sink, scale)


def prefill_attention(
    q: Tensor, window_kv: Tensor, start: int, window: int, sink: Tensor, scale: float, paged: Tensor | None = None,
    block_table: Tensor | None = None, entry_ids: Tensor | None = None, ratio: int = 1,
) -> Tensor:
    """Same contract as `reference.prefill_attention` (each query's rows gathered as there, attended by
    this module's `sparse_attention`)."""
    out = torch.empty_like(q)
    for lo in range(0, q.shape[0], reference_paged.PREFILL_ROWS_BLOCK):
        hi = min(q.shape[0], lo + reference_paged.PREFILL_ROWS_BLOCK)
        rows, valid = reference_paged.prefill_attention_rows(q, window_kv, start, window, paged, block_table,
                                                             entry_ids, ratio, lo, hi)
        out[lo:hi] = sparse_attention(q[lo:hi], rows, valid, sink, scale)
    return out


def indexer_scores(q: Tensor, keys: Tensor, head_weights: Tensor, softmax_scale: float, *,
                   linear: Linear = linear) -> Tensor:
    """Same contract as `reference.indexer_scores`. Keys shared by every query: one `linear` of the
    (query, head) rows against them; keys per query: products summed over index_dim, a few queries at
    a time. The heads' weighted ReLU scores are added one head after another."""
    num_queries, num_heads, dim = q.shape
    if keys.dim() == 2:
        dots = linear(q.float().reshape(-1, dim), keys.float()).view(num_queries, num_heads, -1)
    else:
        kf = keys.float()
        dots = q.new_empty(num_queries, num_heads, keys.shape[1], dtype=torch.float32)
        step = max(1, PRODUCT_ELEMENTS // max(1, num_heads * keys.shape[1] * dim))
        for lo in range(0, num_queries, step):
            dots[lo:lo + step] = (q[lo:lo + step].float()[:, :, None, :] * kf[lo:lo + step, None]).sum(-1)
    return sum_along(torch.relu(dots) * softmax_scale * head_weights.float().unsqueeze(-1), 1)


def paged_indexer_scores(
    q: Tensor, paged_keys: Tensor, block_tables: Tensor, num_entries: int, head_weights: Tensor,
    softmax_scale: float, ratio: int,
) -> Tensor:
    """Same contract as `reference.paged_indexer_scores` (keys read as there, scored by this module's
    `indexer_scores`)."""
    keys = reference_paged.entry_keys(paged_keys, block_tables, num_entries, ratio)
    return indexer_scores(q, keys, head_weights, softmax_scale)


def compress_pool(kv: Tensor, gate: Tensor) -> Tensor:
    """Same contract as `reference.compress_pool`: the softmax over slots from the exact maximum, its
    normaliser and the weighted sum added slot after slot (elementwise operations only)."""
    g = gate.float()
    weights = torch.exp(g - g.amax(dim=1, keepdim=True))
    weights = (weights / sum_along(weights, 1, keepdim=True)).to(kv.dtype)
    return sum_along(kv * weights, 1)


def compress_decode(
    kv: Tensor, gate: Tensor, ape: Tensor, positions: Tensor, slots: Tensor, ring_kv: Tensor, ring_gate: Tensor,
    norm_weight: Tensor, inv_freq: Tensor, eps: float, *, overlap: bool, paged: Tensor | None = None,
    block_tables: Tensor | None = None,
) -> Tensor:
    """Same contract as `reference.compress_decode` (its window gathered as there, pooled by this
    module's `compress_pool`)."""
    ratio = ape.shape[0]
    rows_k, rows_g = reference_paged.window_slots(kv, gate, ape, positions, slots, ring_kv, ring_gate,
                                                  norm_weight.shape[0], overlap=overlap)
    rows = apply_rope(rms_norm(compress_pool(rows_k, rows_g), norm_weight, eps), (positions // ratio) * ratio,
                      inv_freq)
    if paged is not None:
        reference_paged.store_closed_rows(paged, rows, positions, block_tables, ratio)
    return rows
