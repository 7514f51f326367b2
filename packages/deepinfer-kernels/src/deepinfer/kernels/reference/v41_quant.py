"""DeepSeek-V4.1 cache formats: packed rows and their quantise / dequantise twins.

V4.1 is trained with its cache quantised (reference/deepseek-v4-spec.md §2.9.2–§2.9.4, §3.2), so
these formats are the model's numerics, not an approximation:

- window KV, MXFP8: `dim` FP8 e4m3 codes, then `dim / 32` UE8M0 scale bytes (2^(byte − 127));
  512-d rows take 528 B.
- compressed KV, FP4 with e4m3 scales: `dim / 2` bytes of e2m1 code pairs (low nibble = even
  channel), then `dim / 16` FP8 e4m3 scale bytes; 512-d rows take 288 B.
- index keys, FP4 with UE8M0 scales: `dim / 2` code bytes, then `dim / 32` UE8M0 bytes; 128-d rows
  take 68 B.

Rounding (what the checkpoint was trained with):
- UE8M0 scales are 2^ceil(log2(amax · (1 / qmax))) taken from the float32 bits (exponent, plus one
  when the mantissa is not zero), with amax floored at 1e-4 (FP8) or 6·2^-126 (FP4).
- e4m3 FP4 scales are amax / 6 (amax floored at 6·2^-9) rounded to e4m3.
- Values scale, clamp to ±qmax and round to nearest, ties to the even code (FP8: torch's cast;
  e2m1: 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

FP8_MAX = 448.0
FP4_MAX = 6.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between e2m1 magnitudes; at those marked True a tie rounds up (to the even code).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


def packed_row_bytes(fmt: str, dim: int) -> int:
    """Bytes of one packed row of `dim` channels in `fmt` ("mxfp8", "fp4_e4m3" or "fp4_ue8m0")."""
    if fmt == "mxfp8":
        return dim + dim // 32
    if fmt == "fp4_e4m3":
        return dim // 2 + dim // 16
    if fmt == "fp4_ue8m0":
        return dim // 2 + dim // 32
    raise ValueError(f"fmt={fmt!r} must be 'mxfp8', 'fp4_e4m3' or 'fp4_ue8m0'")


def pow2_ceil(t: Tensor) -> Tensor:
    """2^ceil(log2(t)) for positive float32 t, exact (from the IEEE-754 bits)."""
    bits = t.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(exponent.float())


def _blocks(x: Tensor, block: int) -> Tensor:
    dim = x.shape[-1]
    if dim % block:
        raise ValueError(f"last dim {dim} must be a multiple of the block {block}")
    return x.float().reshape(*x.shape[:-1], dim // block, block)


@functools.cache
def _constants(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(midpoints, ties-up flags, signed e2m1 values) on `device`, made once (a copy from the host is
    not allowed while a CUDA graph is captured)."""
    values = torch.tensor(_E2M1 + tuple(-x for x in _E2M1), dtype=torch.float32, device=device)
    return (torch.tensor(_MIDPOINTS, dtype=torch.float32, device=device), torch.tensor(_TIE_UP, device=device),
            values)


def e2m1_codes(v: Tensor) -> Tensor:
    """Codes (uint8, bit 3 = sign) of float32 values already within ±6, rounded to nearest even."""
    mid, tie_up, _ = _constants(v.device)
    mag = v.abs().contiguous()
    code = torch.bucketize(mag, mid, right=False)             # midpoints strictly below |v|
    at_tie = (mag.unsqueeze(-1) == mid) & tie_up
    code = code + at_tie.any(-1).to(code.dtype)
    return (code | (torch.signbit(v).to(code.dtype) << 3)).to(torch.uint8)


def e2m1_values(codes: Tensor) -> Tensor:
    """float32 values of uint8 e2m1 codes (bit 3 = sign)."""
    return _constants(codes.device)[2][codes.long()]


def _ue8m0(amax: Tensor, qmax: float) -> Tensor:
    return pow2_ceil(amax * (1.0 / qmax))


def quant_mxfp8_rows(x: Tensor) -> Tensor:
    """[..., dim] float → [..., dim + dim / 32] uint8 packed MXFP8 rows (block 32, UE8M0 scales)."""
    blocks = _blocks(x, 32)
    scale = _ue8m0(blocks.abs().amax(-1).clamp_min(1e-4), FP8_MAX)
    codes = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    exponents = (torch.log2(scale) + 127).to(torch.uint8)
    return torch.cat((codes.view(torch.uint8).flatten(-2), exponents), dim=-1)


def dequant_mxfp8_rows(rows: Tensor, dim: int) -> Tensor:
    """[..., dim + dim / 32] uint8 packed MXFP8 rows → [..., dim] float32."""
    codes = rows[..., :dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = torch.exp2(rows[..., dim:].float() - 127.0)
    return (codes.unflatten(-1, (dim // 32, 32)) * scale.unsqueeze(-1)).flatten(-2)


def _fp4_scale(blocks: Tensor, e4m3: bool) -> tuple[Tensor, Tensor]:
    """(float32 scale per block, its stored byte)."""
    amax = blocks.abs().amax(-1)
    if e4m3:
        stored = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn)
        return stored.float(), stored.view(torch.uint8)
    scale = _ue8m0(amax.clamp_min(FP4_MAX * 2.0**-126), FP4_MAX)
    return scale, (torch.log2(scale) + 127).to(torch.uint8)


def quant_fp4_rows(x: Tensor, *, e4m3_scales: bool) -> Tensor:
    """[..., dim] float → packed FP4 rows: `dim / 2` code bytes (low nibble = even channel), then
    the scale bytes: e4m3 per 16 channels (`e4m3_scales`, compressed KV) or UE8M0 per 32 (index keys)."""
    block = 16 if e4m3_scales else 32
    blocks = _blocks(x, block)
    scale, stored = _fp4_scale(blocks, e4m3_scales)
    codes = e2m1_codes((blocks / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    pairs = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat((pairs, stored), dim=-1)


def dequant_fp4_rows(rows: Tensor, dim: int, *, e4m3_scales: bool) -> Tensor:
    """Packed FP4 rows (see `quant_fp4_rows`) → [..., dim] float32."""
    block = 16 if e4m3_scales else 32
    pairs = rows[..., :dim // 2]
    codes = torch.stack((pairs & 0xF, pairs >> 4), dim=-1).flatten(-2)
    stored = rows[..., dim // 2:].contiguous()
    scale = stored.view(torch.float8_e4m3fn).float() if e4m3_scales else torch.exp2(stored.float() - 127.0)
    return (e2m1_values(codes).unflatten(-1, (dim // block, block)) * scale.unsqueeze(-1)).flatten(-2)


def fake_quant_mxfp8(x: Tensor) -> Tensor:
    """x rounded through the MXFP8 window format and back, in x's dtype."""
    return dequant_mxfp8_rows(quant_mxfp8_rows(x), x.shape[-1]).to(x.dtype)


def fake_quant_fp4_rows(x: Tensor, *, e4m3_scales: bool) -> Tensor:
    """x rounded through a packed FP4 format and back, in x's dtype."""
    return dequant_fp4_rows(quant_fp4_rows(x, e4m3_scales=e4m3_scales), x.shape[-1],
                            e4m3_scales=e4m3_scales).to(x.dtype)
