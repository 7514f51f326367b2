"""Batch-invariant projections: one GEMM kernel whose tiles never depend on the number of rows.

cuBLAS, the GEMV kernels of `gemv.py` and their row-count switches pick tiles, split-K and even the
algorithm by the batch, so a row's x @ Wᵀ changes in its last bits with the batch. `_gemm_kernel`
fixes everything but the row count: BLOCK_M = 16 rows per program, BLOCK_N and BLOCK_K chosen from
the weight's shape and dtype only, the K loop in one order, and `rows` left unspecialised (Triton
would otherwise compile another kernel for one row). Each output element is one tensor-core (or,
for float32, exact FMA) dot product over K, the same whichever rows share its tile.

- `linear_invariant` / `grouped_linear_invariant`: twins of `reference.linear` / `.grouped_linear`
  (the groups of `wo_a` are the grid's third axis).
- `gemm_partials_invariant`: split-K partial products over a fixed number of K ranges, for outputs
  too narrow to fill the GPU (the mHC projection); the consumer adds them in a fixed order.

This costs speed where the shape-tuned kernels would win (one row, large prefill batches);
docs/batch_invariance.md has the H200 numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import invariant
from ._launch import on_triton, precision

BLOCK_M = 16
_TARGET_PROGRAMS = 264        # two waves of an H200's 132 SMs: BLOCK_N shrinks until a row tile has them


@triton.jit(do_not_specialize=["rows"])
def _gemm_kernel(x_ptr, w_ptr, out_ptr, rows, n_out, k_in, x_row, x_group, w_row, w_group, out_row, out_group,
                 out_split, k_split, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (n-block, m-block, group · SPLITS + split) sums k in [split · k_split, …) for its tile."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    mm = m < rows
    w_rows = w_ptr + group * w_group + tl.minimum(n, n_out - 1)[:, None].to(tl.int64) * w_row
    x_rows = x_ptr + group * x_group + tl.where(mm, m, 0)[:, None].to(tl.int64) * x_row
    lo = split * k_split
    hi = tl.minimum(lo + k_split, k_in)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < hi
        x = tl.load(x_rows + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=km[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    dst = out_ptr + split * out_split + group * out_group + m[:, None].to(tl.int64) * out_row + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & (n < n_out)[None, :])


def _prev_pow2(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def _plan(n_out: int, k_in: int, dtype: torch.dtype, groups: int) -> dict[str, int]:
    """Tile and launch shape from the weight's shape and dtype alone (never the row count)."""
    if dtype in (torch.bfloat16, torch.float16):
        block_n = min(max(_prev_pow2(n_out * groups // _TARGET_PROGRAMS), 16), 64)
        block_k = min(256 if k_in >= 2048 else 128, max(triton.next_power_of_2(k_in), 16))
        return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4 if block_k == 256 else 3)
    return dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)   # float32: exact FMA products


def _launch(x: Tensor, weight: Tensor, out: Tensor, groups: int, splits: int) -> None:
    """out[(split,) row, (group,) n] = Σ_k∈split x[row, (group,) k] · weight[(group ·) n, k]; groups and
    splits are not combined."""
    assert groups == 1 or splits == 1
    rows, k_in = x.shape[0], x.shape[-1]
    n_out = weight.shape[0] // groups
    plan = _plan(n_out, k_in, x.dtype, groups)
    k_split = triton.cdiv(triton.cdiv(k_in, splits), plan["BLOCK_K"]) * plan["BLOCK_K"]
    grid = (triton.cdiv(n_out, plan["BLOCK_N"]), triton.cdiv(rows, BLOCK_M), groups * splits)
    _gemm_kernel[grid](
        x, weight, out, rows, n_out, k_in, x.stride(0), x.stride(1) if groups > 1 else 0, weight.stride(0),
        n_out * weight.stride(0), out.stride(-2) if groups == 1 else out.stride(0), out.stride(1) if groups > 1 else 0,
        out.stride(0) if splits > 1 else 0, k_split, SPLITS=splits, BLOCK_M=BLOCK_M,
        PRECISION=precision(x), **plan,
    )


def _takes(x: Tensor, weight: Tensor) -> bool:
    return (on_triton(x) and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.dim() == 2 and weight.stride(-1) == 1 and x.shape[-1] > 0)


def linear_invariant(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `reference.linear`, batch-invariant (other devices and dtypes: the PyTorch
    twin `invariant.linear`)."""
    if not _takes(x, weight) or not weight.is_contiguous():
        return invariant.linear(x, weight)
    k_in, n_out = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k_in)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n_out, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _launch(x2, weight, out, 1, 1)
    return out.view(*x.shape[:-1], n_out)


def grouped_linear_invariant(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `reference.grouped_linear`, batch-invariant: x [tokens, groups, in] (any token
    and group strides, contiguous last dim) → [tokens, groups, out]."""
    weight = weight.to(x.dtype)
    if not _takes(x, weight) or not weight.is_contiguous() or x.stride(-1) != 1:
        return invariant.grouped_linear(x, weight)
    num_tokens, groups = x.shape[:2]
    n_out = weight.shape[0] // groups
    out = torch.empty(num_tokens, groups, n_out, dtype=x.dtype, device=x.device)
    if num_tokens:
        _launch(x, weight, out, groups, 1)
    return out


def gemm_partials_invariant(x: Tensor, weight: Tensor, splits: int) -> Tensor:
    """x [rows, in] and weight [out, in] of one dtype → [splits, rows, out] float32 partial products
    over consecutive K ranges (a range may be empty: zeros); their sum over dim 0 is x @ weightᵀ.
    Batch-invariant when the consumer adds them in a fixed order."""
    out = torch.empty(splits, x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _launch(x if x.stride(-1) == 1 else x.contiguous(), weight.contiguous(), out, 1, splits)
    return out
