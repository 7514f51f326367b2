"""DeepSeek-V4.1 kernels that read the packed cache rows in place: twins of `reference.v41_paged`.

- `v41_attention_fused`: flash attention of each query over its sliding window (MXFP8 ring rows, or
  a prefill chunk's own rows) and its chosen compressed entries (FP4 rows with e4m3 scales, read
  through the block table), decoded in registers — no dequantised copy of the cache, no gathered
  rows. One program per (head block, query, split); decode steps split the key tiles over several
  programs (flash-decoding, merged by `paged._combine_kernel`) when the batch is small.
- `v41_index_scores_fused`: the indexer's ReLU-weighted scores against FP4 index keys (UE8M0 scales)
  read through the block table. One program per (query, block of entries); for one sequence's queries
  (prefill) per (8 queries, block of entries), the keys decoded once for the 8.

Rows are decoded bit-exactly from their bytes (e4m3 / e2m1 / UE8M0 built from the bit fields; no
float8 type needed), then cast to the query's dtype (exact: every format's value fits bfloat16).
Wrappers keep the twins' signatures and fall back to them where the kernels do not apply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import invariant, reference
from ._launch import on_triton, paged_inputs, precision
from .paged import INVARIANT_SPLITS, _attention_tiles, _combine_kernel, _num_splits

PLAIN, MXFP8, FP4_E4M3, FP4_UE8M0 = 0, 1, 2, 3


@triton.jit
def _e4m3(b):
    """float32 value of e4m3 bytes b (int32, 0…255; 0x7F / 0xFF, NaN, never stored)."""
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 0x80) != 0, mag * -1.0, mag)          # (0 − 0 would lose the sign of −0)


@triton.jit
def _e2m1(c):
    """float32 value of e2m1 codes c (int32, 0…15, bit 3 = sign)."""
    e = (c >> 1) & 3
    f = c & 1
    normal = (((e + 126) << 23) | (f << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, f.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, mag * -1.0, mag)


@triton.jit
def _ue8m0(s):
    """2^(s − 127) for UE8M0 bytes s (int32; s = 0 gives 0, never stored)."""
    return (s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rows(ptrs, d, mask, dim, FMT: tl.constexpr):
    """float32 values [N, len(d)] of channels d of the rows at `ptrs` ([N, 1]; byte pointers when packed)."""
    dd = d[None, :]
    if FMT == 0:
        out = tl.load(ptrs + dd, mask=mask, other=0.0).to(tl.float32)
    elif FMT == 1:
        code = tl.load(ptrs + dd, mask=mask, other=0).to(tl.int32)
        scale = tl.load(ptrs + dim + dd // 32, mask=mask, other=0).to(tl.int32)
        out = _e4m3(code) * _ue8m0(scale)
    else:
        pair = tl.load(ptrs + dd // 2, mask=mask, other=0).to(tl.int32)
        value = _e2m1((pair >> ((dd % 2) * 4)) & 0xF)
        if FMT == 2:
            scale = _e4m3(tl.load(ptrs + dim // 2 + dd // 16, mask=mask, other=0).to(tl.int32))
        else:
            scale = _ue8m0(tl.load(ptrs + dim // 2 + dd // 32, mask=mask, other=0).to(tl.int32))
        out = value * scale
    return out


@triton.jit
def _step(q_rows, rows, chunk_rows, from_chunk, valid, m, l, acc, scale, head_dim,
          FMT: tl.constexpr, HAS_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
          PRECISION: tl.constexpr):
    """One online-softmax step of a block of heads over a tile of key rows (K = V): the logits
    CHUNK_D channels at a time, then the whole tile for the values. A row is read from `chunk_rows`
    (plain, the prefill chunk) where `from_chunk`, else from `rows` in format FMT."""
    dtype = q_rows.dtype.element_ty
    logits = tl.zeros([q_rows.shape[0], rows.shape[0]], tl.float32)
    if HAS_CHUNK:
        from_rows = valid & ~from_chunk
    else:
        from_rows = valid
    for c0 in tl.static_range(0, BLOCK_D, CHUNK_D):
        dc = c0 + tl.arange(0, CHUNK_D)
        dm = (dc < head_dim)[None, :]
        qc = tl.load(q_rows + dc[None, :], mask=dm, other=0.0)
        kc = _rows(rows, dc, from_rows[:, None] & dm, head_dim, FMT)
        if HAS_CHUNK:
            kc = tl.where(from_chunk[:, None],
                          tl.load(chunk_rows + dc[None, :], mask=from_chunk[:, None] & dm, other=0.0).to(tl.float32),
                          kc)
        logits = tl.dot(qc, tl.trans(kc.to(dtype)), logits, input_precision=PRECISION)
    logits = tl.where(valid[None, :], logits * scale, float("-inf"))
    d = tl.arange(0, BLOCK_D)
    dm = (d < head_dim)[None, :]
    k = _rows(rows, d, from_rows[:, None] & dm, head_dim, FMT)
    if HAS_CHUNK:
        k = tl.where(from_chunk[:, None],
                     tl.load(chunk_rows + d[None, :], mask=from_chunk[:, None] & dm, other=0.0).to(tl.float32), k)
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    p = tl.exp(logits - m_new[:, None])
    alpha = tl.exp(m - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(dtype), k.to(dtype), input_precision=PRECISION)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _v41_attention_kernel(
    q_ptr, pos_ptr, ring_ptr, slot_ptr, sink_ptr, out_ptr, part_ptr, chunk_ptr, paged_ptr, table_ptr, ids_ptr,
    q_query, q_head, slot_stride, ring_slot, ring_row, chunk_row, paged_block, paged_row, table_stride, ids_stride,
    out_query, out_head, num_heads, head_dim, ring_len, window, chunk_start, chunk_len, num_ids, table_width,
    rows_per_block, ratio, scale,
    RING_FMT: tl.constexpr, PAGED_FMT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_PAGED: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (head block, query i, split s) takes key tiles s, s + SPLITS, …: the window's, then the
    entries'. One split: normalise with the sink and write; else write (max, sum, acc) partials."""
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    hm = h < num_heads
    d = tl.arange(0, BLOCK_D)
    q_rows = q_ptr + i * q_query + tl.where(hm, h, 0)[:, None] * q_head
    pos = tl.load(pos_ptr + i)
    slot = tl.load(slot_ptr + i * slot_stride).to(tl.int64)
    m = tl.full([BLOCK_H], -1e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    window_tiles = tl.cdiv(window, BLOCK_N)
    num_tiles = window_tiles + (tl.cdiv(num_ids, BLOCK_N) if HAS_PAGED else 0)
    for t in range(split, num_tiles, SPLITS):
        if t < window_tiles:
            j = t * BLOCK_N + n
            key_pos = pos - window + 1 + j
            valid = (j < window) & (key_pos >= 0)
            # (names differ from the entry branch's: a plain ring and packed entries have other pointer types)
            ring_rows = ring_ptr + slot * ring_slot \
                + (tl.where(valid, key_pos, 0) % ring_len).to(tl.int64)[:, None] * ring_row
            if HAS_CHUNK:
                from_chunk = valid & (key_pos >= chunk_start)
                c = tl.minimum(tl.maximum(key_pos - chunk_start, 0), chunk_len - 1).to(tl.int64)
                chunk_rows = chunk_ptr + c[:, None] * chunk_row
            else:
                from_chunk = valid & (n < 0)
                chunk_rows = chunk_ptr
            m, l, acc = _step(q_rows, ring_rows, chunk_rows, from_chunk, valid, m, l, acc, scale, head_dim,
                              RING_FMT, HAS_CHUNK, BLOCK_D, CHUNK_D, PRECISION)
        else:
            k = (t - window_tiles) * BLOCK_N + n
            e = tl.load(ids_ptr + i * ids_stride + k, mask=k < num_ids, other=-1)
            first = tl.where(e >= 0, e, 0) * ratio
            block_size = rows_per_block * ratio
            col = first // block_size
            readable = (e >= 0) & (col < table_width)
            blk = tl.load(table_ptr + i * table_stride + col, mask=readable, other=0).to(tl.int64)
            entry_rows = paged_ptr + blk[:, None] * paged_block \
                + ((first % block_size) // ratio).to(tl.int64)[:, None] * paged_row
            m, l, acc = _step(q_rows, entry_rows, entry_rows, readable & (n < 0), readable, m, l, acc, scale,
                              head_dim, PAGED_FMT, False, BLOCK_D, CHUNK_D, PRECISION)
    if SPLITS == 1:
        sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
        m_final = tl.maximum(m, sink)
        alpha = tl.exp(m - m_final)
        out = acc * alpha[:, None] / (l * alpha + tl.exp(sink - m_final))[:, None]
        tl.store(out_ptr + i * out_query + h[:, None] * out_head + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hm[:, None] & (d < head_dim)[None, :])
    else:
        # part: [num_queries, num_heads, SPLITS, 2 + BLOCK_D] float32 = (max, sum, acc…)
        row = part_ptr + ((i * num_heads + h) * SPLITS + split) * (2 + BLOCK_D)
        tl.store(row, m, mask=hm)
        tl.store(row + 1, l, mask=hm)
        tl.store(row[:, None] + 2 + d[None, :], acc, mask=hm[:, None])


def _format(rows: Tensor, packed: int) -> int:
    return packed if rows.dtype == torch.uint8 else PLAIN


def _applies(q: Tensor, ring: Tensor, chunk_kv: Tensor | None, paged: Tensor | None) -> bool:
    return (on_triton(q) and q.stride(-1) == 1 and ring.stride(-1) == 1
            and (chunk_kv is None or chunk_kv.stride(-1) == 1)
            and (paged is None or paged.is_contiguous())
            and q.shape[-1] % 2 == 0)


def _launch_attention(
    q: Tensor, positions: Tensor, ring: Tensor, slots: Tensor, window: int, sink: Tensor, scale: float,
    chunk_kv: Tensor | None, chunk_start: int, paged: Tensor | None, block_tables: Tensor | None,
    entry_ids: Tensor | None, ratio: int, tiles: dict[str, int], splits: int,
) -> Tensor:
    num_queries, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_queries == 0:
        return out
    positions = positions.contiguous()
    paged, block_tables, ids, has_paged = paged_inputs(paged, block_tables, entry_ids, positions)
    ids = ids.contiguous()
    chunk, has_chunk = (chunk_kv, True) if chunk_kv is not None else (q, False)
    block_d = tiles["BLOCK_D"]
    sink = sink.float().contiguous()
    part = torch.empty(num_queries, num_heads, splits, 2 + block_d, dtype=torch.float32, device=q.device) \
        if splits > 1 else out
    _v41_attention_kernel[(triton.cdiv(num_heads, tiles["BLOCK_H"]), num_queries, splits)](
        q, positions, ring, slots, sink, out, part, chunk, paged if has_paged else ring,
        block_tables if has_paged else positions, ids,
        q.stride(0), q.stride(1), slots.stride(0), ring.stride(0), ring.stride(1), chunk.stride(0) if has_chunk else 0,
        paged.stride(0) if has_paged else 0, paged.stride(1) if has_paged else 0,
        block_tables.stride(0) if has_paged else 0, ids.stride(0) if has_paged else 0, out.stride(0), out.stride(1),
        num_heads, head_dim, ring.shape[1], window, chunk_start, chunk.shape[0] if has_chunk else 1,
        ids.shape[1] if has_paged else 0, block_tables.shape[1] if has_paged else 0,
        paged.shape[1] if has_paged else 1, ratio, scale,
        RING_FMT=_format(ring, MXFP8), PAGED_FMT=_format(paged, FP4_E4M3) if has_paged else PLAIN,
        HAS_CHUNK=has_chunk, HAS_PAGED=has_paged, SPLITS=splits, PRECISION=precision(q), **tiles,
    )
    if splits > 1:
        _combine_kernel[(num_queries, num_heads)](part, sink, out, out.stride(0), out.stride(1), num_heads, head_dim,
                                                  SPLITS=splits, BLOCK_D=block_d, num_warps=4)
    return out


def v41_attention_fused(
    q: Tensor, positions: Tensor, ring: Tensor, slots: Tensor, window: int, sink: Tensor, scale: float,
    chunk_kv: Tensor | None = None, chunk_start: int = 0, paged: Tensor | None = None,
    block_tables: Tensor | None = None, entry_ids: Tensor | None = None, ratio: int = 1,
) -> Tensor:
    """Same contract as `reference.v41_attention` (the paged stream contiguous, the ring's and the
    chunk's rows contiguous). Decode calls (no chunk) split the key tiles when the batch is small."""
    if not _applies(q, ring, chunk_kv, paged):
        return reference.v41_attention(q, positions, ring, slots, window, sink, scale, chunk_kv, chunk_start, paged,
                                       block_tables, entry_ids, ratio)
    num_queries = q.shape[0]
    # Prefill (a chunk) takes the small, unpipelined tiles (those of float32 and of batch-1 decode):
    # the bf16 tiles of large batches (64 heads, 32 rows, 2 stages) made the prefill kernel fault
    # with an illegal memory access on the H200 (docs/benchmarks/v41_prefill_h200.md).
    tiles = _attention_tiles(q.element_size() if chunk_kv is None else 4, q.shape[2], num_queries)
    splits = 1
    if chunk_kv is None:
        num_tiles = triton.cdiv(window, tiles["BLOCK_N"]) + (triton.cdiv(entry_ids.shape[1], tiles["BLOCK_N"])
                                                             if paged is not None and entry_ids is not None else 0)
        splits = _num_splits(max(num_queries, 1), triton.cdiv(q.shape[1], tiles["BLOCK_H"]), num_tiles)
    return _launch_attention(q, positions, ring, slots, window, sink, scale, chunk_kv, chunk_start, paged,
                             block_tables, entry_ids, ratio, tiles, splits)


def v41_attention_invariant(
    q: Tensor, positions: Tensor, ring: Tensor, slots: Tensor, window: int, sink: Tensor, scale: float,
    chunk_kv: Tensor | None = None, chunk_start: int = 0, paged: Tensor | None = None,
    block_tables: Tensor | None = None, entry_ids: Tensor | None = None, ratio: int = 1,
) -> Tensor:
    """Same contract as `reference.v41_attention`, batch-invariant: the one-query tiles and
    INVARIANT_SPLITS key-tile splits at every batch (as `paged.paged_decode_attention_invariant`)."""
    if not _applies(q, ring, chunk_kv, paged):
        return invariant.v41_attention(q, positions, ring, slots, window, sink, scale, chunk_kv, chunk_start, paged,
                                       block_tables, entry_ids, ratio)
    return _launch_attention(q, positions, ring, slots, window, sink, scale, chunk_kv, chunk_start, paged,
                             block_tables, entry_ids, ratio, _attention_tiles(q.element_size(), q.shape[2], 1),
                             INVARIANT_SPLITS)


@triton.jit
def _v41_index_kernel(
    q_ptr, keys_ptr, table_ptr, w_ptr, out_ptr, q_query, q_head, keys_block, keys_row, table_stride, w_query,
    num_queries, num_heads, dim, num_entries, table_width, rows_per_block, ratio, scale,
    FMT: tl.constexpr, QUERIES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (query block, entry block): the entries' keys decoded once, scored for QUERIES queries
    (more than one only when every query reads the same table: one sequence's prefill)."""
    i0 = tl.program_id(0).to(tl.int64) * QUERIES
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < num_entries
    d = tl.arange(0, BLOCK_D)
    dm = d < dim
    block_size = rows_per_block * ratio
    first = n * ratio
    col = first // block_size
    blk = tl.load(table_ptr + i0 * table_stride + col, mask=nm & (col < table_width), other=0).to(tl.int64)
    rows = keys_ptr + blk[:, None] * keys_block + ((first % block_size) // ratio).to(tl.int64)[:, None] * keys_row
    k = _rows(rows, d, nm[:, None] & dm[None, :], dim, FMT).to(q_ptr.dtype.element_ty)
    for qi in range(QUERIES):
        i = i0 + qi
        if i < num_queries:
            total = tl.zeros([BLOCK_N], tl.float32)
            for h0 in range(0, num_heads, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                hm = h < num_heads
                q = tl.load(q_ptr + i * q_query + h[:, None] * q_head + d[None, :], mask=hm[:, None] & dm[None, :],
                            other=0.0)
                w = tl.load(w_ptr + i * w_query + h, mask=hm, other=0.0).to(tl.float32)
                dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                total += tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
            tl.store(out_ptr + i * num_entries + n, total, mask=nm)


def v41_index_scores_fused(
    q: Tensor, paged_keys: Tensor, block_tables: Tensor, num_entries: int, head_weights: Tensor,
    softmax_scale: float, ratio: int,
) -> Tensor:
    """Same contract as `reference.v41_index_scores` (the paged keys contiguous)."""
    if not on_triton(q) or q.stride(-1) != 1 or not paged_keys.is_contiguous() or q.shape[-1] % 2:
        return reference.v41_index_scores(q, paged_keys, block_tables, num_entries, head_weights, softmax_scale,
                                          ratio)
    num_queries, num_heads, dim = q.shape
    out = torch.empty(num_queries, num_entries, dtype=torch.float32, device=q.device)
    if num_queries == 0 or num_entries == 0:
        return out
    weights = head_weights.contiguous()
    shared = block_tables.dim() == 1
    table_stride = 0 if shared else block_tables.stride(0)
    block_n = 32
    queries = 8 if shared else 1           # one sequence's queries share its keys: decode them once per 8
    _v41_index_kernel[(triton.cdiv(num_queries, queries), triton.cdiv(num_entries, block_n))](
        q, paged_keys, block_tables, weights, out, q.stride(0), q.stride(1), paged_keys.stride(0),
        paged_keys.stride(1), table_stride, weights.stride(0), num_queries, num_heads, dim, num_entries,
        block_tables.shape[-1], paged_keys.shape[1], ratio, softmax_scale,
        FMT=_format(paged_keys, FP4_UE8M0), QUERIES=queries, BLOCK_H=16, BLOCK_N=block_n,
        BLOCK_D=max(triton.next_power_of_2(dim), 16),
        PRECISION=precision(q), num_warps=4,
    )
    return out
