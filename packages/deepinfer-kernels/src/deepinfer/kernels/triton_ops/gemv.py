"""Matrix–vector products for decode batches of 1–4 rows: twin of `reference.linear`.

cuBLAS runs these small products as split-K GEMMs plus a reduction kernel, reaching about half the
copy bandwidth on the 0.5–64 MB projections of a V4 layer. Here one launch streams the weight
rows: each program owns BLOCK_N output channels and walks K in tiles of ~4 K elements (wide in K
when N is small), multiplying every row of x in registers (float32 accumulation). Block shapes are
chosen so about `_PROGRAMS` programs share the weight. More than `MAX_ROWS` rows: cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ._launch import on_triton

MAX_ROWS = 4
_PROGRAMS = 512
_TILE = 4096


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, rows, n_out, k_in, x_stride, w_stride, out_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < n_out
    m = tl.arange(0, BLOCK_M)
    mm = m < rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_in
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + m[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def _prev_pow2(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def linear_fused(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `reference.linear` (x of at most MAX_ROWS rows; weight contiguous)."""
    k_in = x.shape[-1]
    rows = x.numel() // k_in if k_in else 0
    if (not on_triton(x) or rows == 0 or rows > MAX_ROWS or x.dtype != weight.dtype
            or not weight.is_contiguous() or weight.dim() != 2):
        return reference.linear(x, weight)
    n_out = weight.shape[0]
    x2 = x.reshape(rows, k_in)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    block_m = triton.next_power_of_2(rows)
    block_n = min(_prev_pow2(n_out // _PROGRAMS), 64)
    block_k = min(triton.next_power_of_2(k_in), max(_TILE // (block_n * block_m), 16))
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x2, weight, out, rows, n_out, k_in, x2.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )
    return out.view(*x.shape[:-1], n_out)
