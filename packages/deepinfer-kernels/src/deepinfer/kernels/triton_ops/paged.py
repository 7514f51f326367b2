"""Fused batched-decode kernels that read the cache in place: twins of `reference.paged`.

- `compress_decode_fused`: one program per sequence writes the token into the compressor rings,
  pools its window with an online per-channel softmax, RMS-normalises, rotates and (when the window
  closes) stores the row in the paged stream — one launch instead of ~50 small ops.
- `paged_decode_attention_fused`: flash-decoding over the window ring and the chosen compressed
  entries, read through the block table (no gathered copy), with the per-head sink folded into the
  final normaliser. One program per (sequence, block of heads); K = V (single latent).
- `paged_indexer_scores_fused`: the lightning indexer's ReLU-weighted dot products against index
  keys read through the block table. One program per (sequence, block of entries).
- `prefill_attention_fused`: the prefill's attention of one sequence's queries over their window (a
  contiguous run of KV rows) and their chosen compressed entries read through the block table — no
  gathered rows. One program per (block of heads, query); `prefill_attention_invariant` with fixed tiles.

Every wrapper keeps its reference twin's signature and falls back to it for inputs the kernels do
not cover (non-CUDA tensors, a last dimension that is not contiguous). `paged_decode_attention_invariant`
is the batch-invariant form of the attention (fixed tiles and splits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import invariant, reference
from ._launch import on_triton, paged_inputs, precision


@triton.jit
def _compress_decode_kernel(
    kv_ptr, gate_ptr, ape_ptr, pos_ptr, slot_ptr, rk_ptr, rg_ptr, norm_ptr, freq_ptr, rows_ptr, paged_ptr, table_ptr,
    kv_stride, gate_stride, rk_slot, rk_row, rg_slot, rg_row, paged_block, paged_row, table_stride, table_width,
    ratio, ring, width, rope_half, eps,
    OVERLAP: tl.constexpr, WRITE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b)
    c = tl.arange(0, BLOCK_W)
    cm = c < width
    mult = 2 if OVERLAP else 1
    entry = pos // ratio
    ring_row = pos % ring
    ape_row = ape_ptr + (pos % ratio) * (mult * width)
    # This token's rows into the rings (both halves when overlapping); keep the half it pools.
    k0 = tl.load(kv_ptr + b * kv_stride + c, mask=cm, other=0.0).to(tl.float32)
    g0 = tl.load(gate_ptr + b * gate_stride + c, mask=cm, other=0.0).to(tl.float32) + tl.load(ape_row + c, mask=cm)
    tl.store(rk_ptr + slot * rk_slot + ring_row * rk_row + c, k0, mask=cm)
    tl.store(rg_ptr + slot * rg_slot + ring_row * rg_row + c, g0, mask=cm)
    k_cur, g_cur = k0, g0
    if OVERLAP:
        k1 = tl.load(kv_ptr + b * kv_stride + width + c, mask=cm, other=0.0).to(tl.float32)
        g1 = tl.load(gate_ptr + b * gate_stride + width + c, mask=cm, other=0.0).to(tl.float32) \
            + tl.load(ape_row + width + c, mask=cm)
        tl.store(rk_ptr + slot * rk_slot + ring_row * rk_row + width + c, k1, mask=cm)
        tl.store(rg_ptr + slot * rg_slot + ring_row * rg_row + width + c, g1, mask=cm)
        k_cur, g_cur = k1, g1
    # Only a token that closes its window pools it (an open window's row is returned as zeros).
    row = tl.zeros([BLOCK_W], tl.float32)
    if (pos + 1) % ratio == 0:
        # Online softmax over the window's slots, seeded with this token (read from registers).
        m = tl.where(cm, g_cur, 0.0)
        s = tl.full([BLOCK_W], 1.0, tl.float32)
        acc = tl.where(cm, k_cur, 0.0)
        off = width if OVERLAP else 0
        for part in tl.static_range(2 if OVERLAP else 1):
            # part 0: this window's tokens before pos (channels off…); part 1: the previous window (channels 0…)
            base = entry * ratio if part == 0 else (entry - 1) * ratio
            ch = off + c if part == 0 else c
            stop = pos if part == 0 else entry * ratio
            for i0 in range(0, ratio, BLOCK_S):
                p = base + i0 + tl.arange(0, BLOCK_S)
                live = (p >= 0) & (p < stop)
                r = tl.where(p >= 0, p, 0) % ring
                mask = live[:, None] & cm[None, :]
                g = tl.load(rg_ptr + slot * rg_slot + r[:, None] * rg_row + ch[None, :], mask=mask, other=float("-inf"))
                k = tl.load(rk_ptr + slot * rk_slot + r[:, None] * rk_row + ch[None, :], mask=mask, other=0.0)
                m_new = tl.maximum(m, tl.max(g, axis=0))
                e = tl.exp(g - m_new[None, :])
                alpha = tl.exp(m - m_new)
                s = s * alpha + tl.sum(e, axis=0)
                acc = acc * alpha + tl.sum(e * k, axis=0)
                m = m_new
        pooled = tl.where(cm, acc / s, 0.0)
        normed = pooled * tl.rsqrt(tl.sum(pooled * pooled, axis=0) / width + eps)
        normed = normed * tl.load(norm_ptr + c, mask=cm, other=0.0).to(tl.float32)
        # Interleaved RoPE on the trailing 2·rope_half channels, at the window's first position.
        even, odd = tl.split(tl.reshape(normed, (BLOCK_W // 2, 2)))
        j = tl.arange(0, BLOCK_W // 2) - (width // 2 - rope_half)
        in_rope = (j >= 0) & (j < rope_half)
        angle = (entry * ratio).to(tl.float32) * tl.load(freq_ptr + tl.where(in_rope, j, 0), mask=in_rope, other=0.0)
        cos, sin = tl.cos(angle), tl.sin(angle)
        even, odd = tl.where(in_rope, even * cos - odd * sin, even), tl.where(in_rope, odd * cos + even * sin, odd)
        row = tl.reshape(tl.join(even, odd), (BLOCK_W,))
    tl.store(rows_ptr + b * width + c, row, mask=cm)
    if WRITE:
        first = entry * ratio
        block_size = paged_block // paged_row * ratio
        col = first // block_size
        keep = ((pos + 1) % ratio == 0) & (col < table_width)
        blk = tl.load(table_ptr + b * table_stride + col, mask=keep, other=0)
        dst = paged_ptr + blk * paged_block + ((first % block_size) // ratio) * paged_row + c
        tl.store(dst, row.to(paged_ptr.dtype.element_ty), mask=cm & keep)


def compress_decode_fused(
    kv: Tensor, gate: Tensor, ape: Tensor, positions: Tensor, slots: Tensor, ring_kv: Tensor, ring_gate: Tensor,
    norm_weight: Tensor, inv_freq: Tensor, eps: float, *, overlap: bool, paged: Tensor | None = None,
    block_tables: Tensor | None = None,
) -> Tensor:
    """Same contract as `reference.compress_decode` (the paged stream must be contiguous; the
    rings' last dimension contiguous; width even)."""
    width = norm_weight.shape[0]
    tensors = (kv, gate, ring_kv, ring_gate)
    if (not on_triton(kv) or width % 2 or any(t.stride(-1) != 1 for t in tensors)
            or (paged is not None and not paged.is_contiguous())):
        return reference.compress_decode(kv, gate, ape, positions, slots, ring_kv, ring_gate, norm_weight, inv_freq,
                                         eps, overlap=overlap, paged=paged, block_tables=block_tables)
    num_seqs = kv.shape[0]
    rows = torch.empty(num_seqs, width, dtype=torch.float32, device=kv.device)
    if num_seqs == 0:
        return rows
    if paged is None:
        target, table, write = rows, positions, False
    elif block_tables is None:
        raise ValueError("a paged stream needs its block tables")
    else:
        target, table, write = paged, block_tables, True
    _compress_decode_kernel[(num_seqs,)](
        kv, gate, ape.contiguous(), positions, slots, ring_kv, ring_gate, norm_weight.contiguous(),
        inv_freq.float().contiguous(), rows, target, table,
        kv.stride(0), gate.stride(0), ring_kv.stride(0), ring_kv.stride(1), ring_gate.stride(0), ring_gate.stride(1),
        target.stride(0) if write else 0, target.stride(1) if write else 1, table.stride(0) if write else 0,
        table.shape[1] if write else 0, ape.shape[0], ring_kv.shape[1], width, inv_freq.shape[0], eps,
        OVERLAP=overlap, WRITE=write, BLOCK_W=triton.next_power_of_2(width), BLOCK_S=16, num_warps=4,
    )
    return rows


@triton.jit
def _attend(q_ptr, rows, valid, m, l, acc, scale, head_dim, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
            PRECISION: tl.constexpr):
    """One online-softmax step of a block of heads (`q_ptr` [BLOCK_H, 1] row pointers) over a block
    of key rows (`rows` [BLOCK_N, 1] row pointers; K = V). The logits are accumulated over CHUNK_D
    channels at a time so no warp holds a whole 512-wide query tile as an MMA operand."""
    logits = tl.zeros([q_ptr.shape[0], rows.shape[0]], tl.float32)
    for c0 in tl.static_range(0, BLOCK_D, CHUNK_D):
        dc = c0 + tl.arange(0, CHUNK_D)
        dm = dc < head_dim
        qc = tl.load(q_ptr + dc[None, :], mask=dm[None, :], other=0.0)
        kc = tl.load(rows + dc[None, :], mask=valid[:, None] & dm[None, :], other=0.0).to(qc.dtype)
        logits = tl.dot(qc, tl.trans(kc), logits, input_precision=PRECISION)
    logits = tl.where(valid[None, :], logits * scale, float("-inf"))
    d = tl.arange(0, BLOCK_D)
    k = tl.load(rows + d[None, :], mask=valid[:, None] & (d < head_dim)[None, :], other=0.0)
    k = k.to(q_ptr.dtype.element_ty)
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    p = tl.exp(logits - m_new[:, None])
    alpha = tl.exp(m - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, ring_ptr, slot_ptr, pos_ptr, sink_ptr, out_ptr, part_ptr, paged_ptr, table_ptr, ids_ptr,
    q_seq, q_head, ring_slot, ring_row, paged_block, paged_row, table_stride, ids_stride, out_seq, out_head,
    num_heads, head_dim, ring_len, window, num_ids, table_width, ratio, scale,
    SPLITS: tl.constexpr, HAS_PAGED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (head block, b, split s) takes key tiles s, s + SPLITS, …: first the window's tiles,
    then the entries'. With one split it normalises (sink included) and writes the output; else it
    writes its partial (max, sum, unnormalised acc) for `_combine_kernel`. Head blocks are the grid's
    fastest axis, so the programs that read one sequence's rows run side by side and share them in L2."""
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(1)
    split = tl.program_id(2)
    hm = h < num_heads
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    q_rows = q_ptr + b * q_seq + tl.where(hm, h, 0)[:, None] * q_head
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b)
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
            rows = ring_ptr + slot * ring_slot + (tl.where(valid, key_pos, 0) % ring_len)[:, None] * ring_row
        else:
            j = (t - window_tiles) * BLOCK_N + n
            e = tl.load(ids_ptr + b * ids_stride + j, mask=j < num_ids, other=-1)
            block_size = paged_block // paged_row * ratio
            first = tl.where(e >= 0, e, 0) * ratio
            col = first // block_size
            valid = (e >= 0) & (col < table_width)
            blk = tl.load(table_ptr + b * table_stride + col, mask=valid, other=0)
            rows = paged_ptr + blk[:, None] * paged_block + ((first % block_size) // ratio)[:, None] * paged_row
        m, l, acc = _attend(q_rows, rows, valid, m, l, acc, scale, head_dim, BLOCK_D, CHUNK_D, PRECISION)
    if SPLITS == 1:
        sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
        m_final = tl.maximum(m, sink)
        alpha = tl.exp(m - m_final)
        out = acc * alpha[:, None] / (l * alpha + tl.exp(sink - m_final))[:, None]
        tl.store(out_ptr + b * out_seq + h[:, None] * out_head + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hm[:, None] & dm[None, :])
    else:
        # part: [num_seqs, num_heads, SPLITS, 2 + BLOCK_D] float32 = (max, sum, acc…)
        row = part_ptr + ((b * num_heads + h) * SPLITS + split) * (2 + BLOCK_D)
        tl.store(row, m, mask=hm)
        tl.store(row + 1, l, mask=hm)
        tl.store(row[:, None] + 2 + d[None, :], acc, mask=hm[:, None])


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, valid_ptr, sink_ptr, out_ptr, q_query, q_head, kv_query, kv_row, valid_query, out_query, out_head,
    num_heads, head_dim, num_rows, scale,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (query i, head block): online softmax over the query's gathered rows, sink in the
    normaliser (the prefill form of `_paged_attention_kernel`, rows given instead of looked up)."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < num_heads
    d = tl.arange(0, BLOCK_D)
    q_rows = q_ptr + i * q_query + tl.where(hm, h, 0)[:, None] * q_head
    m = tl.full([BLOCK_H], -1e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for j0 in range(0, num_rows, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        valid = tl.load(valid_ptr + i * valid_query + j, mask=j < num_rows, other=0) != 0
        rows = kv_ptr + i * kv_query + tl.where(valid, j, 0)[:, None] * kv_row
        m, l, acc = _attend(q_rows, rows, valid, m, l, acc, scale, head_dim, BLOCK_D, CHUNK_D, PRECISION)
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
    m_final = tl.maximum(m, sink)
    alpha = tl.exp(m - m_final)
    out = acc * alpha[:, None] / (l * alpha + tl.exp(sink - m_final))[:, None]
    tl.store(out_ptr + i * out_query + h[:, None] * out_head + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & (d < head_dim)[None, :])


def sparse_attention_fused(q: Tensor, kv: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Same contract as `reference.sparse_attention` (the prefill's attention over gathered rows):
    one program per (query, block of 16 heads) streams the query's rows once for its heads, in the
    model dtype with float32 accumulation — no float32 copy of the rows, no logits tensor."""
    if not on_triton(q) or q.stride(-1) != 1 or kv.stride(-1) != 1 or q.dtype != kv.dtype:
        return reference.sparse_attention(q, kv, valid, sink, scale)
    num_queries, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_queries == 0:
        return out
    flags = valid.to(torch.uint8).contiguous()
    wide = q.element_size() > 2
    block_h, block_n, block_d = 16, 16 if wide else 32, max(triton.next_power_of_2(head_dim), 16)
    _sparse_attention_kernel[(num_queries, triton.cdiv(num_heads, block_h))](
        q, kv, flags, sink.float().contiguous(), out, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1),
        flags.stride(0), out.stride(0), out.stride(1), num_heads, head_dim, kv.shape[1], scale,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, CHUNK_D=min(block_d, 64), PRECISION=precision(q),
        num_warps=8, num_stages=1 if wide else 2,
    )
    return out


@triton.jit
def _prefill_attention_kernel(
    q_ptr, win_ptr, sink_ptr, out_ptr, paged_ptr, table_ptr, ids_ptr, q_query, q_head, win_row, paged_block,
    paged_row, ids_stride, out_query, out_head, num_heads, head_dim, start, window, num_ids, table_width,
    rows_per_block, ratio, scale,
    HAS_PAGED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (head block, query i): online softmax over the window's rows i + 1 … i + window of
    `win_ptr`, then over the query's entries looked up in the block table, sink in the normaliser.
    Head blocks are the grid's fastest axis: the programs reading one query's rows run side by side."""
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.program_id(1).to(tl.int64)
    hm = h < num_heads
    d = tl.arange(0, BLOCK_D)
    q_rows = q_ptr + i * q_query + tl.where(hm, h, 0)[:, None] * q_head
    m = tl.full([BLOCK_H], -1e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for j0 in range(0, window, BLOCK_N):
        e = i + 1 + j0 + n
        valid = (j0 + n < window) & (e >= window - start)          # position start − window + e ≥ 0
        rows = win_ptr + tl.where(valid, e, 0)[:, None] * win_row
        m, l, acc = _attend(q_rows, rows, valid, m, l, acc, scale, head_dim, BLOCK_D, CHUNK_D, PRECISION)
    if HAS_PAGED:
        block_size = rows_per_block * ratio
        for k0 in range(0, num_ids, BLOCK_N):
            k = k0 + n
            e = tl.load(ids_ptr + i * ids_stride + k, mask=k < num_ids, other=-1)
            first = tl.where(e >= 0, e, 0) * ratio
            col = first // block_size
            valid = (e >= 0) & (col < table_width)
            blk = tl.load(table_ptr + col, mask=valid, other=0).to(tl.int64)
            rows = paged_ptr + blk[:, None] * paged_block + ((first % block_size) // ratio).to(tl.int64)[:, None] \
                * paged_row
            m, l, acc = _attend(q_rows, rows, valid, m, l, acc, scale, head_dim, BLOCK_D, CHUNK_D, PRECISION)
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
    m_final = tl.maximum(m, sink)
    alpha = tl.exp(m - m_final)
    out = acc * alpha[:, None] / (l * alpha + tl.exp(sink - m_final))[:, None]
    tl.store(out_ptr + i * out_query + h[:, None] * out_head + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & (d < head_dim)[None, :])


def prefill_attention_fused(
    q: Tensor, window_kv: Tensor, start: int, window: int, sink: Tensor, scale: float, paged: Tensor | None = None,
    block_table: Tensor | None = None, entry_ids: Tensor | None = None, ratio: int = 1,
) -> Tensor:
    """Same contract as `reference.prefill_attention` (the paged stream contiguous, rows of q and
    window_kv contiguous): every row read in place, in the model dtype with float32 accumulation.
    Each query is a decode step's worth of work (window + k rows for all heads), so it takes the decode
    kernel's tiles for that many sequences: from 128 queries in two-byte types, all 64 V4-Flash heads
    per program (each query's rows read once, the products 64 heads tall)."""
    if not _prefill_applies(q, window_kv, paged):
        return reference.prefill_attention(q, window_kv, start, window, sink, scale, paged, block_table, entry_ids,
                                           ratio)
    tiles = _attention_tiles(q.element_size(), q.shape[2], q.shape[0])
    return _prefill_attention(q, window_kv, start, window, sink, scale, paged, block_table, entry_ids, ratio, tiles)


def prefill_attention_invariant(
    q: Tensor, window_kv: Tensor, start: int, window: int, sink: Tensor, scale: float, paged: Tensor | None = None,
    block_table: Tensor | None = None, entry_ids: Tensor | None = None, ratio: int = 1,
) -> Tensor:
    """Same contract as `reference.prefill_attention`, batch-invariant: the one-query tiles whatever
    the number of queries (one program per head block and query, rows in a fixed order)."""
    if not _prefill_applies(q, window_kv, paged):
        return invariant.prefill_attention(q, window_kv, start, window, sink, scale, paged, block_table, entry_ids,
                                           ratio)
    tiles = _attention_tiles(q.element_size(), q.shape[2], 1)
    return _prefill_attention(q, window_kv, start, window, sink, scale, paged, block_table, entry_ids, ratio, tiles)


def _prefill_applies(q: Tensor, window_kv: Tensor, paged: Tensor | None) -> bool:
    return (on_triton(q) and q.stride(-1) == 1 and window_kv.stride(-1) == 1
            and (paged is None or paged.is_contiguous()))


def _prefill_attention(
    q: Tensor, window_kv: Tensor, start: int, window: int, sink: Tensor, scale: float, paged: Tensor | None,
    block_table: Tensor | None, entry_ids: Tensor | None, ratio: int, tiles: dict[str, int],
) -> Tensor:
    """Launch `_prefill_attention_kernel` with these tiles."""
    num_queries, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_queries == 0:
        return out
    paged, block_table, ids, has_paged = paged_inputs(paged, block_table, entry_ids, window_kv)
    ids = ids.contiguous()
    _prefill_attention_kernel[(triton.cdiv(num_heads, tiles["BLOCK_H"]), num_queries)](
        q, window_kv, sink.float().contiguous(), out, paged if has_paged else window_kv,
        block_table if has_paged else window_kv, ids, q.stride(0), q.stride(1), window_kv.stride(0),
        paged.stride(0) if has_paged else 0, paged.stride(1) if has_paged else 0, ids.stride(0) if has_paged else 0,
        out.stride(0), out.stride(1), num_heads, head_dim, start, window, ids.shape[1] if has_paged else 0,
        block_table.shape[0] if has_paged else 0, paged.shape[1] if has_paged else 1, ratio, scale,
        HAS_PAGED=has_paged, PRECISION=precision(q), **tiles,
    )
    return out


@triton.jit
def _combine_kernel(part_ptr, sink_ptr, out_ptr, out_seq, out_head, num_heads, head_dim,
                    SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge one (sequence, head)'s split partials with the sink:
    out = Σ e^(m_s−M) acc_s / (Σ e^(m_s−M) l_s + e^(sink−M))."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    rows = part_ptr + ((b * num_heads + h) * SPLITS + s) * (2 + BLOCK_D)
    m = tl.load(rows)
    l = tl.load(rows + 1)
    acc = tl.load(rows[:, None] + 2 + d[None, :])
    sink = tl.load(sink_ptr + h)
    m_final = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp(m - m_final)
    out = tl.sum(acc * w[:, None], axis=0) / (tl.sum(l * w, axis=0) + tl.exp(sink - m_final))
    tl.store(out_ptr + b * out_seq + h * out_head + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def _num_splits(num_seqs: int, head_blocks: int, num_tiles: int) -> int:
    """Key-tile splits per (sequence, head block): enough programs to fill the GPU (a power of two,
    at most one tile each)."""
    want = triton.next_power_of_2(triton.cdiv(2 * _SM_COUNT, num_seqs * head_blocks))
    return min(want, 1 << (max(num_tiles, 1).bit_length() - 1), 64)


_SM_COUNT = 132   # H200 / H100 SXM; only sizes the split count


def _attention_tiles(element_size: int, head_dim: int, num_seqs: int) -> dict[str, int]:
    """Tile and launch shape of `_paged_attention_kernel` for `num_seqs` sequences and activations of
    `element_size` bytes. Two-byte types: the fastest of benchmarks/attention_tile_sweep.py on the H200
    at 1, 32 and 256 V4-Flash CSA sequences (docs/benchmarks/decode_h200.md): more heads per program
    as the batch grows, since each head block re-reads the sequence's rows. Float32 tiles: 16 heads
    and rows, no pipelining (shared memory)."""
    block_d = max(triton.next_power_of_2(head_dim), 16)
    if element_size > 2 or num_seqs < 16:
        block_h, block_n, warps, stages = 16, 16, 8, 1
    elif num_seqs < 128:
        block_h, block_n, warps, stages = 32, 16, 4, 2
    else:
        block_h, block_n, warps, stages = 64, 32, 8, 2
    return dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, CHUNK_D=min(block_d, 64), num_warps=warps,
                num_stages=stages)


def paged_decode_attention_fused(
    q: Tensor, ring: Tensor, slots: Tensor, positions: Tensor, window: int, sink: Tensor, scale: float,
    paged: Tensor | None = None, block_tables: Tensor | None = None, entry_ids: Tensor | None = None,
    ratio: int = 1,
) -> Tensor:
    """Same contract as `reference.paged_decode_attention` (the paged stream must be contiguous).
    Small batches split the key tiles over several programs (flash-decoding) and merge after."""
    if (not on_triton(q) or ring.stride(-1) != 1 or q.stride(-1) != 1
            or (paged is not None and not paged.is_contiguous())):
        return reference.paged_decode_attention(q, ring, slots, positions, window, sink, scale, paged, block_tables,
                                                entry_ids, ratio)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    tiles = _attention_tiles(q.element_size(), q.shape[2], q.shape[0])
    num_tiles = triton.cdiv(window, tiles["BLOCK_N"]) + (triton.cdiv(entry_ids.shape[1], tiles["BLOCK_N"])
                                                         if paged is not None and entry_ids is not None else 0)
    splits = _num_splits(q.shape[0], triton.cdiv(q.shape[1], tiles["BLOCK_H"]), num_tiles)
    return _decode_attention(q, ring, slots, positions, window, sink, scale, paged, block_tables, entry_ids, ratio,
                             tiles, splits)


INVARIANT_SPLITS = 8   # key-tile splits of the batch-invariant decode attention, at every batch


def paged_decode_attention_invariant(
    q: Tensor, ring: Tensor, slots: Tensor, positions: Tensor, window: int, sink: Tensor, scale: float,
    paged: Tensor | None = None, block_tables: Tensor | None = None, entry_ids: Tensor | None = None,
    ratio: int = 1,
) -> Tensor:
    """Same contract as `reference.paged_decode_attention`, batch-invariant: the small-batch tiles and
    INVARIANT_SPLITS key-tile splits whatever the batch and the number of entries (split s takes tiles
    s, s + splits, …, so the tiles a longer batch pads on — no valid row — leave every split's state
    exactly as it was). Where the kernel does not apply: the PyTorch twin."""
    if (not on_triton(q) or ring.stride(-1) != 1 or q.stride(-1) != 1
            or (paged is not None and not paged.is_contiguous())):
        return invariant.paged_decode_attention(q, ring, slots, positions, window, sink, scale, paged, block_tables,
                                                entry_ids, ratio)
    return _decode_attention(q, ring, slots, positions, window, sink, scale, paged, block_tables, entry_ids, ratio,
                             _attention_tiles(q.element_size(), q.shape[2], 1), INVARIANT_SPLITS)


def _decode_attention(
    q: Tensor, ring: Tensor, slots: Tensor, positions: Tensor, window: int, sink: Tensor, scale: float,
    paged: Tensor | None, block_tables: Tensor | None, entry_ids: Tensor | None, ratio: int,
    tiles: dict[str, int], splits: int,
) -> Tensor:
    """Launch `_paged_attention_kernel` (and `_combine_kernel` for several splits) with these tiles."""
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    paged, block_tables, ids, has_paged = paged_inputs(paged, block_tables, entry_ids, positions)
    ids = ids.contiguous()
    num_ids = ids.shape[1] if has_paged else 0
    block_h, block_d = tiles["BLOCK_H"], tiles["BLOCK_D"]
    head_blocks = triton.cdiv(num_heads, block_h)
    sink = sink.float().contiguous()
    part = torch.empty(num_seqs, num_heads, splits, 2 + block_d, dtype=torch.float32, device=q.device) \
        if splits > 1 else out
    _paged_attention_kernel[(head_blocks, num_seqs, splits)](
        q, ring, slots, positions, sink, out, part, paged if has_paged else ring,
        block_tables if has_paged else positions, ids,
        q.stride(0), q.stride(1), ring.stride(0), ring.stride(1), paged.stride(0) if has_paged else 1,
        paged.stride(1) if has_paged else 1, block_tables.stride(0) if has_paged else 0,
        ids.stride(0) if has_paged else 0, out.stride(0), out.stride(1),
        num_heads, head_dim, ring.shape[1], window, num_ids, block_tables.shape[1] if has_paged else 0, ratio, scale,
        SPLITS=splits, HAS_PAGED=has_paged, PRECISION=precision(q), **tiles,
    )
    if splits > 1:
        _combine_kernel[(num_seqs, num_heads)](part, sink, out, out.stride(0), out.stride(1), num_heads, head_dim,
                                               SPLITS=splits, BLOCK_D=block_d, num_warps=4)
    return out


@triton.jit
def _paged_index_kernel(
    q_ptr, keys_ptr, table_ptr, w_ptr, out_ptr, q_seq, q_head, keys_block, keys_row, table_stride, w_seq,
    num_heads, dim, num_entries, table_width, ratio, scale,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < num_entries
    d = tl.arange(0, BLOCK_D)
    dm = d < dim
    block_size = keys_block // keys_row * ratio
    first = n * ratio
    col = first // block_size
    blk = tl.load(table_ptr + b * table_stride + col, mask=nm & (col < table_width), other=0)
    rows = keys_ptr + blk[:, None] * keys_block + ((first % block_size) // ratio)[:, None] * keys_row
    k = tl.load(rows + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
    total = tl.zeros([BLOCK_N], tl.float32)
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < num_heads
        q = tl.load(q_ptr + b * q_seq + h[:, None] * q_head + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        w = tl.load(w_ptr + b * w_seq + h, mask=hm, other=0.0).to(tl.float32)
        dots = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        total += tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
    tl.store(out_ptr + b * num_entries + n, total, mask=nm)


def paged_indexer_scores_fused(
    q: Tensor, paged_keys: Tensor, block_tables: Tensor, num_entries: int, head_weights: Tensor,
    softmax_scale: float, ratio: int,
) -> Tensor:
    """Same contract as `reference.paged_indexer_scores` (the paged keys must be contiguous)."""
    if not on_triton(q) or q.stride(-1) != 1 or not paged_keys.is_contiguous():
        return reference.paged_indexer_scores(q, paged_keys, block_tables, num_entries, head_weights, softmax_scale,
                                              ratio)
    num_seqs, num_heads, dim = q.shape
    out = torch.empty(num_seqs, num_entries, dtype=torch.float32, device=q.device)
    if num_seqs == 0 or num_entries == 0:
        return out
    weights = head_weights.contiguous()
    block_n = 32
    _paged_index_kernel[(num_seqs, triton.cdiv(num_entries, block_n))](
        q, paged_keys, block_tables, weights, out, q.stride(0), q.stride(1), paged_keys.stride(0),
        paged_keys.stride(1), block_tables.stride(0), weights.stride(0), num_heads, dim, num_entries,
        block_tables.shape[1], ratio, softmax_scale,
        BLOCK_H=16, BLOCK_N=block_n, BLOCK_D=max(triton.next_power_of_2(dim), 16), PRECISION=precision(q),
        num_warps=4,
    )
    return out
