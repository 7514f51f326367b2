"""Routed experts for large batches (prefill): grouped GEMMs over the (token, expert) pairs sorted by
expert, programs mapped to (expert, row tile) by a precomputed tile schedule.

- `plan_tiles`: the pairs sorted by expert once (stable) and a table of row tiles, each inside one
  expert's sorted rows (torch ops, no host synchronisation: CUDA-graph safe).
- `run_up`: the up GEMM + clamped SwiGLU (`moe_grouped_kernels._up_kernel`): x's rows loaded through
  the sorted pair index (no gathered copy), gate and up in one dot product, the activation stored in
  sorted-row order.
- `run_down`: the down GEMM, each row scaled by its routing weight and stored at its pair's slot;
  `sum_slots` adds each token's top-k rows in slot order (deterministic, no atomics).
- `grouped_experts`: the three, the op `moe.moe_experts*_fused` runs from `moe.GROUPED_MIN_PAIRS` pairs.

Weight formats (`moe.PLAIN`, `moe.FP8_BLOCK`, `moe.MXFP4`, `moe.MXFP4_PACKED`): plain weights in the
activations' dtype; FP8 block-scaled (e4m3 weights, float32 scales per block × block): the activations are quantised per
1 × block group (x by `quant_groups` once per token, the SwiGLU output in the up kernel's epilogue),
the dot products run on e4m3 operands (Hopper's FP8 tensor cores) and each K block's partial product
is scaled by its row and weight-block scales into the float32 accumulator; MXFP4: the codes (as
stored, or re-packed: MXFP4_PACKED) decoded to the activations' dtype tile by tile, then the plain
dot product.
The PyTorch twins: `reference.moe_experts`, `reference.moe.moe_experts_fp8_w8a8` (`quant_groups`:
`reference.moe.quant_fp8_groups`), `reference.moe_experts_mxfp4`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from torch import Tensor

from ._launch import precision
from .moe import FP8_BLOCK, MXFP4, MXFP4_PACKED, _sum_slots_kernel
from .moe_grouped_kernels import _down_kernel, _quant_groups_kernel, _up_kernel


@dataclass(frozen=True, slots=True)
class TilePlan:
    """The pairs sorted by expert and the row tiles of the grouped GEMMs.

    order: [pairs] int64, pair ids (token · top_k + slot) sorted by expert, stably.
    tiles: [3, max_tiles] int32: per tile its expert, first sorted row and end row (at most block_m
        rows); unused entries (beyond the schedule) are (-1, 0, 0). Tiles of one expert follow each other.
    """

    order: Tensor
    tiles: Tensor
    block_m: int

    @property
    def max_tiles(self) -> int:
        return self.tiles.shape[1]


def plan_tiles(expert_ids: Tensor, num_experts: int, block_m: int) -> TilePlan:
    """Sort the (token, expert) pairs of `expert_ids` [num_tokens, top_k] by expert and cut each
    expert's rows into tiles of `block_m`; the table has room for the most tiles any routing of this
    many pairs can need (static shape, no host synchronisation)."""
    order, counts = _sort_pairs(expert_ids, num_experts)
    return TilePlan(order, _tile_table(counts, order.numel(), block_m), block_m)


def _sort_pairs(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(pair ids sorted by expert, stably; pairs per expert), int64."""
    flat = expert_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def _tile_table(counts: Tensor, pairs: int, block_m: int) -> Tensor:
    """[3, max_tiles] int32 (expert, first row, end row) of each expert's rows (`counts` of `pairs`)
    cut into `block_m`-row tiles, experts in order; (-1, 0, 0) after the last. max_tiles: the most
    any routing of `pairs` pairs can need."""
    num_experts = counts.numel()
    ends = torch.cumsum(counts, 0)
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per_expert, 0)
    t = torch.arange(-(-pairs // block_m) + min(num_experts, pairs), device=counts.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first = ends[e] - counts[e] + (t - (tile_ends[e] - tiles_per_expert[e])) * block_m
    end = torch.minimum(first + block_m, ends[e])
    return torch.stack((torch.where(used, e, -1), torch.where(used, first, 0), torch.where(used, end, 0))).to(
        torch.int32)


@dataclass(frozen=True, slots=True)
class GemmTiles:
    """One grouped GEMM's launch: rows, output columns (the up kernel: gate columns; it computes as
    many up columns beside them) and K per step, warps, pipeline stages; `half`: a tile of at most
    block_m / 2 rows runs a half-height product (both heights compiled into the one kernel)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    half: bool = False


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    up: GemmTiles
    down: GemmTiles


def expert_tiles(fmt: int, hidden: int, inter: int, block: int = 128) -> ExpertTiles:
    """Fixed tiles per weight format (no autotuning: one compile per GEMM and format), narrowed where
    a tile would not divide hidden or the intermediate size (small test models).

    128-row tiles (a weight tile feeds 128 rows: two warpgroups of Hopper's 64-row matrix
    instructions), 8 warps, 64-row products for an expert's last ≤ 64 rows (at 8K tokens an expert
    gets ~192 rows: 128 + 64 rows of work, not 2 × 128; at 2K, ~48: one 64-row product). FP8 (`block`
    the scale block, the K step): a fresh float32 partial product per K block sits beside the
    accumulator, so the up kernel (`block` gate columns, to quantise whole groups in its epilogue, and
    as many up columns beside them) keeps 64 rows and the down kernel 128 columns.
    """
    if fmt == FP8_BLOCK:
        up, down = GemmTiles(64, block, block, 8, 4), GemmTiles(128, 128, block, 8, 4, True)
        return ExpertTiles(up, replace(down, block_n=_fit(hidden, down.block_n)))
    if fmt in (MXFP4, MXFP4_PACKED):
        up, down = GemmTiles(128, 64, 64, 8, 3, True), GemmTiles(128, 128, 64, 8, 3, True)
    else:
        up, down = GemmTiles(128, 128, 64, 8, 3, True), GemmTiles(128, 256, 64, 8, 3, True)
    return ExpertTiles(replace(up, block_n=_fit(inter, up.block_n), block_k=_fit(hidden, up.block_k)),
                       replace(down, block_n=_fit(hidden, down.block_n), block_k=_fit(inter, down.block_k)))


def _fit(size: int, tile: int) -> int:
    """`tile` halved until it divides `size` (not below 16)."""
    while tile > 16 and size % tile:
        tile //= 2
    return tile


def grouped_supported(fmt: int, hidden: int, inter: int, block: int, tiles: ExpertTiles | None = None) -> bool:
    """Whether the grouped kernels take these sizes: their tiles divide hidden and the intermediate
    size exactly (no masked weight loads); FP8: the scale block is a power of two from 16 to 128 and
    is the K step; MXFP4: K steps of whole 32-input groups."""
    if fmt == FP8_BLOCK and not (16 <= block <= 128 and block & (block - 1) == 0):
        return False
    t = tiles or expert_tiles(fmt, hidden, inter, block)
    if inter % t.up.block_n or hidden % t.up.block_k or hidden % t.down.block_n or inter % t.down.block_k:
        return False
    if fmt == FP8_BLOCK:
        return t.up.block_k == block == t.down.block_k and t.up.block_n % block == 0
    return fmt not in (MXFP4, MXFP4_PACKED) or (t.up.block_k % 32 == 0 and t.down.block_k % 32 == 0)


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


@dataclass(frozen=True, slots=True)
class Weights:
    """One GEMM's expert weights as the kernels take them: `w` [experts, rows, K (MXFP4: K / 2 bytes)],
    `scale` its scales (PLAIN: any tensor, unused), `fmt`, `block` (FP8: the scale block; else unused)."""

    w: Tensor
    scale: Tensor
    fmt: int
    block: int


def _meta(weights: Weights, t: GemmTiles, x: Tensor) -> dict:
    f8 = weights.fmt == FP8_BLOCK
    return dict(FORMAT=weights.fmt, GROUP=weights.block if f8 else 1, F8_DOT=f8 and x.is_cuda,
                PRECISION="ieee" if f8 and not x.is_cuda else precision(x), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                BLOCK_K=t.block_k, HALF=t.half, num_warps=t.num_warps, num_stages=t.num_stages)


def run_up(x: Tensor, xs: Tensor, plan: TilePlan, w13: Weights, top_k: int, limit: float, inter: int,
           tiles: GemmTiles) -> tuple[Tensor, Tensor]:
    """The up kernel over `plan` (made with tiles.block_m): (act [pairs, inter] in sorted-row order —
    x's dtype, FP8: e4m3 —, its FP8 scales [pairs, inter / block] float32, else act again). FP8: `x`
    e4m3 with scales `xs`."""
    pairs, hidden = plan.order.numel(), x.shape[1]
    if w13.fmt == FP8_BLOCK:
        act = torch.empty(pairs, inter, dtype=torch.float8_e4m3fn, device=x.device)
        acts = torch.empty(pairs, inter // w13.block, dtype=torch.float32, device=x.device)
    else:
        act = acts = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    num_n = inter // tiles.block_n
    _up_kernel[(plan.max_tiles * num_n,)](
        x, xs, plan.order, plan.tiles, w13.w, w13.scale, act, acts, plan.max_tiles, num_n, hidden, inter, top_k, limit,
        x.stride(0), w13.w.stride(0), w13.w.stride(1), w13.scale.stride(0), w13.scale.stride(1),
        **_meta(w13, tiles, x))
    return act, acts


def run_down(act: Tensor, acts: Tensor, plan: TilePlan, weights: Tensor, w2: Weights, hidden: int,
             dtype: torch.dtype, tiles: GemmTiles) -> Tensor:
    """The down kernel over `plan` (made with tiles.block_m): y [pairs, hidden] in `dtype`, row pair =
    routing weight (`weights` [pairs] float32) · the pair's expert output."""
    pairs, inter = act.shape
    y = torch.empty(pairs, hidden, dtype=dtype, device=act.device)
    num_n = hidden // tiles.block_n
    _down_kernel[(plan.max_tiles * num_n,)](
        act, acts, plan.order, plan.tiles, weights, w2.w, w2.scale, y, plan.max_tiles, num_n, hidden, inter,
        w2.w.stride(0), w2.w.stride(1), w2.scale.stride(0), w2.scale.stride(1), **_meta(w2, tiles, y))
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
    """(the up kernel's plan, the down kernel's): the pairs sorted once, one tile table per row tile."""
    order, counts = _sort_pairs(expert_ids, num_experts)
    up = TilePlan(order, _tile_table(counts, order.numel(), tiles.up.block_m), tiles.up.block_m)
    if tiles.down.block_m == tiles.up.block_m:
        return up, up
    return up, TilePlan(order, _tile_table(counts, order.numel(), tiles.down.block_m), tiles.down.block_m)


def grouped_experts(x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float, fmt: int,
                    s13: Tensor, s2: Tensor, block: int, inter: int, tiles: ExpertTiles | None = None) -> Tensor:
    """The routed experts through the grouped kernels: plan the tiles, quantise x (FP8), the up and
    down kernels, then each token's top-k rows added. `fmt` / `s13` / `s2` / `block` as
    `moe._experts` (PLAIN: scales unused); `tiles` overrides `expert_tiles` (tests, the sweep). The
    caller checks shapes (`grouped_supported`)."""
    num_tokens, top_k = expert_ids.shape
    hidden, num_experts = x.shape[1], w13.shape[0]
    tiles = tiles or expert_tiles(fmt, hidden, inter, block)
    up_plan, down_plan = plans(expert_ids, num_experts, tiles)
    xq, xs = quant_groups(x, block) if fmt == FP8_BLOCK else (x, x)
    act, acts = run_up(xq, xs, up_plan, Weights(w13, s13, fmt, block), top_k, limit, inter, tiles.up)
    y = run_down(act, acts, down_plan, weights.reshape(-1).float().contiguous(), Weights(w2, s2, fmt, block), hidden,
                 x.dtype, tiles.down)
    return sum_slots(y, num_tokens, top_k, x.dtype)


__all__ = ["ExpertTiles", "GemmTiles", "TilePlan", "Weights", "expert_tiles", "grouped_experts", "grouped_supported",
           "plan_tiles", "plans", "quant_groups", "run_down", "run_up", "sum_slots"]
