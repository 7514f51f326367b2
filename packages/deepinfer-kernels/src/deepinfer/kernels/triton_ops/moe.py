"""MoE kernels: routing in one launch, and the routed experts as two expert-grouped GEMM kernels.

- `route_fused`: one program per token scores the experts, picks the top-k by score + bias (ties →
  lowest expert id, k rounds of arg-max) and normalises the chosen scores.
- `moe_experts_fused` (small batches, ≤ `FUSED_MAX_PAIRS` (token, expert) pairs): one program sorts
  the pairs by expert and lists the active experts; program (a, n-block) of the next kernel takes
  the a-th active expert, gathers its tokens' rows and computes the clamped SwiGLU of both halves of
  `w13` for its block of intermediate channels; the second kernel applies `w2`, scales by the
  routing weight and stores each pair's row at its original slot; a third sums each token's top-k
  rows in slot order (deterministic, no atomics). Only the active experts' weights are read. From
  `GROUPED_MIN_PAIRS` pairs (prefill) the grouped GEMMs of `moe_grouped` take over (128-row tiles
  over the pairs sorted by expert, the gather fused into the load, SwiGLU in the epilogue).
- `moe_experts_fp8_fused` / `moe_experts_mxfp4_fused`: the same kernels on FP8 block-scaled weights
  (each tile converted to the activations' dtype, its partial product scaled) or MXFP4 ones (each
  tile decoded to the exact bfloat16 weights by the decoder `MXFP4_DECODE` of `mxfp4`: Triton's
  microscaling `dot_scaled`, or weights × activationsᵀ on 32-bit code words); from `GROUPED_MIN_PAIRS`
  pairs the grouped GEMMs (FP8: e4m3 × e4m3 on the FP8 tensor cores, activations quantised per
  1 × block group). `*_invariant`: the kernels here at any batch (batch-invariant).
- `moe_experts_invariant`: the expert kernels at any batch (batch-invariant).
- `clamped_swiglu_fused` (the shared expert): the gate + up projections (one GEMV over the stacked
  w1; w3), the activation in one kernel, the down projection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import invariant, reference
from ..torch_ops import moe_experts_grouped
from ._launch import on_triton, precision
from .gemv import linear_fused
from .mxfp4 import (
    DECODES,
    MX_DOT_SCALED,
    MX_PACKED,
    group_scales,
    load_columns,
    mxfp4_dot,
    mxfp4_tile,
    packed_weights,
    runnable_decode,
)

FUSED_MAX_PAIRS = 2048
GROUPED_MIN_PAIRS = FUSED_MAX_PAIRS + 1     # from here on the grouped GEMMs of `moe_grouped` (prefill)
# The FP8 grouped GEMMs (prefill, from GROUPED_MIN_PAIRS pairs). Their GPU test failures (issue #29)
# were the twin's, not the kernels': torch computes `cuda_tensor / 448` as a multiply by 448's float32
# reciprocal, one ulp off the kernel's correctly rounded group scales in about half the groups, and
# the stage-by-stage check (`fp8_stages` in tests/test_triton_moe_grouped.py) requires them bitwise.
# With the twin dividing, every test of test_triton_moe_grouped.py passed on an H100 on 2026-12-07
# (the V4-Flash shapes at 512 and 4096 tokens and the injected indexing bugs included): on.
GROUPED_FP8 = True
# How the small-batch expert kernels decode MXFP4 weights stored as the checkpoint has them
# (`mxfp4.DECODES` but MX_PACKED, whose codes are re-packed; where the choice cannot run,
# `mxfp4.runnable_decode` says what does), and their (BLOCK_N, BLOCK_K) per decoder.
MXFP4_DECODE = MX_DOT_SCALED
MXFP4_TILES = {decode: (64, 128) for decode in DECODES.values()}
# Whether the model loader re-packs routed MXFP4 experts on CUDA for the `packed` decoder
# (`mxfp4.MX_PACKED`, `deepinfer.kernels.mxfp4_layout`); their ops then run it at every batch.
MXFP4_REPACK = False
_SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _log1p(y):
    """log(1 + y) for y ≥ 0, accurate for tiny y (series) and large y."""
    return tl.where(y < 1e-4, y - 0.5 * y * y + y * y * y / 3.0, tl.log(1.0 + y))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, num_experts, logits_stride, scaling,
                  TOP_K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < num_experts
    x = tl.load(logits_ptr + t * logits_stride + e, mask=em, other=0.0).to(tl.float32)
    if SCORING == 0:     # sqrt(softplus(x)), softplus linear above 20 as torch's
        scores = tl.sqrt(tl.where(x > 20.0, x, tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x)))))
    elif SCORING == 1:
        scores = tl.sigmoid(x)
    else:
        z = tl.exp(tl.where(em, x, float("-inf")) - tl.max(tl.where(em, x, float("-inf")), axis=0))
        scores = z / tl.sum(z, axis=0)
    keys = scores
    if HAS_BIAS:
        keys = keys + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)
    keys = tl.where(em, keys, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    chosen = tl.zeros([BLOCK_K], tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        pick = tl.min(tl.where(keys == best, e, BLOCK_E), axis=0)
        ids = tl.where(slot == i, pick, ids)
        chosen = tl.where(slot == i, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), chosen)
        keys = tl.where(e == pick, float("-inf"), keys)
    if NORMALIZE:
        chosen = chosen / (tl.sum(chosen, axis=0) + 1e-20)
    tl.store(ids_ptr + t * TOP_K + slot, ids, mask=slot < TOP_K)
    tl.store(weights_ptr + t * TOP_K + slot, chosen * scaling, mask=slot < TOP_K)


def route_fused(
    logits: Tensor, bias: Tensor | None, top_k: int, *, scoring_func: str, normalize: bool, scaling: float
) -> tuple[Tensor, Tensor]:
    """Same contract as `reference.route`."""
    num_tokens, num_experts = logits.shape
    if not on_triton(logits) or scoring_func not in _SCORING or top_k > num_experts or logits.stride(-1) != 1:
        return reference.route(logits, bias, top_k, scoring_func=scoring_func, normalize=normalize, scaling=scaling)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, bias if bias is not None else logits, ids, weights, num_experts, logits.stride(0), scaling,
            TOP_K=top_k, SCORING=_SCORING[scoring_func], HAS_BIAS=bias is not None, NORMALIZE=normalize,
            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
        )
    return ids, weights


@triton.jit
def _align_kernel(ids_ptr, order_ptr, scratch_ptr, meta_ptr, pairs, num_slots, BLOCK_P: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """Sort the (token, expert) pairs by expert, stably, in one program (packed (expert, pair) keys),
    and describe each active expert: meta = [expert id; first sorted row; end row] per slot, slots in
    increasing expert order, unused slots empty (0, 0, 0)."""
    p = tl.arange(0, BLOCK_P)
    pm = p < pairs
    experts = tl.load(ids_ptr + p, mask=pm, other=0).to(tl.int64)
    keys = tl.sort(tl.where(pm, (experts << 32) | p.to(tl.int64), 0x7FFFFFFFFFFFFFFF))
    expert = keys >> 32
    tl.store(order_ptr + p, keys & 0xFFFFFFFF, mask=pm)
    tl.store(scratch_ptr + p, expert, mask=pm)
    tl.debug_barrier()                                      # neighbours' sorted experts, via memory
    prev = tl.load(scratch_ptr + p - 1, mask=pm & (p > 0), other=-1)
    nxt = tl.load(scratch_ptr + p + 1, mask=p + 1 < pairs, other=-1)
    first = pm & (expert != prev)
    slot = tl.cumsum(first.to(tl.int32), axis=0) - 1
    tl.store(meta_ptr + slot, expert.to(tl.int32), mask=first)
    tl.store(meta_ptr + num_slots + slot, p, mask=first)
    tl.store(meta_ptr + 2 * num_slots + slot, p + 1, mask=pm & (expert != nxt))
    s = tl.arange(0, BLOCK_S)
    unused = (s >= tl.sum(first.to(tl.int32), axis=0)) & (s < num_slots)
    for part in tl.static_range(3):
        tl.store(meta_ptr + part * num_slots + s, tl.zeros([BLOCK_S], tl.int32), mask=unused)


@triton.jit
def _slot(meta_ptr, num_slots):
    """(expert id, first sorted row, row count) of this program's slot (axis 0)."""
    a = tl.program_id(0)
    start = tl.load(meta_ptr + num_slots + a)
    return tl.load(meta_ptr + a), start, tl.load(meta_ptr + 2 * num_slots + a) - start


