"""Weight dequantisation (FP8 block-scaled, MXFP4) and KV fake-quantisation (FP8 / FP4).

Formats (reference/deepseek-v4-spec.md §4.3):
- FP8 weights: `W[i, j] = e4m3(Wq[i, j]) · S[i // b, j // b]`, S stored as e8m0 (2^(byte − 127))
  or float32, shape [ceil(out / b), ceil(in / b)].
- MXFP4 experts: `[out, in / 2]` bytes, low nibble = even (first) element; nibble → e2m1 value
  (bit 3 = sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6); one e8m0 scale per 32 inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0


def scale_to_float(scale: Tensor) -> Tensor:
    """e8m0 / fp32 / uint8-coded-e8m0 scales → float32 (a uint8 byte b means 2^(b − 127))."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequant_fp8_block(weight: Tensor, scale: Tensor, block: int) -> Tensor:
    """FP8 e4m3 block-scaled weight → float32.

    Args:
        weight: [out, in] float8_e4m3fn.
        scale: [ceil(out / block), ceil(in / block)] e8m0, float32 or uint8-coded e8m0.
        block: block edge (128 for V4, 32 for V4.1).
    Returns:
        [out, in] float32.
    """
    out_dim, in_dim = weight.shape
    s = scale_to_float(scale)
    expected = (-(-out_dim // block), -(-in_dim // block))
    if tuple(s.shape) != expected:
        raise ValueError(f"fp8 scale shape {tuple(s.shape)} != expected {expected} for weight {tuple(weight.shape)}")
    full = s.repeat_interleave(block, 0)[:out_dim].repeat_interleave(block, 1)[:, :in_dim]
    return weight.float() * full


def quant_fp8_block(weight: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """A float weight → FP8 e4m3 block-scaled (the inverse of `dequant_fp8_block`, up to rounding):
    each block's scale is its absolute maximum / 448 (1 for an all-zero block), float32.

    Args:
        weight: [out, in] float; block: block edge.
    Returns:
        ([out, in] float8_e4m3fn, [ceil(out / block), ceil(in / block)] float32).
    """
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=weight.device)
    padded[:out_dim, :in_dim] = weight.float()
    amax = padded.view(rows, block, cols, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(block, 0)[:out_dim].repeat_interleave(block, 1)[:, :in_dim]
    return (weight.float() / full).to(torch.float8_e4m3fn), scale


def dequant_mxfp4(packed: Tensor, scale: Tensor, group: int = 32) -> Tensor:
    """MXFP4 packed weight → float32.

    Args:
        packed: [out, in / 2] int8 or uint8, two e2m1 codes per byte (low nibble first).
        scale: [out, in / group] e8m0 (or uint8-coded e8m0).
    Returns:
        [out, in] float32.
    """
    codes = packed.view(torch.uint8)
    out_dim, half = codes.shape
    in_dim = 2 * half
    s = scale_to_float(scale)
    if tuple(s.shape) != (out_dim, in_dim // group):
        raise ValueError(f"mxfp4 scale shape {tuple(s.shape)} != expected {(out_dim, in_dim // group)}")
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(out_dim, in_dim).long()
    return lut[nibbles] * s.repeat_interleave(group, 1)


def _pow2_scale(amax: Tensor, qmax: float) -> Tensor:
    """ue8m0 scale: 2^ceil(log2(amax / qmax)), 1 for all-zero blocks."""
    ratio = (amax / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.ceil(torch.log2(ratio)))


def _fake_quant(x: Tensor, block: int, qmax: float, round_scaled: Callable[[Tensor], Tensor]) -> Tensor:
    """Scale each `block` channels by a power of two so their max magnitude is ≤ qmax, round, scale back."""
    shape = x.shape
    blocks = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    scale = _pow2_scale(blocks.abs().amax(-1, keepdim=True), qmax)
    return (round_scaled((blocks / scale).clamp(-qmax, qmax)) * scale).reshape(shape).to(x.dtype)


def fake_quant_fp8(x: Tensor, block: int) -> Tensor:
    """Round x to FP8 e4m3 with one power-of-two scale per `block` channels, then back.

    Args:
        x: [..., dim] with dim divisible by block.
    Returns:
        Tensor like x holding FP8-representable values times their block scales.
    """
    return _fake_quant(x, block, FP8_E4M3_MAX, lambda v: v.to(torch.float8_e4m3fn).float())


def fake_quant_fp4(x: Tensor, block: int = 32) -> Tensor:
    """Round x to FP4 e2m1 with one power-of-two scale per `block` channels, then back.

    Each scaled magnitude goes to the nearest e2m1 value (an exact tie takes the smaller one).

    Args:
        x: [..., dim] with dim divisible by block.
    Returns:
        Tensor like x holding FP4-representable values times their block scales.
    """
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    return _fake_quant(x, block, FP4_E2M1_MAX, lambda v: grid[_nearest_e2m1(v)] * torch.sign(v))


def _nearest_e2m1(v: Tensor) -> Tensor:
    """Index (0–7) of the e2m1 magnitude nearest |v| (an exact tie takes the smaller one)."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    return (v.abs().unsqueeze(-1) - grid).abs().argmin(-1)


def quant_mxfp4(weight: Tensor, group: int = 32) -> tuple[Tensor, Tensor]:
    """A float weight → MXFP4 (the inverse of `dequant_mxfp4`, up to rounding): per `group` inputs a
    power-of-two scale 2^ceil(log2(absmax / 6)), each value the nearest e2m1 code times it.

    Args:
        weight: [out, in] float, in divisible by `group` (even).
    Returns:
        (packed [out, in / 2] uint8, low nibble first; scale [out, in / group] uint8-coded e8m0).
    """
    out_dim, in_dim = weight.shape
    if in_dim % group or group % 2:
        raise ValueError(f"mxfp4 needs in={in_dim} divisible by the group {group} (even)")
    groups = weight.float().reshape(out_dim, in_dim // group, group)
    scale = _pow2_scale(groups.abs().amax(-1, keepdim=True), FP4_E2M1_MAX)
    scaled = (groups / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX).reshape(out_dim, in_dim)
    codes = (_nearest_e2m1(scaled) | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (torch.log2(scale.squeeze(-1)) + 127).to(torch.uint8)
