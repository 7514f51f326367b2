"""Routed experts for large batches (prefill): grouped GEMMs over the (token, expert) pairs sorted by
expert, programs mapped to (expert, row tile) by a precomputed tile schedule.

- `plan_tiles`: the pairs sorted by expert once (stable) and a table of row tiles, each inside one
  expert's sorted rows (torch ops, no host synchronisation: CUDA-graph safe).
- `_up_kernel`: program (tile, column block) loads its rows of x through the sorted pair index (the
  gather is fused into the load: no gathered copy), multiplies them by a block of w1 and w3 rows
  interleaved into one weight tile (gate and up in one dot product), applies the clamped SwiGLU in
  its epilogue and stores the activation in sorted-row order — FP8 experts: quantised per 1 × block
  group in the same epilogue.
- `_down_kernel`: the activation rows times w2, scaled by each pair's routing weight, stored at the
  pair's own slot; `moe._sum_slots_kernel` adds each token's top-k rows in slot order (deterministic,
  no atomics).

Weight formats (`moe.PLAIN`, `moe.FP8_BLOCK`, `moe.MXFP4`): plain weights in the activations' dtype;
FP8 block-scaled (e4m3 weights, float32 scales per block × block): the activations are quantised per
1 × block group (x by `_quant_groups_kernel` once per token, the SwiGLU output in the up kernel's
epilogue), the dot products run on e4m3 operands (Hopper's FP8 tensor cores) and each K block's
partial product is scaled by its row and weight-block scales into the float32 accumulator; MXFP4:
the codes decoded to the activations' dtype tile by tile, then the plain dot product.
The PyTorch twins: `reference.moe_experts`, `reference.moe.moe_experts_fp8_w8a8`,
`reference.moe_experts_mxfp4`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import precision
from .moe import FP8_BLOCK, MXFP4, _clamped_silu_mul, _sum_slots_kernel, _weight_tile


@dataclass(frozen=True, slots=True)
class TilePlan:
    """The pairs sorted by expert and the row tiles of the grouped GEMMs.

    order: [pairs] int64, pair ids (token · top_k + slot) sorted by expert, stably.
    tiles: [3, max_tiles] int32: per tile its expert, first sorted row and end row (at most block_m
        rows); unused entries (beyond the schedule) are (-1, 0, 0). Tiles of one expert follow each other.
    tail: with tail_m, [3, min(experts, pairs)] int32: the last rows of each expert that has at most
        tail_m of them beyond its full tiles (run by a launch of tail_m-row tiles), as `tiles`; else None.
    """

    order: Tensor
    tiles: Tensor
    tail: Tensor | None
    block_m: int
    tail_m: int


def plan_tiles(expert_ids: Tensor, num_experts: int, block_m: int, tail_m: int = 0) -> TilePlan:
    """Sort the (token, expert) pairs of `expert_ids` [num_tokens, top_k] by expert and cut each
    expert's rows into tiles of `block_m`, or (`tail_m` > 0) its last rows, when no more than `tail_m`,
    into a tail tile. The tables have room for the most tiles any routing of this many pairs can need
    (static shapes, no host synchronisation)."""
    flat = expert_ids.reshape(-1).long()
    pairs, device = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    rest = counts % block_m
    tailed = (rest > 0) & (rest <= tail_m)
    main = counts - torch.where(tailed, rest, 0)
    tiles = _tile_table(starts, main, block_m, -(-pairs // block_m) + min(num_experts, pairs))
    if not tail_m:
        return TilePlan(order, tiles, None, block_m, 0)
    slots = min(num_experts, pairs)
    slot = torch.where(tailed, torch.cumsum(tailed, 0) - 1, slots)          # untailed experts: a dump column
    tail = torch.zeros(3, slots + 1, dtype=torch.int64, device=device)
    tail[0] = -1
    values = torch.stack((torch.arange(num_experts, device=device), starts + main, ends))
    tail.scatter_(1, slot.expand(3, -1), values)
    return TilePlan(order, tiles, tail[:, :slots].to(torch.int32), block_m, tail_m)


def _tile_table(starts: Tensor, rows: Tensor, block_m: int, max_tiles: int) -> Tensor:
    """[3, max_tiles] int32 (expert, first row, end row) cutting each expert's `rows` rows from its
    `starts` into tiles of `block_m`, in expert order; (-1, 0, 0) after the last."""
    num_experts = starts.numel()
    tiles_per_expert = (rows + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per_expert, 0)
    t = torch.arange(max_tiles, device=starts.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first = starts[e] + (t - (tile_ends[e] - tiles_per_expert[e])) * block_m
    end = torch.minimum(first + block_m, starts[e] + rows[e])
    return torch.stack((torch.where(used, e, -1), torch.where(used, first, 0), torch.where(used, end, 0))).to(
        torch.int32)


@dataclass(frozen=True, slots=True)
class GemmTiles:
    """One grouped GEMM's launch: rows, output columns (the up kernel: gate columns; it computes as
    many up columns beside them) and K per step, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    """The up and down GEMMs' tiles; `*_tail` (optional, fewer rows): the launch for each expert's
    last rows when they fill no more than that many (`plan_tiles`' tail)."""

    up: GemmTiles
    down: GemmTiles
    up_tail: GemmTiles | None = None
    down_tail: GemmTiles | None = None


