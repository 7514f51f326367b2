"""Matrix–vector products for decode batches of 1–4 rows: twin of `reference.linear`.

cuBLAS runs these small products as split-K GEMMs plus a reduction kernel and reads the 2–84 MB
projections of a V4 layer at 1.5–3.4 TB/s. Two kernels replace it, chosen per shape from a sweep on
the H200 (docs/benchmarks/decode_h200.md, "GEMV"):

- `_gemv_kernel`: each program owns BLOCK_N output channels and streams their weight rows in tiles
  of BLOCK_N × BLOCK_K; every thread keeps float32 products of its slice of the tile in registers
  and the tile is reduced over K once, after the loop (no shuffles inside it). Best for one row,
  and for narrow outputs (≤ 2048 channels) at any row count.
- `_gemv_mma_kernel`: the rows are padded to 16 and each weight tile goes through the tensor cores
  (`tl.dot`), which lets Triton pipeline the tile loads through shared memory. Best for 2–4 rows,
  and for one row when K is short (≤ 1024) and the output wide.

More than `MAX_ROWS` rows: cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ._launch import on_triton

MAX_ROWS = 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, rows, n_out, k_in, x_stride, w_stride, out_stride, k_split, split_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n-block, s) sums k in [s·k_split, (s+1)·k_split) into out + s·split_stride."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_w = w_ptr + tl.minimum(n, n_out - 1)[:, None].to(tl.int64) * w_stride    # clamped: no row mask
    m = tl.arange(0, BLOCK_M)
    mm = m < rows
    lo = tl.program_id(1) * k_split
    hi = tl.minimum(lo + k_split, k_in)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < hi
        w = tl.load(rows_w + k[None, :], mask=km[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)
    dst = out_ptr + tl.program_id(1) * split_stride + m[:, None] * out_stride + n[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mm[:, None] & (n < n_out)[None, :])


@triton.jit
def _gemv_mma_kernel(x_ptr, w_ptr, out_ptr, rows, n_out, k_in, x_stride, w_stride, out_stride,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_w = w_ptr + tl.minimum(n, n_out - 1)[:, None].to(tl.int64) * w_stride
    m = tl.arange(0, 16)
    mm = m < rows
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_in
        w = tl.load(rows_w + k[None, :], mask=km[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    tl.store(out_ptr + m[None, :] * out_stride + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=mm[None, :] & (n < n_out)[:, None])


def _prev_pow2(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def gemv(x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
    """x [rows ≤ MAX_ROWS, in] @ weightᵀ → [rows, out] in `out_dtype`, float32 accumulation. x's rows
    may be strided (last dim contiguous); weight [out, in] with contiguous rows, in x's dtype or
    float32 (products are formed in float32 either way)."""
    rows, k_in = x.shape
    n_out = weight.shape[0]
    out = torch.empty(rows, n_out, dtype=out_dtype, device=x.device)
    args = (x, weight, out, rows, n_out, k_in, x.stride(0), weight.stride(0), out.stride(0))
    tensor_cores = weight.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
    if tensor_cores and n_out >= 2048 and (rows > 1 or (n_out >= 4096 and k_in <= 1024)):
        block_n = min(max(_prev_pow2(n_out // 64), 16), 64)
        long_k = k_in >= 2048
        _gemv_mma_kernel[(triton.cdiv(n_out, block_n),)](
            *args, BLOCK_N=block_n, BLOCK_K=256 if long_k else 128, num_warps=4, num_stages=5 if long_k else 3)
    else:
        _register_gemv(x, weight, out, 1)
    return out


def _register_plan(rows: int, n_out: int, k_in: int, splits: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, k_split, ranges) of `_gemv_kernel` with K cut into at most
    `splits` ranges of k_split (a multiple of BLOCK_K)."""
    block_m = triton.next_power_of_2(rows)
    block_n = min(_prev_pow2(n_out // 384), 4)
    k_split = triton.cdiv(k_in, splits)
    block_k = min(triton.next_power_of_2(k_split), (4096 if rows == 1 else 2048) // block_n)
    k_split = triton.cdiv(k_split, block_k) * block_k
    return block_m, block_n, block_k, k_split, triton.cdiv(k_in, k_split)


def _register_gemv(x: Tensor, weight: Tensor, out: Tensor, splits: int) -> None:
    """Launch `_gemv_kernel` with K range s into out[s] (out [ranges, rows, n] or, with one
    split, [rows, n])."""
    rows, k_in = x.shape
    n_out = weight.shape[0]
    block_m, block_n, block_k, k_split, ranges = _register_plan(rows, n_out, k_in, splits)
    _gemv_kernel[(triton.cdiv(n_out, block_n), ranges)](
        x, weight, out, rows, n_out, k_in, x.stride(0), weight.stride(0), out.stride(-2), k_split,
        out.stride(0) if splits > 1 else 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        num_stages=1)


def gemv_partials(x: Tensor, weight: Tensor, splits: int) -> Tensor:
    """Split-K form of `gemv` for very narrow outputs (too few programs otherwise): [ranges ≤ splits,
    rows, out] float32 partial products over consecutive K ranges; their sum over dim 0 is
    x @ weightᵀ. The consumer adds them in a fixed order, so the result is deterministic."""
    rows, k_in = x.shape
    ranges = _register_plan(rows, weight.shape[0], k_in, splits)[-1]
    out = torch.empty(ranges, rows, weight.shape[0], dtype=torch.float32, device=x.device)
    _register_gemv(x, weight, out, splits)
    return out


def linear_fused(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `reference.linear` (x of at most MAX_ROWS rows; weight rows contiguous)."""
    k_in = x.shape[-1]
    rows = x.numel() // k_in if k_in else 0
    if (not on_triton(x) or rows == 0 or rows > MAX_ROWS or x.dtype != weight.dtype
            or weight.dim() != 2 or weight.stride(-1) != 1):
        return reference.linear(x, weight)
    x2 = x.reshape(rows, k_in) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return gemv(x2, weight, x.dtype).view(*x.shape[:-1], weight.shape[0])
