"""DeepSeek-V4.1 cache-row quantisation in one launch per call: twins of `reference.v41_quant`'s
`quant_mxfp8_rows`, `quant_fp4_rows`, `fake_quant_mxfp8` and `fake_quant_fp4_rows`.

The model quantises on every cache write (each layer's window row every step, the KV sources' compressed
rows and index keys, the index queries' rounding); the reference takes 15–25 small kernels per call.
One program per row: block maxima, scales and codes bit-exact with the reference (UE8M0 exponents and
e4m3 / e2m1 round-to-nearest-even built from the float bits; divisions by non-power-of-two scales
through `div_rn`), written packed or, for the fake-quant ops, decoded back to the input's dtype. Outside
the formats' range — an FP4 e4m3 block whose maximum exceeds 6 · 448, where the reference stores a NaN
scale — the bytes are unspecified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ._launch import on_triton
from .v41_paged import _e2m1, _e4m3

MXFP8, FP4_E4M3, FP4_UE8M0 = 1, 2, 3


@triton.jit
def _e4m3_code(v):
    """e4m3 byte (int32) of float32 v with |v| <= 448, rounded to nearest even (sign kept, −0 too)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    y = tl.abs(v) * 512.0
    low = tl.floor(y)
    frac = y - low
    up = (frac > 0.5) | ((frac == 0.5) & ((low.to(tl.int32) & 1) == 1))
    sub = low.to(tl.int32) + up.to(tl.int32)
    return tl.where((a >> 23) >= 121, normal, sub) | sign


@triton.jit
def _e2m1_code(v):
    """e2m1 code (int32, bit 3 = sign) of float32 v within ±6, nearest, ties to the even code."""
    m = tl.abs(v)
    code = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32) \
        + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32)
    return code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def _ue8m0_exponent(t):
    """Biased exponent (int32) of 2^ceil(log2(t)) for positive float32 t, from its bits."""
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _quant_rows_kernel(x_ptr, out_ptr, x_row, out_row, dim, FMT: tl.constexpr, FAKE: tl.constexpr,
                       BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NUM_BLOCKS)
    c = tl.arange(0, BLOCK)
    ch = b[:, None] * BLOCK + c[None, :]                               # [NUM_BLOCKS, BLOCK] channels
    live = ch < dim
    x = tl.load(x_ptr + r * x_row + ch, mask=live, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if FMT == 1:
        exponent = _ue8m0_exponent(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        scale = (exponent << 23).to(tl.float32, bitcast=True)
        inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
        code = _e4m3_code(tl.minimum(tl.maximum(x * inverse[:, None], -448.0), 448.0))
        if FAKE:
            tl.store(out_ptr + r * out_row + ch, (_e4m3(code) * scale[:, None]).to(out_ptr.dtype.element_ty),
                     mask=live)
        else:
            tl.store(out_ptr + r * out_row + ch, code.to(tl.uint8), mask=live)
            tl.store(out_ptr + r * out_row + dim + b, exponent.to(tl.uint8), mask=b * BLOCK < dim)
    else:
        if FMT == 2:
            stored = _e4m3_code(tl.math.div_rn(tl.maximum(amax, 6.0 * 0.001953125), tl.full(amax.shape, 6.0,
                                                                                             tl.float32)))
            scale = _e4m3(stored)
            scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        else:
            exponent = _ue8m0_exponent(tl.maximum(amax, 6.0 * 1.1754943508222875e-38) * (1.0 / 6.0))
            stored = exponent
            scale = (exponent << 23).to(tl.float32, bitcast=True)
            scaled = x * ((254 - exponent) << 23).to(tl.float32, bitcast=True)[:, None]
        code = _e2m1_code(tl.minimum(tl.maximum(scaled, -6.0), 6.0))
        if FAKE:
            tl.store(out_ptr + r * out_row + ch, (_e2m1(code) * scale[:, None]).to(out_ptr.dtype.element_ty),
                     mask=live)
        else:
            flat = tl.reshape(code, (BLOCK_D // 2, 2))
            low, high = tl.split(flat)
            pair = tl.arange(0, BLOCK_D // 2)
            tl.store(out_ptr + r * out_row + pair, (low | (high << 4)).to(tl.uint8), mask=pair * 2 < dim)
            tl.store(out_ptr + r * out_row + dim // 2 + b, stored.to(tl.uint8), mask=b * BLOCK < dim)


def _run(x: Tensor, fmt: int, fake: bool) -> Tensor:
    block = 32 if fmt != FP4_E4M3 else 16
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if fake:
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(rows.shape[0], reference.packed_row_bytes(
            {MXFP8: "mxfp8", FP4_E4M3: "fp4_e4m3", FP4_UE8M0: "fp4_ue8m0"}[fmt], dim), dtype=torch.uint8,
            device=x.device)
    if rows.shape[0]:
        num_blocks = triton.next_power_of_2(dim // block)
        _quant_rows_kernel[(rows.shape[0],)](rows, out, rows.stride(0), out.stride(0), dim, FMT=fmt, FAKE=fake,
                                             BLOCK=block, NUM_BLOCKS=num_blocks, BLOCK_D=num_blocks * block,
                                             num_warps=4)
    return out.view(*x.shape[:-1], out.shape[-1])


def _applies(x: Tensor, block: int) -> bool:
    return on_triton(x) and x.dim() >= 1 and x.shape[-1] % block == 0 and x.shape[-1] > 0 and x.is_floating_point()


def quant_mxfp8_rows_fused(x: Tensor) -> Tensor:
    """Same contract as `reference.quant_mxfp8_rows`."""
    return _run(x, MXFP8, False) if _applies(x, 32) else reference.quant_mxfp8_rows(x)


def quant_fp4_rows_fused(x: Tensor, *, e4m3_scales: bool) -> Tensor:
    """Same contract as `reference.quant_fp4_rows`."""
    if not _applies(x, 16 if e4m3_scales else 32):
        return reference.quant_fp4_rows(x, e4m3_scales=e4m3_scales)
    return _run(x, FP4_E4M3 if e4m3_scales else FP4_UE8M0, False)


def fake_quant_mxfp8_fused(x: Tensor) -> Tensor:
    """Same contract as `reference.fake_quant_mxfp8`."""
    return _run(x, MXFP8, True) if _applies(x, 32) else reference.fake_quant_mxfp8(x)


def fake_quant_fp4_rows_fused(x: Tensor, *, e4m3_scales: bool) -> Tensor:
    """Same contract as `reference.fake_quant_fp4_rows`."""
    if not _applies(x, 16 if e4m3_scales else 32):
        return reference.fake_quant_fp4_rows(x, e4m3_scales=e4m3_scales)
    return _run(x, FP4_E4M3 if e4m3_scales else FP4_UE8M0, True)