@triton.jit
def _clamped_silu_mul(gate, up, limit):
    gate = tl.minimum(gate, limit)
    return gate / (1.0 + tl.exp(-gate)) * tl.minimum(tl.maximum(up, -limit), limit)


# Weight formats of the expert kernels. MXFP4_PACKED (codes re-packed, `deepinfer.kernels.mxfp4_layout`)
# is the grouped kernels' alone: the small-batch ones take MXFP4 with the decoder `mxfp4.MX_PACKED`.
PLAIN, FP8_BLOCK, MXFP4, MXFP4_PACKED = 0, 1, 2, 3


@triton.jit
def _scale(scale_ptr, expert, row, col, s_expert, s_row, BLOCK_S: tl.constexpr):
    """The FP8 block scale covering weight element (row, col) of `expert`."""
    return tl.load(scale_ptr + expert.to(tl.int64) * s_expert + (row // BLOCK_S) * s_row + col // BLOCK_S)


@triton.jit
def _e2m1(code):
    """FP4 e2m1 codes (uint8 0–15, bit 3 the sign) → float32 values."""
    c = code.to(tl.int32)
    m = c & 7
    half = (m & 1).to(tl.float32) * 0.5
    mag = tl.where(m < 2, half, tl.exp2(((m >> 1) - 1).to(tl.float32)) * (1.0 + half))
    return tl.where(c >= 8, -mag, mag)


@triton.jit
def _weight_tile(w_rows, s_rows, k0, k_in, nm, dtype, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0 … k0 + BLOCK_K of the weight rows at `w_rows` ([BLOCK_N, 1] pointers) in `dtype`:
    as stored (FP8 converted; its block scale is the caller's), or MXFP4 codes decoded and scaled
    (MXFP4_PACKED: re-packed codes, `mxfp4.packed_weights`)."""
    if FORMAT == 3:
        return packed_weights(w_rows, s_rows, k0, k_in, nm, BLOCK_K).to(dtype)
    elif FORMAT == 2:
        packed, scale = mxfp4_tile(w_rows, s_rows, k0, k_in, nm, BLOCK_K)
        values = tl.interleave(_e2m1(packed & 0xF), _e2m1(packed >> 4))
        scale = tl.exp2(scale.to(tl.float32) - 127.0)
        rows: tl.constexpr = values.shape[0]
        values = tl.reshape(tl.reshape(values, (rows, BLOCK_K // 32, 32)) * scale[:, :, None], (rows, BLOCK_K))
        return values.to(dtype)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(w_rows + k[None, :], mask=nm[:, None] & (k < k_in)[None, :], other=0.0).to(dtype)


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """A float32 accumulator: [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] on MXFP4 code words (WORDS:
    the `mxfp4` decoders but MX_DOT_SCALED multiply weights × activationsᵀ)."""
    if WORDS:
        out = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        out = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    return out


@triton.jit
def _rows_first(acc, WORDS: tl.constexpr):
    """An accumulator of `_zeros` as [BLOCK_M, BLOCK_N]."""
    if WORDS:
        out = tl.trans(acc)
    else:
        out = acc
    return out


@triton.jit
def _dot_tile(a, acc, w_rows, s_rows, k0, k_in, nm, block_scale, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
              PRECISION: tl.constexpr, DECODE: tl.constexpr, BF16_MATH: tl.constexpr):
    """acc + a @ (weight columns k0 … k0 + BLOCK_K of the rows at `w_rows`)ᵀ, a [BLOCK_M, BLOCK_K]:
    FP8 partial products scaled by the tile's `block_scale`; MXFP4 decoded by `DECODE` (`mxfp4`; for
    MX_PACKED `block_scale` is the step's group scale bytes)."""
    if FORMAT == 2:
        out = mxfp4_dot(a, acc, w_rows, s_rows, k0, k_in, nm, block_scale, BLOCK_K, PRECISION, DECODE, BF16_MATH)
    elif FORMAT == 1:
        w = tl.trans(_weight_tile(w_rows, s_rows, k0, k_in, nm, a.dtype, FORMAT, BLOCK_K))
        out = acc + tl.dot(a, w, input_precision=PRECISION) * block_scale
    else:
        w = tl.trans(_weight_tile(w_rows, s_rows, k0, k_in, nm, a.dtype, FORMAT, BLOCK_K))
        out = tl.dot(a, w, acc, input_precision=PRECISION)
    return out


@triton.jit
def _expert_up_kernel(x_ptr, order_ptr, meta_ptr, w13_ptr, s13_ptr, act_ptr, num_slots, hidden, inter, top_k, limit,
                      w_expert, w_row, s_expert, s_row, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, FORMAT: tl.constexpr, BLOCK_S: tl.constexpr,
                      DECODE: tl.constexpr, BF16_MATH: tl.constexpr):
    """FORMAT FP8_BLOCK: one float32 scale per BLOCK_S × BLOCK_S block (BLOCK_N, BLOCK_K divide
    BLOCK_S, so each weight tile has one, applied to the tile's partial product); MXFP4: packed rows
    (`w_row` bytes apart) with uint8 e8m0 scales per 32 inputs (`s_row` apart), decoded by `DECODE`
    (`mxfp4`; MX_GROUP_DOT takes each BLOCK_K in 32-column steps). BF16_MATH: bf16 arithmetic."""
    WORDS: tl.constexpr = FORMAT == 2 and DECODE != 0
    PACKED: tl.constexpr = FORMAT == 2 and DECODE == 5
    COLUMNS: tl.constexpr = WORDS + PACKED                              # `load_columns`' order
    STEP: tl.constexpr = 32 if FORMAT == 2 and DECODE == 2 else BLOCK_K
    expert, start, count = _slot(meta_ptr, num_slots)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    nm = n < inter
    w1 = w13_ptr + expert.to(tl.int64) * w_expert + n[:, None] * w_row
    w3 = w1 + inter * w_row
    s1 = s13_ptr + expert.to(tl.int64) * s_expert + n[:, None] * s_row
    s3 = s1 + inter * s_row
    for m0 in range(0, count, BLOCK_M):
        r = start + m0 + tl.arange(0, BLOCK_M)
        rm = m0 + tl.arange(0, BLOCK_M) < count
        tokens = tl.load(order_ptr + r, mask=rm, other=0) // top_k
        gate = _zeros(BLOCK_M, BLOCK_N, WORDS)
        up = _zeros(BLOCK_M, BLOCK_N, WORDS)
        next1, next3 = 1.0, 1.0            # FP8: the block scales of the coming K step, loaded a step early
        if FORMAT == 1:
            next1 = _scale(s13_ptr, expert, n0, 0, s_expert, s_row, BLOCK_S)
            next3 = _scale(s13_ptr, expert, inter + n0, 0, s_expert, s_row, BLOCK_S)
        if PACKED:                         # MX_PACKED: its group scale bytes, a step early too
            next1, next3 = group_scales(s1, 0, hidden, nm, BLOCK_K), group_scales(s3, 0, hidden, nm, BLOCK_K)
        for k0 in range(0, hidden, BLOCK_K):
            bs1, bs3 = next1, next3
            if FORMAT == 1:
                k_next = tl.minimum(k0 + BLOCK_K, hidden - 1)
                next1 = _scale(s13_ptr, expert, n0, k_next, s_expert, s_row, BLOCK_S)
                next3 = _scale(s13_ptr, expert, inter + n0, k_next, s_expert, s_row, BLOCK_S)
            if PACKED:
                next1 = group_scales(s1, k0 + BLOCK_K, hidden, nm, BLOCK_K)
                next3 = group_scales(s3, k0 + BLOCK_K, hidden, nm, BLOCK_K)
            for ks in tl.static_range(0, BLOCK_K, STEP):
                xs = load_columns(x_ptr + tokens[:, None] * hidden, k0 + ks, hidden, rm[:, None], STEP, COLUMNS)
                gate = _dot_tile(xs, gate, w1, s1, k0 + ks, hidden, nm, bs1, FORMAT, STEP, PRECISION, DECODE,
                                 BF16_MATH)
                up = _dot_tile(xs, up, w3, s3, k0 + ks, hidden, nm, bs3, FORMAT, STEP, PRECISION, DECODE, BF16_MATH)
        act = _rows_first(_clamped_silu_mul(gate, up, limit), WORDS)
        tl.store(act_ptr + r[:, None] * inter + n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=rm[:, None] & nm[None, :])


@triton.jit
def _expert_down_kernel(act_ptr, order_ptr, meta_ptr, weights_ptr, w2_ptr, s2_ptr, y_ptr, num_slots, hidden, inter,
                        w_expert, w_row, s_expert, s_row, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, FORMAT: tl.constexpr,
                        BLOCK_S: tl.constexpr, DECODE: tl.constexpr, BF16_MATH: tl.constexpr):
    WORDS: tl.constexpr = FORMAT == 2 and DECODE != 0
    PACKED: tl.constexpr = FORMAT == 2 and DECODE == 5
    COLUMNS: tl.constexpr = WORDS + PACKED
    STEP: tl.constexpr = 32 if FORMAT == 2 and DECODE == 2 else BLOCK_K
    expert, start, count = _slot(meta_ptr, num_slots)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    nm = n < hidden
    w2 = w2_ptr + expert.to(tl.int64) * w_expert + n[:, None] * w_row
    s2 = s2_ptr + expert.to(tl.int64) * s_expert + n[:, None] * s_row
    for m0 in range(0, count, BLOCK_M):
        r = start + m0 + tl.arange(0, BLOCK_M)
        rm = m0 + tl.arange(0, BLOCK_M) < count
        pair = tl.load(order_ptr + r, mask=rm, other=0)
        acc = _zeros(BLOCK_M, BLOCK_N, WORDS)
        next_bs = 1.0                      # FP8 and MX_PACKED: as in the up kernel, a step early
        if FORMAT == 1:
            next_bs = _scale(s2_ptr, expert, n0, 0, s_expert, s_row, BLOCK_S)
        if PACKED:
            next_bs = group_scales(s2, 0, inter, nm, BLOCK_K)
        for k0 in range(0, inter, BLOCK_K):
            bs = next_bs
            if FORMAT == 1:
                next_bs = _scale(s2_ptr, expert, n0, tl.minimum(k0 + BLOCK_K, inter - 1), s_expert, s_row, BLOCK_S)
            if PACKED:
                next_bs = group_scales(s2, k0 + BLOCK_K, inter, nm, BLOCK_K)
            for ks in tl.static_range(0, BLOCK_K, STEP):
                a = load_columns(act_ptr + r[:, None] * inter, k0 + ks, inter, rm[:, None], STEP, COLUMNS)
                acc = _dot_tile(a, acc, w2, s2, k0 + ks, inter, nm, bs, FORMAT, STEP, PRECISION, DECODE, BF16_MATH)
        acc = _rows_first(acc, WORDS) * tl.load(weights_ptr + pair, mask=rm, other=0.0)[:, None]
        tl.store(y_ptr + pair[:, None] * hidden + n[None, :], acc, mask=rm[:, None] & nm[None, :])


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + k) * hidden + d, mask=dm, other=0.0)
    tl.store(out_ptr + t * hidden + d, acc.to(out_ptr.dtype.element_ty), mask=dm)


def moe_experts_fused(x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """Same contract as `reference.moe_experts` (CUDA-graph safe: no host synchronisation): up to
    `FUSED_MAX_PAIRS` pairs the expert kernels here; from `GROUPED_MIN_PAIRS` the grouped GEMMs of
    `moe_grouped` (two-byte activations), else cuBLAS's grouped GEMMs."""
    pairs = expert_ids.numel()
    if (not on_triton(x) or pairs == 0 or x.dtype != w13.dtype
            or not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous())):
        return moe_experts_grouped(x, expert_ids, weights, w13, w2, limit)
    if pairs >= GROUPED_MIN_PAIRS and _grouped(x, PLAIN, w2.shape[-1], 1):
        return _grouped_experts(x, expert_ids, weights, w13, w2, limit, PLAIN, w13, w2, 1, w2.shape[-1])
    if pairs > FUSED_MAX_PAIRS:
        return moe_experts_grouped(x, expert_ids, weights, w13, w2, limit)
    return _experts(x, expert_ids, weights, w13, w2, limit, PLAIN, w13, w2, 1, w2.shape[-1])


def moe_experts_invariant(x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor,
                          limit: float) -> Tensor:
    """Same contract as `reference.moe_experts`, batch-invariant: the expert kernels at every batch
    (never cuBLAS's grouped GEMMs, whose tiles follow the batch). A token's rows sit in fixed-shape
    tiles of its expert's rows; each output element is one dot product over K whichever rows share
    the tile, and a token's slots are added in slot order. Elsewhere: the PyTorch twin."""
    if (not on_triton(x) or expert_ids.numel() == 0 or x.dtype != w13.dtype
            or not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous())):
        return invariant.moe_experts(x, expert_ids, weights, w13, w2, limit)
    return _experts(x, expert_ids, weights, w13, w2, limit, PLAIN, w13, w2, 1, w2.shape[-1])


def moe_experts_fp8_fused(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
    limit: float, block: int,
) -> Tensor:
    """Same contract as `reference.moe_experts_fp8`. Below `GROUPED_MIN_PAIRS` pairs the expert kernels
    here read the FP8 weights and apply each block's scale to the tile's partial product (bfloat16
    activations, as the reference); from there on, the grouped GEMMs of `moe_grouped` on Hopper's FP8 tensor
    cores, the activations quantised per 1 × block group as DeepSeek's FP8 GEMMs do (twin:
    `reference.moe.moe_experts_fp8_w8a8`). Needs block ≥ 16, a power of two, dividing the
    intermediate size; else the reference. The grouped GEMMs only with `GROUPED_FP8` (on)."""
    contiguous = all(t.is_contiguous() for t in (x, w13, w13_scale, w2, w2_scale))
    if (GROUPED_FP8 and expert_ids.numel() >= GROUPED_MIN_PAIRS and on_triton(x)
            and _grouped(x, FP8_BLOCK, w2.shape[-1], block) and contiguous):
        return _grouped_experts(x, expert_ids, weights, w13, w2, limit, FP8_BLOCK, w13_scale, w2_scale, block,
                                w2.shape[-1])
    return moe_experts_fp8_invariant(x, expert_ids, weights, w13, w13_scale, w2, w2_scale, limit, block)


def moe_experts_fp8_invariant(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
    limit: float, block: int,
) -> Tensor:
    """Same contract as `reference.moe_experts_fp8`, batch-invariant: the expert kernels here at any
    number of pairs (above `FUSED_MAX_PAIRS` aligned with torch ops). Needs block ≥ 16, a power of
    two, dividing the intermediate size; else the reference."""
    tensors = (x, w13, w13_scale, w2, w2_scale)
    if (not on_triton(x) or expert_ids.numel() == 0 or block < 16 or block & (block - 1) or w2.shape[-1] % block
            or not all(t.is_contiguous() for t in tensors)):
        return reference.moe_experts_fp8(x, expert_ids, weights, w13, w13_scale, w2, w2_scale, limit, block)
    return _experts(x, expert_ids, weights, w13, w2, limit, FP8_BLOCK, w13_scale, w2_scale, block, w2.shape[-1])


def moe_experts_mxfp4_fused(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
    limit: float, *, packed: bool = False,
) -> Tensor:
    """Same contract as `reference.moe_experts_mxfp4`: below `GROUPED_MIN_PAIRS` pairs the expert
    kernels here, from there on the grouped GEMMs of `moe_grouped` (both decode the e2m1 codes in the
    kernel). Needs hidden and intermediate sizes divisible by 32 and uint8-coded scales; else the
    reference. Re-packed codes (`packed`): `mxfp4.MX_PACKED` in the expert kernels, MXFP4_PACKED in the
    grouped ones."""
    inter, fmt = 2 * w2.shape[-1], MXFP4_PACKED if packed else MXFP4
    if (expert_ids.numel() >= GROUPED_MIN_PAIRS and on_triton(x) and _grouped(x, fmt, inter, 32)
            and w13_scale.dtype == torch.uint8 and w2_scale.dtype == torch.uint8
            and all(t.is_contiguous() for t in (x, w13, w13_scale, w2, w2_scale))):
        return _grouped_experts(x, expert_ids, weights, w13.view(torch.uint8), w2.view(torch.uint8), limit, fmt,
                                w13_scale, w2_scale, 32, inter)
    return moe_experts_mxfp4_invariant(x, expert_ids, weights, w13, w13_scale, w2, w2_scale, limit, packed=packed)


def moe_experts_mxfp4_invariant(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
    limit: float, *, packed: bool = False,
) -> Tensor:
    """Same contract as `reference.moe_experts_mxfp4`, batch-invariant: the expert kernels here decode
    the packed e2m1 codes and their e8m0 group scales tile by tile (any number of pairs; decoder
    `MXFP4_DECODE`, or `mxfp4.MX_PACKED` for re-packed codes). Needs hidden and intermediate sizes
    divisible by 32, uint8-coded scales and codes at 4-byte-aligned addresses (read as 32-bit words);
    else the reference."""
    tensors = (x, w13, w13_scale, w2, w2_scale)
    inter, hidden = 2 * w2.shape[-1], x.shape[-1]
    if (not on_triton(x) or expert_ids.numel() == 0 or inter % 32 or hidden % 32 or w13_scale.dtype != torch.uint8
            or w2_scale.dtype != torch.uint8 or not all(t.is_contiguous() for t in tensors)
            or w13.data_ptr() % 4 or w2.data_ptr() % 4):
        return reference.moe_experts_mxfp4(x, expert_ids, weights, w13, w13_scale, w2, w2_scale, limit, packed=packed)
    return _experts(x, expert_ids, weights, w13.view(torch.uint8), w2.view(torch.uint8), limit, MXFP4, w13_scale,
                    w2_scale, 32, inter, decode=MX_PACKED if packed else None)


def _grouped(x: Tensor, fmt: int, inter: int, block: int) -> bool:
    """Whether a large batch takes the grouped GEMMs: two-byte activations on a GPU (any float dtype
    under the interpreter) and sizes their tiles divide."""
    from .moe_grouped import grouped_supported

    return (x.element_size() == 2 or not x.is_cuda) and grouped_supported(fmt, x.shape[-1], inter, block)


def _grouped_experts(*args) -> Tensor:
    from .moe_grouped import grouped_experts  # imports this module: bound at first use

    return grouped_experts(*args)


def _align(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, int]:
    """(order [pairs] int64: pair ids sorted by expert, stably; meta [3, slots] int32: expert id,
    first sorted row, end row per slot; slots). Small batches: the one-program sort kernel over the
    active experts; larger: torch ops over every expert (idle experts get empty slots)."""
    pairs = expert_ids.numel()
    flat = expert_ids.reshape(-1)
    if pairs <= FUSED_MAX_PAIRS:
        slots = min(num_experts, pairs)              # at most this many experts are active
        order = torch.empty(pairs, dtype=torch.int64, device=flat.device)
        scratch = torch.empty(pairs, dtype=torch.int64, device=flat.device)
        meta = torch.empty(3, slots, dtype=torch.int32, device=flat.device)
        block_p = max(triton.next_power_of_2(pairs), 2)
        _align_kernel[(1,)](flat.contiguous(), order, scratch, meta, pairs, slots, BLOCK_P=block_p,
                            BLOCK_S=triton.next_power_of_2(slots), num_warps=4 if block_p <= 512 else 8)
        return order, meta, slots
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    ends = torch.cumsum(counts, 0)
    meta = torch.stack((torch.arange(num_experts, device=flat.device), ends - counts, ends)).to(torch.int32)
    return order, meta, num_experts


def _tiles(fmt: int, block: int, decode: int = MX_DOT_SCALED) -> dict[str, int]:
    """Tile shape and launch shape of the expert kernels for weight format `fmt` (FP8: `block` is the
    scale block edge, which the tiles must divide; MXFP4: per decoder, `MXFP4_TILES`). Fixed per
    format and decoder: a token's result must not depend on the batch."""
    if fmt == FP8_BLOCK:
        block_n, block_k = min(32, block), min(128, block)
    else:
        block_n, block_k = MXFP4_TILES[decode] if fmt == MXFP4 else (64, 128)
    return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)