def expert_tiles(fmt: int, rows_per_expert: float, hidden: int, inter: int, block: int = 128) -> ExpertTiles:
    """Fixed tiles per weight format and batch range (no autotuning: two shapes per GEMM and format,
    the second also the tail launch of the first), narrowed where a tile would not divide hidden or
    the intermediate size (small test models).

    `rows_per_expert`: pairs / experts, the mean rows an expert gets. From 96 up, 128-row tiles (a
    weight tile feeds 128 rows: two warpgroups of Hopper's 64-row matrix instructions), an expert's
    last ≤ 64 rows in a 64-row tile (at 8K tokens an expert gets ~192 rows: 128 + 64, not 2 × 128);
    below 96, 64-row tiles. FP8 (`block` the scale block, the K step): a fresh float32 partial product
    per K block sits beside the accumulator, so the up kernel (`block` gate columns, to quantise whole
    groups in its epilogue, and as many up columns beside them) keeps 64 rows under 8 warps.
    """
    big = rows_per_expert >= 96
    if fmt == FP8_BLOCK:
        up = GemmTiles(64, block, block, 8, 4)
        down, down_tail = GemmTiles(128, 128, block, 8, 4), GemmTiles(64, 128, block, 4, 4)
        up_tail = None
    elif fmt == MXFP4:
        up, up_tail = GemmTiles(128, 64, 64, 8, 3), GemmTiles(64, 64, 64, 4, 3)
        down, down_tail = GemmTiles(128, 128, 64, 8, 3), GemmTiles(64, 128, 64, 4, 3)
    else:
        up, up_tail = GemmTiles(128, 128, 64, 8, 3), GemmTiles(64, 128, 64, 4, 4)
        down, down_tail = GemmTiles(128, 256, 64, 8, 3), GemmTiles(64, 256, 64, 4, 3)
    if not big:
        up, down = up_tail or up, down_tail
        up_tail = down_tail = None
    tiles = ExpertTiles(up, down, up_tail, down_tail)
    return ExpertTiles(*(_narrow(t, fmt, hidden, inter, i % 2 == 1) for i, t in enumerate(
        (tiles.up, tiles.down, tiles.up_tail, tiles.down_tail))))


def _narrow(t: GemmTiles | None, fmt: int, hidden: int, inter: int, down: bool) -> GemmTiles | None:
    """`t` with its columns and K step halved until they divide the GEMM (FP8 keeps its K step, the
    scale block, and the up kernel's columns, whole groups)."""
    if t is None:
        return None
    n_size, k_size = (hidden, inter) if down else (inter, hidden)
    if fmt == FP8_BLOCK:
        return replace(t, block_n=_fit(n_size, t.block_n)) if down else t
    return replace(t, block_n=_fit(n_size, t.block_n), block_k=_fit(k_size, t.block_k))


