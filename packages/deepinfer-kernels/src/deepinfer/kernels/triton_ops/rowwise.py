"""Row-wise Triton kernel: RMSNorm, the interleaved partial RoPE, or both, in one launch.

Twins of `reference.rms_norm`, `reference.apply_rope` and `reference.norm_rope` (same signatures;
float32 arithmetic, output in the input's dtype, contiguous). Each program handles ROW_ELEMENTS //
dim rows of the last dimension (one when longer): a prefill's 8K tokens × 64 heads of 512 are 64K
programs of 8 rows, not 512K of one. The input may be a strided view: rows [tokens, dim] with any token stride, or
[tokens, heads, dim] with contiguous heads — the column slices of a stacked projection's output are
read in place, without a copy kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ._launch import on_triton


@triton.jit
def _row_kernel(x_ptr, w_ptr, pos_ptr, freq_ptr, out_ptr, num_rows, dim, heads, token_stride, rope_start, eps, sign,
                NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROPE: tl.constexpr, ROWS: tl.constexpr,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = row < num_rows
    token = row // heads
    src = x_ptr + (token * token_stride + (row % heads) * dim)[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    live = rm[:, None] & (d < dim)
    x = tl.load(src + d, mask=live, other=0.0).to(tl.float32)
    if ROPE:
        in_rope = live & (d >= rope_start)
        partner = tl.load(src + (d ^ 1), mask=in_rope, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)[:, None]
        x = x * inv_rms
        if HAS_WEIGHT:
            x = tl.load(w_ptr + d, mask=d < dim, other=0.0).to(tl.float32) * x
        x = x.to(out_ptr.dtype.element_ty).to(tl.float32)           # the norm's output, as stored
        if ROPE:
            partner = partner * inv_rms
            if HAS_WEIGHT:
                partner = tl.load(w_ptr + (d ^ 1), mask=(d < dim) & (d >= rope_start), other=0.0).to(tl.float32) \
                    * partner
            partner = partner.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ROPE:
        pair = tl.where(d >= rope_start, (d - rope_start) // 2, 0)
        freq = tl.load(freq_ptr + pair, mask=(d < dim) & (d >= rope_start), other=0.0)
        angle = tl.load(pos_ptr + token, mask=rm, other=0).to(tl.float32)[:, None] * freq
        sin = tl.sin(angle) * sign
        rotated = x * tl.cos(angle) + tl.where((d % 2) == 1, partner * sin, -partner * sin)
        x = tl.where(in_rope, rotated, x)
    tl.store(out_ptr + row[:, None] * dim + d, x.to(out_ptr.dtype.element_ty), mask=live)


def _launch(x: Tensor, weight: Tensor | None, eps: float, positions: Tensor | None, inv_freq: Tensor | None,
            *, norm: bool, inverse: bool = False) -> Tensor:
    dim = x.shape[-1]
    if x.dim() == 2 and x.stride(-1) == 1:
        src, heads = x, 1
    elif x.dim() == 3 and x.stride(-1) == 1 and x.stride(1) == dim:
        src, heads = x, x.shape[1]
    else:
        src = x.contiguous()
        heads = src.numel() // (dim * src.shape[0]) if src.dim() > 1 else 1
    rows = src.numel() // dim
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if inv_freq is None:
        pos, freq, rope_start, rope = src, src, dim, False
    elif positions is None:
        raise ValueError("RoPE (inv_freq) needs the positions")
    else:
        pos, freq, rope = positions.contiguous(), inv_freq.float().contiguous(), True
        rope_start = dim - 2 * inv_freq.shape[0]
    block = triton.next_power_of_2(dim)
    # Rows per program by the row length alone: a row's arithmetic never depends on how many rows the
    # call has (the batch-invariant set runs these kernels too).
    per_program = max(1, ROW_ELEMENTS // block)
    _row_kernel[(triton.cdiv(rows, per_program),)](
        src, weight if weight is not None else src, pos, freq, out, rows, dim, heads,
        src.stride(0) if src.dim() > 1 else dim, rope_start, eps,
        -1.0 if inverse else 1.0,
        NORM=norm, HAS_WEIGHT=weight is not None, ROPE=rope, ROWS=per_program, BLOCK=block,
        num_warps=4 if per_program * block <= 4096 else 8,
    )
    return out


ROW_ELEMENTS = 4096   # elements per program: short rows (a head's 512, q_lora's 1024) go several to a program


def rms_norm_fused(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Same contract as `reference.rms_norm` (CUDA; other devices run the reference)."""
    if not on_triton(x) or x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    return _launch(x, weight, eps, None, None, norm=True)


def apply_rope_fused(x: Tensor, positions: Tensor, inv_freq: Tensor, *, inverse: bool = False) -> Tensor:
    """Same contract as `reference.apply_rope` (CUDA; other devices run the reference)."""
    if not on_triton(x) or x.numel() == 0:
        return reference.apply_rope(x, positions, inv_freq, inverse=inverse)
    return _launch(x, None, 0.0, positions, inv_freq, norm=False, inverse=inverse)


def norm_rope_fused(x: Tensor, weight: Tensor | None, eps: float, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Same contract as `reference.norm_rope` (CUDA; other devices run the reference)."""
    if not on_triton(x) or x.numel() == 0:
        return reference.norm_rope(x, weight, eps, positions, inv_freq)
    return _launch(x, weight, eps, positions, inv_freq, norm=True)