def _experts(x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float, fmt: int,
             s13: Tensor, s2: Tensor, block: int, inter: int, *, decode: int | None = None,
             tiles: dict[str, int] | None = None) -> Tensor:
    """Align the pairs, run the up and down kernels on weights of format `fmt` (scales s13 / s2 and
    their block edge; for PLAIN any tensors, unused), sum each token's rows. `decode`: MXFP4's
    decoder (default `MXFP4_DECODE`; `mxfp4.MX_PACKED` for re-packed codes); `tiles` (default `_tiles`)
    for benchmarks."""
    if fmt == MXFP4 and decode is None and MXFP4_DECODE == MX_PACKED:
        raise ValueError("moe.MXFP4_DECODE must decode codes as stored; MX_PACKED reads re-packed ones (the ops' "
                         "packed=True, with moe.MXFP4_REPACK)")
    num_tokens, top_k = expert_ids.shape
    pairs = num_tokens * top_k
    num_experts, hidden = w13.shape[0], x.shape[1]
    order, meta, slots = _align(expert_ids, num_experts)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    decode = runnable_decode(MXFP4_DECODE if decode is None else decode, x) if fmt == MXFP4 else MX_DOT_SCALED
    tiles = _tiles(fmt, block, decode) if tiles is None else tiles
    meta_args = dict(PRECISION=precision(x), FORMAT=fmt, BLOCK_S=block, DECODE=decode, BF16_MATH=x.is_cuda,
                     **tiles)
    _expert_up_kernel[(slots, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x, order, meta, w13, s13, act, slots, hidden, inter, top_k, limit, w13.stride(0), w13.stride(1),
        s13.stride(0), s13.stride(1), **meta_args,
    )
    _expert_down_kernel[(slots, triton.cdiv(hidden, tiles["BLOCK_N"]))](
        act, order, meta, weights.reshape(-1).float().contiguous(), w2, s2, y, slots, hidden, inter,
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), **meta_args,
    )
    out = torch.empty_like(x)
    block = min(triton.next_power_of_2(hidden), 1024)
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, block))](y, out, hidden, TOP_K=top_k, BLOCK=block,
                                                                  num_warps=4)
    return out


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, width, gate_stride, up_stride, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < width
    gate = tl.load(gate_ptr + row * gate_stride + i, mask=live, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + i, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + i, _clamped_silu_mul(gate, up, limit).to(out_ptr.dtype.element_ty), mask=live)