def _fit(size: int, tile: int) -> int:
    """`tile` halved until it divides `size` (not below 16)."""
    while tile > 16 and size % tile:
        tile //= 2
    return tile


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
    """v (|v| ≤ 448) rounded to the nearest e4m3 value (ties up) in float32: Triton's CPU interpreter
    converts float32 to float8e4nv wrongly where rounding carries into the exponent (127.5 → 64), so
    there values are rounded here first and the conversion is exact."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = tl.exp2((exponent - 3).to(tl.float32))
    return tl.floor(v / step + 0.5) * step


@triton.jit
def _group_quant_store(val, q_ptrs, s_ptrs, q_mask, s_mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       GROUP: tl.constexpr, F8_CVT: tl.constexpr):
    """Store float32 `val` [BLOCK_M, BLOCK_N] as e4m3 with one float32 scale per 1 × GROUP group
    (absolute maximum / 448; 1 for an all-zero group): codes at `q_ptrs` [BLOCK_M, BLOCK_N], scales
    at `s_ptrs` [BLOCK_M, BLOCK_N // GROUP]."""
    groups = tl.reshape(val, (BLOCK_M, BLOCK_N // GROUP, GROUP))
    amax = tl.max(tl.abs(groups), axis=2)
    scale = tl.where(amax > 0.0, amax / 448.0, 1.0)
    q = tl.reshape(tl.clamp(groups / scale[:, :, None], -448.0, 448.0), (BLOCK_M, BLOCK_N))
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


def quant_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """[rows, cols] float → (e4m3 [rows, cols], float32 scales [rows, cols / group]); twin:
    `reference.moe.quant_fp8_groups`."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, cols // group, dtype=torch.float32, device=x.device)
    groups = min(triton.next_power_of_2(cols // group), max(1, 2048 // group))    # up to 2048 columns a program
    if rows:
        _quant_groups_kernel[(rows, triton.cdiv(cols // group, groups))](x, q, s, cols, x.stride(0), GROUP=group,
                                                                        GROUPS=groups, F8_CVT=x.is_cuda, num_warps=4)
    return q, s


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
    elif FORMAT == 2:
        w = _weight_tile(w_ptrs, s_ptrs, k0, k_in, w_rows >= 0, a.dtype, FORMAT, BLOCK_K)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, tl.trans(tl.load(w_ptrs + k0 + k[None, :])), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _up_kernel(x_ptr, xs_ptr, order_ptr, tiles_ptr, w13_ptr, s13_ptr, act_ptr, acts_ptr, max_tiles, num_n, hidden,
               inter, top_k, limit, x_row, w_expert, w_row, s_expert, s_row, FORMAT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
               PRECISION: tl.constexpr, F8_DOT: tl.constexpr):
    """act[row, n] = clamped SwiGLU of (x w1ᵀ, x w3ᵀ) for the program's rows and BLOCK_N gate columns.
    The weight tile has 2·BLOCK_N rows: w1 row n0 + j at 2j, w3 row n0 + j at 2j + 1, so gate and up
    leave one dot product side by side and split apart in the epilogue. FP8: x as e4m3 codes with
    scales `xs` per GROUP columns, act stored as codes + scales `acts`; MXFP4: `w_row` / `s_row` are
    byte and scale strides of the packed rows."""
    expert, first, end, nb = _tile(tiles_ptr, max_tiles, num_n)
    if end > first:
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
            _group_quant_store(act, act_ptr + out, scales, live[:, None], live[:, None], BLOCK_M, BLOCK_N, GROUP,
                               F8_DOT)
        else:
            tl.store(act_ptr + out, act.to(act_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _down_kernel(act_ptr, acts_ptr, order_ptr, tiles_ptr, weights_ptr, w2_ptr, s2_ptr, y_ptr, max_tiles, num_n,
                 hidden, inter, w_expert, w_row, s_expert, s_row, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
                 F8_DOT: tl.constexpr):
    """y[pair, n] = routing weight · (act w2ᵀ)[row, n] for the program's sorted rows (pair = order[row])."""
    expert, first, end, nb = _tile(tiles_ptr, max_tiles, num_n)
    if end > first:
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


@dataclass(frozen=True, slots=True)
class Weights:
    """One GEMM's expert weights as the kernels take them: `w` [experts, rows, K (MXFP4: K / 2 bytes)],
    `scale` its scales (PLAIN: any tensor, unused), `fmt`, `block` (FP8: the scale block; else 1 / 32)."""

    w: Tensor
    scale: Tensor
    fmt: int
    block: int


def _meta(fmt: int, block: int, on_gpu: bool, x: Tensor) -> dict:
    f8 = fmt == FP8_BLOCK
    return dict(FORMAT=fmt, GROUP=block if f8 else 1, PRECISION="ieee" if f8 and not on_gpu else precision(x),
                F8_DOT=f8 and on_gpu)


def _launches(plan: TilePlan, main: GemmTiles, tail: GemmTiles | None):
    """(tile table, its length, tiles) per launch: the full tiles, then the tail tiles if planned."""
    yield plan.tiles, plan.tiles.shape[1], main
    if plan.tail is not None:
        yield plan.tail, plan.tail.shape[1], tail


def run_up(x: Tensor, xs: Tensor, plan: TilePlan, w13: Weights, top_k: int, limit: float, inter: int,
           tiles: GemmTiles, tail: GemmTiles | None = None) -> tuple[Tensor, Tensor]:
    """The up kernel over `plan`: (act [pairs, inter] in sorted-row order — x's dtype, FP8: e4m3 —,
    its FP8 scales [pairs, inter / block] float32, else act again). FP8: `x` e4m3 with scales `xs`."""
    pairs, hidden = plan.order.numel(), x.shape[1]
    if w13.fmt == FP8_BLOCK:
        act = torch.empty(pairs, inter, dtype=torch.float8_e4m3fn, device=x.device)
        acts = torch.empty(pairs, inter // w13.block, dtype=torch.float32, device=x.device)
    else:
        act = acts = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    meta = _meta(w13.fmt, w13.block, x.is_cuda, x)
    for table, num_tiles, t in _launches(plan, tiles, tail):
        num_n = inter // t.block_n
        _up_kernel[(num_tiles * num_n,)](
            x, xs, plan.order, table, w13.w, w13.scale, act, acts, num_tiles, num_n, hidden, inter, top_k, limit,
            x.stride(0), w13.w.stride(0), w13.w.stride(1), w13.scale.stride(0), w13.scale.stride(1),
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
            **meta)
    return act, acts


def run_down(act: Tensor, acts: Tensor, plan: TilePlan, weights: Tensor, w2: Weights, hidden: int,
             dtype: torch.dtype, tiles: GemmTiles, tail: GemmTiles | None = None) -> Tensor:
    """The down kernel over `plan`: y [pairs, hidden] in `dtype`, row pair = routing weight · the
    pair's expert output (`weights` [pairs] float32)."""
    pairs, inter = act.shape
    y = torch.empty(pairs, hidden, dtype=dtype, device=act.device)
    meta = _meta(w2.fmt, w2.block, act.is_cuda, y)
    for table, num_tiles, t in _launches(plan, tiles, tail):
        num_n = hidden // t.block_n
        _down_kernel[(num_tiles * num_n,)](
            act, acts, plan.order, table, weights, w2.w, w2.scale, y, num_tiles, num_n, hidden, inter,
            w2.w.stride(0), w2.w.stride(1), w2.scale.stride(0), w2.scale.stride(1), BLOCK_M=t.block_m,
            BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages, **meta)
    return y


def sum_slots(y: Tensor, num_tokens: int, top_k: int, dtype: torch.dtype) -> Tensor:
    """[num_tokens · top_k, hidden] → [num_tokens, hidden] in `dtype`: each token's rows added in slot
    order in float32."""
    hidden = y.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=y.device)
    width = min(triton.next_power_of_2(hidden), 1024)
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, width))](y, out, hidden, TOP_K=top_k, BLOCK=width, num_warps=4)
    return out


