"""Triton kernels of the grouped expert GEMMs (`moe_grouped` plans and launches them).

- `_quant_groups_kernel`: rows to e4m3 with one float32 scale per 1 × GROUP group (absolute maximum / 448).
- `_up_kernel`: program (tile, column block) loads its rows of x through the sorted pair index (the
  gather fused into the load), multiplies them by BLOCK_N rows of w1 and of w3 interleaved into one
  weight tile, applies the clamped SwiGLU in its epilogue and stores the activation in sorted-row
  order (FP8: quantised per group in the same epilogue).
- `_down_kernel`: the activation rows times w2, scaled by each pair's routing weight, stored at the
  pair's own slot.
Programs take their (expert, first row, end row) from the tile table; the column block varies
fastest, so the programs running together share a tile's rows and an expert's weights (read from
memory once, then from L2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe import _clamped_silu_mul, _weight_tile


@triton.jit
def _tile(tiles_ptr, max_tiles, num_n):
    """(expert, first row, end row, column block) of this program: column blocks vary fastest, so
    the programs running together share the rows of a tile and the weights of an expert."""
    pid = tl.program_id(0)
    t = pid // num_n
    return (tl.load(tiles_ptr + t), tl.load(tiles_ptr + max_tiles + t), tl.load(tiles_ptr + 2 * max_tiles + t),
            pid % num_n)


@triton.jit
def _round_e4m3(v):
    """v (|v| ≤ 448) rounded to the nearest e4m3 value, ties to even (as torch and the GPU's
    conversion), in float32: Triton's CPU interpreter converts float32 to float8e4nv wrongly where
    rounding carries into the exponent (127.5 → 64), so there values are rounded here first and the
    conversion is exact. Ties are common for bfloat16 inputs (8 significant bits)."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = tl.exp2((exponent - 3).to(tl.float32))
    steps = v / step                                         # exact: a power of two, |steps| < 16
    nearest = tl.floor(steps + 0.5)
    odd = nearest - 2.0 * tl.floor(nearest * 0.5) != 0.0
    return tl.where((nearest - steps == 0.5) & odd, nearest - 1.0, nearest) * step


