"""Row-wise Triton kernels: RMSNorm and the interleaved partial RoPE, one launch each.

Twins of `reference.rms_norm` and `reference.apply_rope` (same signatures; float32 arithmetic,
output in the input's dtype). Each program handles one row of the last dimension.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ._launch import on_triton


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, dim, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    live = d < dim
    x = tl.load(x_ptr + row * dim + d, mask=live, other=0.0).to(tl.float32)
    out = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    if HAS_WEIGHT:
        out = tl.load(w_ptr + d, mask=live, other=0.0).to(tl.float32) * out
    tl.store(out_ptr + row * dim + d, out.to(out_ptr.dtype.element_ty), mask=live)


def rms_norm_fused(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Same contract as `reference.rms_norm` (CUDA; other devices run the reference)."""
    if not on_triton(x) or x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    dim = x.shape[-1]
    src = x.contiguous()
    out = torch.empty_like(src)
    _rms_norm_kernel[(src.numel() // dim,)](
        src, weight if weight is not None else src, out, dim, eps,
        HAS_WEIGHT=weight is not None, BLOCK=triton.next_power_of_2(dim), num_warps=4 if dim <= 4096 else 8,
    )
    return out


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, dim, rows_per_token, rope_start, sign,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    live = d < dim
    x = tl.load(x_ptr + row * dim + d, mask=live, other=0.0).to(tl.float32)
    in_rope = live & (d >= rope_start)
    partner = tl.load(x_ptr + row * dim + (d ^ 1), mask=in_rope, other=0.0).to(tl.float32)
    pair = tl.where(in_rope, (d - rope_start) // 2, 0)
    angle = tl.load(pos_ptr + row // rows_per_token).to(tl.float32) * tl.load(freq_ptr + pair, mask=in_rope, other=0.0)
    sin = tl.sin(angle) * sign
    odd = (d % 2) == 1
    rotated = x * tl.cos(angle) + tl.where(odd, partner * sin, -partner * sin)
    tl.store(out_ptr + row * dim + d, tl.where(in_rope, rotated, x).to(out_ptr.dtype.element_ty), mask=live)


def apply_rope_fused(x: Tensor, positions: Tensor, inv_freq: Tensor, *, inverse: bool = False) -> Tensor:
    """Same contract as `reference.apply_rope` (CUDA; other devices run the reference)."""
    if not on_triton(x) or x.numel() == 0:
        return reference.apply_rope(x, positions, inv_freq, inverse=inverse)
    dim = x.shape[-1]
    rope_dim = 2 * inv_freq.shape[0]
    src = x.contiguous()
    out = torch.empty_like(src)
    rows = src.numel() // dim
    _rope_kernel[(rows,)](
        src, positions.contiguous(), inv_freq.float().contiguous(), out, dim, rows // x.shape[0], dim - rope_dim,
        -1.0 if inverse else 1.0, BLOCK=triton.next_power_of_2(dim), num_warps=4,
    )
    return out