def _rows_together(a: Tensor, b: Tensor) -> Tensor | None:
    """a and b as one [2n, k] tensor when b's rows directly follow a's in memory (the model stacks
    the shared expert's w1 and w3 so), else None."""
    if (a.dim() != 2 or a.shape != b.shape or a.dtype != b.dtype or not (a.is_contiguous() and b.is_contiguous())
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or b.storage_offset() != a.storage_offset() + a.numel()):
        return None
    return a.as_strided((2 * a.shape[0], a.shape[1]), (a.shape[1], 1))


def clamped_swiglu_fused(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, limit: float, *,
                         linear: Callable[[Tensor, Tensor], Tensor] = linear_fused) -> Tensor:
    """Same contract as `reference.clamped_swiglu`: the gate and up projections (one GEMM when w3's
    rows follow w1's in memory), one activation kernel, the down projection; `linear` is the
    projection kernel (the registry passes TileLang's GEMV where installed)."""
    if not on_triton(x) or x.numel() == 0:
        return reference.clamped_swiglu(x, w1, w3, w2, limit)
    x2 = x.reshape(-1, x.shape[-1])
    inter = w1.shape[0]
    w13 = _rows_together(w1, w3)
    if w13 is not None:
        gate_up = linear(x2, w13)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        gate, up = linear(x2, w1), linear(x2, w3)
    act = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = 1024
    _swiglu_kernel[(x2.shape[0], triton.cdiv(inter, block))](gate, up, act, inter, gate.stride(0), up.stride(0),
                                                             limit, BLOCK=block, num_warps=4)
    return linear(act, w2).view(*x.shape[:-1], w2.shape[0])