@triton.jit
def _group_quant_store(val, q_ptrs, s_ptrs, q_mask, s_mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       GROUP: tl.constexpr, F8_CVT: tl.constexpr):
    """Store float32 `val` [BLOCK_M, BLOCK_N] as e4m3 with one float32 scale per 1 × GROUP group
    (absolute maximum / 448; 1 for an all-zero group): codes at `q_ptrs` [BLOCK_M, BLOCK_N], scales
    at `s_ptrs` [BLOCK_M, BLOCK_N // GROUP]."""
    groups = tl.reshape(val, (BLOCK_M, BLOCK_N // GROUP, GROUP))
    amax = tl.max(tl.abs(groups), axis=2)
    scale = tl.where(amax > 0.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    divided = tl.div_rn(groups, tl.broadcast_to(scale[:, :, None], (BLOCK_M, BLOCK_N // GROUP, GROUP)))
    q = tl.reshape(tl.clamp(divided, -448.0, 448.0), (BLOCK_M, BLOCK_N))    # IEEE divisions: codes as the twin's
    if not F8_CVT:
        q = _round_e4m3(q)
    tl.store(q_ptrs, q.to(tl.float8e4nv), mask=q_mask)
    tl.store(s_ptrs, scale, mask=s_mask)


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, cols, x_row, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                         F8_CVT: tl.constexpr):
    """Program (row, group block): GROUPS groups of GROUP columns of one row to e4m3 + scales."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * GROUPS * GROUP + tl.arange(0, GROUPS * GROUP)
    live = c < cols
    val = tl.load(x_ptr + row * x_row + c, mask=live, other=0.0).to(tl.float32)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    _group_quant_store(val[None, :], (q_ptr + row * cols + c)[None, :], (s_ptr + row * (cols // GROUP) + g)[None, :],
                       live[None, :], (g < cols // GROUP)[None, :], 1, GROUPS * GROUP, GROUP, F8_CVT)


@triton.jit
def _step(a, a_scale, acc, w_ptrs, s_ptrs, w_rows, k0, k_in, scale_ptr, scale_base, s_row, FORMAT: tl.constexpr,
          BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr, F8_DOT: tl.constexpr):
    """acc + a @ (columns k0 … k0 + BLOCK_K of the weight rows at `w_ptrs` [R, 1], row ids `w_rows`)ᵀ.
    FP8: e4m3 a (row scales `a_scale` [M]) and weights (block scales at `scale_ptr + scale_base`, row
    stride `s_row`), the partial product scaled into acc; MXFP4: codes decoded (group scales at
    `s_ptrs`); plain: one dot accumulating in acc."""
    k = tl.arange(0, BLOCK_K)
    if FORMAT == 1:
        w = tl.load(w_ptrs + k0 + k[None, :])
        if not F8_DOT:                                        # the CPU interpreter: same products in float32
            a, w = a.to(tl.float32), w.to(tl.float32)
        part = tl.dot(a, tl.trans(w), input_precision=PRECISION)
        w_scale = tl.load(scale_ptr + scale_base + (w_rows // GROUP) * s_row + k0 // GROUP)
        acc += part * a_scale[:, None] * w_scale[None, :]
    elif FORMAT >= 2:                                         # MXFP4, as stored or re-packed
        w = _weight_tile(w_ptrs, s_ptrs, k0, k_in, w_rows >= 0, a.dtype, FORMAT, BLOCK_K)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, tl.trans(tl.load(w_ptrs + k0 + k[None, :])), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _up_kernel(x_ptr, xs_ptr, order_ptr, tiles_ptr, w13_ptr, s13_ptr, act_ptr, acts_ptr, max_tiles, num_n, hidden,
               inter, top_k, limit, x_row, w_expert, w_row, s_expert, s_row, FORMAT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
               PRECISION: tl.constexpr, F8_DOT: tl.constexpr, HALF: tl.constexpr):
    """act[row, n] = clamped SwiGLU of (x w1ᵀ, x w3ᵀ) for the program's rows and BLOCK_N gate columns;
    with HALF, a tile of at most BLOCK_M / 2 rows runs a half-height product (an expert's last rows
    cost half the matrix work, in the same launch as its other tiles)."""
    expert, first, end, nb = _tile(tiles_ptr, max_tiles, num_n)
    if end > first:
        if HALF:
            if end - first <= BLOCK_M // 2:
                _up_tile(x_ptr, xs_ptr, order_ptr, w13_ptr, s13_ptr, act_ptr, acts_ptr, expert, first, end, nb,
                         hidden, inter, top_k, limit, x_row, w_expert, w_row, s_expert, s_row, FORMAT, BLOCK_M // 2,
                         BLOCK_N, BLOCK_K, GROUP, PRECISION, F8_DOT)
            else:
                _up_tile(x_ptr, xs_ptr, order_ptr, w13_ptr, s13_ptr, act_ptr, acts_ptr, expert, first, end, nb,
                         hidden, inter, top_k, limit, x_row, w_expert, w_row, s_expert, s_row, FORMAT, BLOCK_M,
                         BLOCK_N, BLOCK_K, GROUP, PRECISION, F8_DOT)
        else:
            _up_tile(x_ptr, xs_ptr, order_ptr, w13_ptr, s13_ptr, act_ptr, acts_ptr, expert, first, end, nb, hidden,
                     inter, top_k, limit, x_row, w_expert, w_row, s_expert, s_row, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K,
                     GROUP, PRECISION, F8_DOT)


@triton.jit
def _up_tile(x_ptr, xs_ptr, order_ptr, w13_ptr, s13_ptr, act_ptr, acts_ptr, expert, first, end, nb, hidden, inter,
             top_k, limit, x_row, w_expert, w_row, s_expert, s_row, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
             F8_DOT: tl.constexpr):
    """One up tile. The weight tile has 2·BLOCK_N rows: w1 row n0 + j at 2j, w3 row n0 + j at 2j + 1,
    so gate and up leave one dot product side by side and split apart in the epilogue. FP8: x as e4m3
    codes with scales `xs` per GROUP columns, act stored as codes + scales `acts`; MXFP4: `w_row` /
    `s_row` are byte and scale strides of the packed rows."""
    rows = first + tl.arange(0, BLOCK_M)
    live = rows < end
    tokens = tl.load(order_ptr + tl.minimum(rows, end - 1)) // top_k     # padding rows re-read the last
    n0 = nb * BLOCK_N
    j = tl.arange(0, 2 * BLOCK_N)
    w_rows = n0 + j // 2 + (j % 2) * inter                               # gate, up, gate, up, ...
    e = expert.to(tl.int64)
    w_ptrs = w13_ptr + e * w_expert + w_rows[:, None].to(tl.int64) * w_row
    s_ptrs = s13_ptr + e * s_expert + w_rows[:, None] * s_row            # MXFP4: the rows' group scales
    x_ptrs = x_ptr + tokens[:, None] * x_row
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a_scale = tl.load(xs_ptr + tokens * (hidden // GROUP) + k0 // GROUP) if FORMAT == 1 else 1.0
        acc = _step(tl.load(x_ptrs + k0 + k[None, :]), a_scale, acc, w_ptrs, s_ptrs, w_rows, k0, hidden, s13_ptr,
                    e * s_expert, s_row, FORMAT, BLOCK_K, GROUP, PRECISION, F8_DOT)
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    act = _clamped_silu_mul(gate, up, limit)
    n = n0 + tl.arange(0, BLOCK_N)
    out = rows[:, None].to(tl.int64) * inter + n[None, :]
    if FORMAT == 1:
        g = n0 // GROUP + tl.arange(0, BLOCK_N // GROUP)
        scales = acts_ptr + rows[:, None].to(tl.int64) * (inter // GROUP) + g[None, :]
        _group_quant_store(act, act_ptr + out, scales, live[:, None], live[:, None], BLOCK_M, BLOCK_N, GROUP, F8_DOT)
    else:
        tl.store(act_ptr + out, act.to(act_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _down_kernel(act_ptr, acts_ptr, order_ptr, tiles_ptr, weights_ptr, w2_ptr, s2_ptr, y_ptr, max_tiles, num_n,
                 hidden, inter, w_expert, w_row, s_expert, s_row, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
                 F8_DOT: tl.constexpr, HALF: tl.constexpr):
    """y[pair, n] = routing weight · (act w2ᵀ)[row, n] for the program's sorted rows (pair = order[row]);
    HALF as `_up_kernel`."""
    expert, first, end, nb = _tile(tiles_ptr, max_tiles, num_n)
    if end > first:
        if HALF:
            if end - first <= BLOCK_M // 2:
                _down_tile(act_ptr, acts_ptr, order_ptr, weights_ptr, w2_ptr, s2_ptr, y_ptr, expert, first, end, nb,
                           hidden, inter, w_expert, w_row, s_expert, s_row, FORMAT, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                           GROUP, PRECISION, F8_DOT)
            else:
                _down_tile(act_ptr, acts_ptr, order_ptr, weights_ptr, w2_ptr, s2_ptr, y_ptr, expert, first, end, nb,
                           hidden, inter, w_expert, w_row, s_expert, s_row, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP,
                           PRECISION, F8_DOT)
        else:
            _down_tile(act_ptr, acts_ptr, order_ptr, weights_ptr, w2_ptr, s2_ptr, y_ptr, expert, first, end, nb,
                       hidden, inter, w_expert, w_row, s_expert, s_row, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP,
                       PRECISION, F8_DOT)


@triton.jit
def _down_tile(act_ptr, acts_ptr, order_ptr, weights_ptr, w2_ptr, s2_ptr, y_ptr, expert, first, end, nb, hidden,
               inter, w_expert, w_row, s_expert, s_row, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
               F8_DOT: tl.constexpr):
    rows = first + tl.arange(0, BLOCK_M)
    live = rows < end
    rows_in = tl.minimum(rows, end - 1).to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    e = expert.to(tl.int64)
    w_ptrs = w2_ptr + e * w_expert + n[:, None].to(tl.int64) * w_row
    s_ptrs = s2_ptr + e * s_expert + n[:, None] * s_row
    a_ptrs = act_ptr + rows_in[:, None] * inter
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a_scale = tl.load(acts_ptr + rows_in * (inter // GROUP) + k0 // GROUP) if FORMAT == 1 else 1.0
        acc = _step(tl.load(a_ptrs + k0 + k[None, :]), a_scale, acc, w_ptrs, s_ptrs, n, k0, inter, s2_ptr,
                    e * s_expert, s_row, FORMAT, BLOCK_K, GROUP, PRECISION, F8_DOT)
    pair = tl.load(order_ptr + rows_in)
    acc = acc * tl.load(weights_ptr + pair)[:, None]
    tl.store(y_ptr + pair[:, None] * hidden + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=live[:, None])
