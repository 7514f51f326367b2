"""DeepSeek-V4.1 attention and index scoring over the packed cache rows (twins of `triton_ops.v41_paged`).

The rows are read as stored (`v41_quant` formats), decoded on the fly:
- window ring rows: MXFP8 (`ring` uint8, `dim + dim / 32` bytes) or plain rows of the model dtype;
- compressed KV rows: FP4 with e4m3 scales per 16 (`paged` uint8, `dim / 2 + dim / 16` bytes) or plain;
- index keys: FP4 with UE8M0 scales per 32 (`paged_keys` uint8, `dim / 2 + dim / 32` bytes) or plain.
A uint8 tensor is packed, any other dtype holds plain rows. Decoded values are cast to the query's dtype
before the products (the formats' values are exact in bfloat16, so nothing is lost).

Entry e of a stream with `ratio` tokens per row lives where `reference.paged.entry_location` says
(entries past the table's width: block 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import sparse_attention
from .indexer import indexer_scores
from .paged import entry_location, paged_lookup
from .v41_quant import dequant_fp4_rows, dequant_mxfp8_rows


def _window_rows(ring: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    return dequant_mxfp8_rows(ring, dim).to(dtype) if ring.dtype == torch.uint8 else ring.to(dtype)


def _kv_rows(rows: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    return dequant_fp4_rows(rows, dim, e4m3_scales=True).to(dtype) if rows.dtype == torch.uint8 else rows.to(dtype)


def v41_attention_rows(
    q: Tensor, positions: Tensor, ring: Tensor, slots: Tensor, window: int, chunk_kv: Tensor | None = None,
    chunk_start: int = 0, paged: Tensor | None = None, block_tables: Tensor | None = None,
    entry_ids: Tensor | None = None, ratio: int = 1,
) -> tuple[Tensor, Tensor]:
    """The rows `v41_attention` attends over, decoded: ([num_queries, window + k, head_dim] in q's dtype,
    validity [num_queries, window + k] bool)."""
    dim = q.shape[-1]
    key_pos = positions[:, None] - window + 1 + torch.arange(window, device=q.device)[None, :]
    if chunk_kv is None:
        rows = _window_rows(ring[slots[:, None], key_pos.clamp(min=0) % ring.shape[1]], dim, q.dtype)
    else:
        # A prefill chunk (not captured in a graph, so its size may be read): only the queries whose window
        # reaches before the chunk decode ring rows.
        rows = chunk_kv[(key_pos - chunk_start).clamp(0, chunk_kv.shape[0] - 1)].to(q.dtype)
        early = (key_pos[:, 0] < chunk_start).nonzero()[:, 0]
        if early.numel():
            pos = key_pos[early]
            from_ring = _window_rows(ring[slots[early, None], pos.clamp(min=0) % ring.shape[1]], dim, q.dtype)
            rows[early] = torch.where((pos >= chunk_start)[..., None], rows[early], from_ring)
    valid = key_pos >= 0
    if paged is not None:
        block_tables, entry_ids = paged_lookup(block_tables, entry_ids)
        blocks, in_block, inside = entry_location(block_tables, entry_ids, ratio, paged.shape[1] * ratio)
        rows = torch.cat((rows, _kv_rows(paged[blocks, in_block], dim, q.dtype)), dim=1)
        valid = torch.cat((valid, (entry_ids >= 0) & inside), dim=1)
    return rows, valid


def v41_attention(
    q: Tensor, positions: Tensor, ring: Tensor, slots: Tensor, window: int, sink: Tensor, scale: float,
    chunk_kv: Tensor | None = None, chunk_start: int = 0, paged: Tensor | None = None,
    block_tables: Tensor | None = None, entry_ids: Tensor | None = None, ratio: int = 1,
) -> Tensor:
    """`sparse_attention` of each query over its window and its chosen compressed entries, read packed.

    Window of the query at position p: positions p − window + 1 … p (those ≥ 0). Position t comes
    from `chunk_kv[t − chunk_start]` when `chunk_kv` is given and t ≥ chunk_start (a prefill chunk's
    own rows, not yet in the ring), else from `ring[slots[i], t mod ring]` (so a decode step writes its
    token's row to the ring first). Compressed rows: `entry_ids[i]` (−1 = none) of `paged` through
    `block_tables[i]`.

    Args:
        q: [num_queries, num_heads, head_dim]; positions, slots: [num_queries] int64.
        ring: [num_slots, ring, row] uint8 MXFP8 rows, or [num_slots, ring, head_dim] plain rows.
        window: rows of the sliding window; sink: [num_heads] float32; scale: softmax scale.
        chunk_kv: [chunk_len, head_dim] or None; chunk_start: position of chunk_kv's first row.
        paged: [num_blocks, block_size // ratio, row] uint8 FP4 (e4m3 scales) rows, plain rows, or None
            (window only); block_tables: [num_queries, max_blocks] (an expanded view is fine);
        entry_ids: [num_queries, k] int64.
    Returns:
        [num_queries, num_heads, head_dim] in q's dtype.
    """
    rows, valid = v41_attention_rows(q, positions, ring, slots, window, chunk_kv, chunk_start, paged, block_tables,
                                     entry_ids, ratio)
    return sparse_attention(q, rows, valid, sink, scale)


def v41_entry_keys(paged_keys: Tensor, block_tables: Tensor, num_entries: int, ratio: int, dim: int) -> Tensor:
    """Index keys 0 … num_entries − 1 read through `block_tables` ([max_blocks]: one sequence →
    [num_entries, dim]; [n, max_blocks] → [n, num_entries, dim]), decoded to float32."""
    ids = torch.arange(num_entries, device=paged_keys.device)
    if block_tables.dim() == 2:
        ids = ids[None, :].expand(block_tables.shape[0], -1)
    blocks, in_block, _ = entry_location(block_tables, ids, ratio, paged_keys.shape[1] * ratio)
    rows = paged_keys[blocks, in_block]
    if rows.dtype == torch.uint8:
        return dequant_fp4_rows(rows, dim, e4m3_scales=False)
    return rows.float()


def v41_index_scores(
    q: Tensor, paged_keys: Tensor, block_tables: Tensor, num_entries: int, head_weights: Tensor,
    softmax_scale: float, ratio: int,
) -> Tensor:
    """`indexer_scores` of the queries against index keys 0 … num_entries − 1, read packed.

    Args:
        q: [num_queries, num_heads, index_dim]; head_weights: [num_queries, num_heads].
        paged_keys: [num_blocks, block_size // ratio, row] uint8 FP4 (UE8M0 scales) rows, or plain rows.
        block_tables: [max_blocks] (every query of one sequence) or [num_queries, max_blocks] (one query
            per sequence).
    Returns:
        [num_queries, num_entries] float32.
    """
    keys = v41_entry_keys(paged_keys, block_tables, num_entries, ratio, q.shape[-1])
    return indexer_scores(q, keys, head_weights, softmax_scale)
