"""Batched-decode ops that read the cache in place: one query token per sequence.

Each sequence b has a state slot `slots[b]` (its window ring and compressor rings, indexed by
position mod ring length) and a block table row `block_tables[b]`. Compressed entry e of a stream
with `ratio` tokens per entry covers tokens e·ratio …; it lives in the block holding its first token,
at row `(e·ratio mod block_size) // ratio` of that block. Entries whose block lies past the table's
width are not readable (attention skips them; scoring reads the reserved block 0 instead).

Static shapes throughout, no host synchronisation: these ops may be captured in a CUDA graph.
`prefill_attention` is the prefill's form (one sequence's chunk of queries): the same rows, the
window read from one contiguous run of KV rows, the entries through the block table.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import sparse_attention
from .compressor import compress_pool
from .indexer import indexer_scores
from .norm import rms_norm
from .rope import apply_rope


def paged_lookup(block_tables: Tensor | None, entry_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """The block tables and entry ids a paged stream comes with.

    Raises:
        ValueError: either is missing.
    """
    if block_tables is None or entry_ids is None:
        raise ValueError("a paged stream needs its block tables and entry ids")
    return block_tables, entry_ids


def entry_location(block_tables: Tensor, entries: Tensor, ratio: int, block_size: int) -> tuple[Tensor, ...]:
    """Where compressed entries live: (block ids, row in block, inside the table), each shaped like
    `entries` (negative ids are read as entry 0).

    Entry e covers tokens e·ratio …; it lives in the block holding its first token, looked up in the
    matching row of `block_tables` ([max_blocks] for one sequence, [num_seqs, max_blocks] with entries
    [num_seqs, n] for a batch). Entries past the table's width map to the reserved block 0.
    """
    first = entries.clamp(min=0) * ratio
    col = first // block_size
    inside = col < block_tables.shape[-1]
    blocks = block_tables.gather(-1, col.clamp(max=block_tables.shape[-1] - 1)).long()
    return torch.where(inside, blocks, 0), (first % block_size) // ratio, inside


def store_closed_rows(paged: Tensor, rows: Tensor, positions: Tensor, block_tables: Tensor, ratio: int) -> None:
    """Store the row of each sequence whose token at `positions` closes its compression window.

    Args:
        paged: [num_blocks, block_size // ratio, width]; rows: [num_seqs, width] (cast to paged's dtype);
        positions: [num_seqs] int64; block_tables: [num_seqs, max_blocks].
    Rows that must not land go to the reserved block 0 (static shapes, no host synchronisation).
    """
    entries = (positions // ratio)[:, None]
    blocks, in_block, inside = entry_location(block_tables, entries, ratio, paged.shape[1] * ratio)
    keep = ((positions + 1) % ratio == 0) & inside[:, 0]
    paged[torch.where(keep, blocks[:, 0], 0), torch.where(keep, in_block[:, 0], 0)] = rows.to(paged.dtype)


def compress_decode(
    kv: Tensor, gate: Tensor, ape: Tensor, positions: Tensor, slots: Tensor, ring_kv: Tensor, ring_gate: Tensor,
    norm_weight: Tensor, inv_freq: Tensor, eps: float, *, overlap: bool, paged: Tensor | None = None,
    block_tables: Tensor | None = None,
) -> Tensor:
    """Advance a compressor by one token per sequence; pool, normalise and rotate its window.

    The token's float32 projections (gate + `ape[position mod ratio]`) are written to the rings at
    position mod ring. The window the token belongs to (entry `position // ratio`) is then pooled
    (`compress_pool`; overlapping: the first-half channels of the previous window's tokens and the
    second-half channels of this one's), RMS-normalised with `norm_weight` and rotated at position
    entry·ratio. The row is complete only when the token closes the window ((position + 1) mod
    ratio == 0); then, if `paged` is given, it is stored at the entry's row (cast to paged's dtype).

    Args:
        kv, gate: [num_seqs, mult·width] projections (any float dtype), mult = 2 when overlapping.
        ape: [ratio, mult·width] float32 position bias of the gate.
        positions, slots: [num_seqs] int64.
        ring_kv, ring_gate: [num_slots, ring, mult·width] float32 (updated in place).
        norm_weight: [width]; inv_freq: [rope_dim // 2] float32 (the compress RoPE).
        paged: [num_blocks, block_size // ratio, width] or None; block_tables: [num_seqs, max_blocks].
    Returns:
        [num_seqs, width] float32 rows; unspecified where the window is still open (this twin
        pools the partial window, the fused kernel returns zeros).
    """
    rows_k, rows_g = window_slots(kv, gate, ape, positions, slots, ring_kv, ring_gate, norm_weight.shape[0],
                                  overlap=overlap)
    entries = positions // ape.shape[0]
    pooled = rms_norm(compress_pool(rows_k, rows_g), norm_weight, eps)
    rows = apply_rope(pooled, entries * ape.shape[0], inv_freq)
    if paged is not None:
        store_closed_rows(paged, rows, positions, block_tables, ape.shape[0])
    return rows


def window_slots(kv: Tensor, gate: Tensor, ape: Tensor, positions: Tensor, slots: Tensor, ring_kv: Tensor,
                 ring_gate: Tensor, width: int, *, overlap: bool) -> tuple[Tensor, Tensor]:
    """The first half of `compress_decode`: write each token's float32 projections (gate + position
    bias) into the rings, then gather the slots of the window it belongs to as `compress_pool` takes
    them: (kv, gate) [num_seqs, slots, width] float32, missing slots with gate −inf and kv 0."""
    ratio, ring = ape.shape[0], ring_kv.shape[1]
    k = kv.float()
    g = gate.float() + ape[positions % ratio]
    ring_kv[slots, positions % ring] = k
    ring_gate[slots, positions % ring] = g
    entries = positions // ratio
    lo = (entries - 1) * ratio if overlap else entries * ratio
    span = 2 * ratio if overlap else ratio
    pos = lo[:, None] + torch.arange(span, device=kv.device)[None, :]          # [B, span]
    rows_k = ring_kv[slots[:, None], pos.clamp(min=0) % ring]
    rows_g = ring_gate[slots[:, None], pos.clamp(min=0) % ring]
    missing = (pos < 0)[..., None]
    rows_k, rows_g = rows_k.masked_fill(missing, 0.0), rows_g.masked_fill(missing, float("-inf"))
    if overlap:
        rows_k = torch.cat((rows_k[:, :ratio, :width], rows_k[:, ratio:, width:]), dim=1)
        rows_g = torch.cat((rows_g[:, :ratio, :width], rows_g[:, ratio:, width:]), dim=1)
    return rows_k, rows_g


def paged_decode_attention(
    q: Tensor, ring: Tensor, slots: Tensor, positions: Tensor, window: int, sink: Tensor, scale: float,
    paged: Tensor | None = None, block_tables: Tensor | None = None, entry_ids: Tensor | None = None,
    ratio: int = 1,
) -> Tensor:
    """`sparse_attention` of each sequence's query over its window ring ∪ chosen compressed entries.

    Window rows: positions p − window + 1 … p (those ≥ 0) read from `ring[slots[b], position mod
    ring]`; the token at p must already be in the ring. Compressed rows: `entry_ids[b]` (−1 = none)
    read from `paged` through the block table.

    Args:
        q: [num_seqs, num_heads, head_dim]; ring: [num_slots, ring, head_dim];
        slots, positions: [num_seqs] int64; window: rows of the sliding window;
        sink: [num_heads] float32; scale: softmax scale.
        paged: [num_blocks, block_size // ratio, head_dim] or None (window-only layer);
        block_tables: [num_seqs, max_blocks]; entry_ids: [num_seqs, n] int64.
    Returns:
        [num_seqs, num_heads, head_dim] in q's dtype.
    """
    rows, valid = decode_attention_rows(q, ring, slots, positions, window, paged, block_tables, entry_ids, ratio)
    return sparse_attention(q, rows, valid, sink, scale)


def decode_attention_rows(
    q: Tensor, ring: Tensor, slots: Tensor, positions: Tensor, window: int, paged: Tensor | None,
    block_tables: Tensor | None, entry_ids: Tensor | None, ratio: int,
) -> tuple[Tensor, Tensor]:
    """The rows `paged_decode_attention` attends over, gathered: ([num_seqs, window + n, head_dim] in
    q's dtype, validity [num_seqs, window + n] bool)."""
    ring_len = ring.shape[1]
    key_pos = positions[:, None] - window + 1 + torch.arange(window, device=q.device)[None, :]
    rows = ring[slots[:, None], key_pos.clamp(min=0) % ring_len].to(q.dtype)
    valid = key_pos >= 0
    if paged is not None:
        block_tables, entry_ids = paged_lookup(block_tables, entry_ids)
        block_size = paged.shape[1] * ratio
        blocks, in_block, inside = entry_location(block_tables, entry_ids, ratio, block_size)
        rows = torch.cat((rows, paged[blocks, in_block].to(q.dtype)), dim=1)
        valid = torch.cat((valid, (entry_ids >= 0) & inside), dim=1)
    return rows, valid


PREFILL_ROWS_BLOCK = 1024   # queries whose rows this twin gathers at once (≈ 3 MB each at V4-Flash sizes)


def prefill_attention(
    q: Tensor, window_kv: Tensor, start: int, window: int, sink: Tensor, scale: float, paged: Tensor | None = None,
    block_table: Tensor | None = None, entry_ids: Tensor | None = None, ratio: int = 1,
) -> Tensor:
    """`sparse_attention` of one sequence's prefill queries over their sliding window and their chosen
    compressed entries, read where they are (the fused kernel gathers nothing; this twin gathers
    PREFILL_ROWS_BLOCK queries' rows at a time).

    Query i sits at position start + i. Row e of `window_kv` holds the KV of position start − window + e,
    so query i's window is rows i + 1 … i + window (those at positions ≥ 0; the others are never read).
    Compressed rows: `entry_ids[i]` (−1 = none) of `paged` through `block_table` (entries past the
    table are skipped).

    Args:
        q: [num_queries, num_heads, head_dim].
        window_kv: [window + num_queries, head_dim] (e.g. the ring's last `window` rows, then the chunk's).
        start: position of the first query; window: rows of the sliding window.
        sink: [num_heads] float32; scale: softmax scale.
        paged: [num_blocks, block_size // ratio, head_dim] or None (window-only layer);
        block_table: [max_blocks] the sequence's blocks; entry_ids: [num_queries, k] int64.
    Returns:
        [num_queries, num_heads, head_dim] in q's dtype.
    """
    out = torch.empty_like(q)
    for lo in range(0, q.shape[0], PREFILL_ROWS_BLOCK):
        hi = min(q.shape[0], lo + PREFILL_ROWS_BLOCK)
        rows, valid = prefill_attention_rows(q, window_kv, start, window, paged, block_table, entry_ids, ratio, lo,
                                             hi)
        out[lo:hi] = sparse_attention(q[lo:hi], rows, valid, sink, scale)
    return out


def prefill_attention_rows(
    q: Tensor, window_kv: Tensor, start: int, window: int, paged: Tensor | None, block_table: Tensor | None,
    entry_ids: Tensor | None, ratio: int, lo: int, hi: int,
) -> tuple[Tensor, Tensor]:
    """The rows queries lo … hi − 1 of `prefill_attention` attend over, gathered: ([hi − lo, window + k,
    head_dim] in q's dtype, validity [hi − lo, window + k] bool)."""
    index = torch.arange(lo + 1, hi + 1, device=q.device)[:, None] + torch.arange(window, device=q.device)[None, :]
    rows = window_kv[index].to(q.dtype)
    valid = index >= window - start                      # position start − window + index ≥ 0
    if paged is not None:
        block_table, entry_ids = paged_lookup(block_table, entry_ids)
        ids = entry_ids[lo:hi]
        blocks, in_block, inside = entry_location(block_table, ids.flatten(), ratio, paged.shape[1] * ratio)
        entries = paged[blocks, in_block].view(*ids.shape, paged.shape[-1]).to(q.dtype)
        rows = torch.cat((rows, entries), dim=1)
        valid = torch.cat((valid, (ids >= 0) & inside.view(ids.shape)), dim=1)
    return rows, valid


def paged_indexer_scores(
    q: Tensor, paged_keys: Tensor, block_tables: Tensor, num_entries: int, head_weights: Tensor,
    softmax_scale: float, ratio: int,
) -> Tensor:
    """`indexer_scores` of each sequence's query against its entries 0 … num_entries − 1, read from
    the paged index keys through the block table (entries past the table read block 0).

    Args:
        q: [num_seqs, num_heads, index_dim]; paged_keys: [num_blocks, block_size // ratio, index_dim];
        block_tables: [num_seqs, max_blocks]; head_weights: [num_seqs, num_heads].
    Returns:
        [num_seqs, num_entries] float32.
    """
    return indexer_scores(q, entry_keys(paged_keys, block_tables, num_entries, ratio), head_weights, softmax_scale)


def entry_keys(paged_keys: Tensor, block_tables: Tensor, num_entries: int, ratio: int) -> Tensor:
    """Each sequence's index keys 0 … num_entries − 1, read through its block table (entries past the
    table read block 0): [num_seqs, num_entries, index_dim]."""
    ids = torch.arange(num_entries, device=paged_keys.device)[None, :].expand(block_tables.shape[0], -1)
    blocks, in_block, _ = entry_location(block_tables, ids, ratio, paged_keys.shape[1] * ratio)
    return paged_keys[blocks, in_block]