def plans(expert_ids: Tensor, num_experts: int, tiles: ExpertTiles) -> tuple[TilePlan, TilePlan]:
    """(the up kernel's plan, the down kernel's): one plan when their row tiles agree."""
    up = plan_tiles(expert_ids, num_experts, tiles.up.block_m, tiles.up_tail.block_m if tiles.up_tail else 0)
    down_tail = tiles.down_tail.block_m if tiles.down_tail else 0
    if (tiles.down.block_m, down_tail) == (up.block_m, up.tail_m):
        return up, up
    return up, plan_tiles(expert_ids, num_experts, tiles.down.block_m, down_tail)


def grouped_experts(x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float, fmt: int,
                    s13: Tensor, s2: Tensor, block: int, inter: int, tiles: ExpertTiles | None = None) -> Tensor:
    """The routed experts through the grouped kernels: plan the tiles, quantise x (FP8), the up and
    down kernels, then each token's top-k rows added. `fmt` / `s13` / `s2` / `block` as
    `moe._experts` (PLAIN: scales unused); `tiles` overrides `expert_tiles` (the sweep). The caller
    checks shapes (`grouped_supported`)."""
    num_tokens, top_k = expert_ids.shape
    hidden, num_experts = x.shape[1], w13.shape[0]
    tiles = tiles or expert_tiles(fmt, num_tokens * top_k / num_experts, hidden, inter, block)
    up_plan, down_plan = plans(expert_ids, num_experts, tiles)
    xq, xs = quant_groups(x, block) if fmt == FP8_BLOCK else (x, x)
    act, acts = run_up(xq, xs, up_plan, Weights(w13, s13, fmt, block), top_k, limit, inter, tiles.up, tiles.up_tail)
    y = run_down(act, acts, down_plan, weights.reshape(-1).float().contiguous(), Weights(w2, s2, fmt, block), hidden,
                 x.dtype, tiles.down, tiles.down_tail)
    return sum_slots(y, num_tokens, top_k, x.dtype)


def grouped_supported(fmt: int, hidden: int, inter: int, block: int, tiles: ExpertTiles | None = None) -> bool:
    """Whether the grouped kernels take these sizes: their tiles divide hidden and the intermediate
    size exactly (no masked weight loads); FP8: the scale block is a power of two from 16 to 128 and
    is the K step; MXFP4: K steps of whole 32-input groups."""
    if fmt == FP8_BLOCK and not (16 <= block <= 128 and block & (block - 1) == 0):
        return False
    options = (tiles,) if tiles else (expert_tiles(fmt, 1.0, hidden, inter, block),
                                      expert_tiles(fmt, 128.0, hidden, inter, block))
    for t in options:
        for up in (t.up, t.up_tail):
            if up is not None and (inter % up.block_n or hidden % up.block_k or (
                    fmt == FP8_BLOCK and (up.block_k != block or up.block_n % block))):
                return False
        for down in (t.down, t.down_tail):
            if down is not None and (hidden % down.block_n or inter % down.block_k or (
                    fmt == FP8_BLOCK and down.block_k != block)):
                return False
        if fmt == MXFP4 and any(g is not None and g.block_k % 32 for g in (t.up, t.down, t.up_tail, t.down_tail)):
            return False
    return True


__all__ = ["ExpertTiles", "GemmTiles", "TilePlan", "Weights", "expert_tiles", "grouped_experts", "grouped_supported",
           "plan_tiles", "plans", "quant_groups", "run_down", "run_up", "sum_slots"]
