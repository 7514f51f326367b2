"""Interleaved partial rotary embedding (RoPE) on the trailing channels, with optional YaRN."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .norm import rms_norm


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN frequency interpolation (no attention mscale: DeepSeek-V4 uses factor 1.0)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def rope_inv_freq(rope_dim: int, base: float, yarn: YarnScaling | None = None) -> Tensor:
    """Inverse frequencies of the `rope_dim // 2` channel pairs, float32 [rope_dim // 2].

    With `yarn`, pair i gets `θ_i / factor · ramp_i + θ_i · (1 − ramp_i)` where the ramp rises
    linearly from 0 at the `beta_fast` correction dimension to 1 at the `beta_slow` one (both
    rounded outwards, floor / ceil, as in the YaRN paper's truncated form).
    """
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    inv_freq = 1.0 / (base**exponents)
    if yarn is None or yarn.factor <= 1.0:
        return inv_freq

    def correction_dim(num_rotations: float) -> float:
        wavelength_ratio = yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return rope_dim * math.log(wavelength_ratio) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    span = (high - low) if high > low else 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / span).clamp(0.0, 1.0)
    return inv_freq / yarn.factor * ramp + inv_freq * (1.0 - ramp)


def apply_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, *, inverse: bool = False) -> Tensor:
    """Rotate the last `2 * len(inv_freq)` channels of x in interleaved pairs (2i, 2i+1).

    Args:
        x: [num_tokens, ..., dim] float; leading `dim − rope_dim` channels pass through.
        positions: [num_tokens] int64 absolute positions.
        inv_freq: [rope_dim // 2] float32 from `rope_inv_freq`.
        inverse: rotate by the conjugate (−angle), used on attention outputs whose values
            carried RoPE.
    Returns:
        Tensor like x (same dtype); the rotation is computed in float32.
    """
    rope_dim = 2 * inv_freq.shape[0]
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(x.device)[None, :]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    rope = x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)


def norm_rope(x: Tensor, weight: Tensor | None, eps: float, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """RMSNorm then RoPE, as the attention applies them to queries and keys: exactly
    `apply_rope(rms_norm(x, weight, eps), positions, inv_freq)` (the normalised values are rounded to
    x's dtype before the rotation).

    Args:
        x: [num_tokens, ..., dim]; weight: [dim] float32 or None; positions: [num_tokens] int64;
        inv_freq: [rope_dim // 2] float32.
    Returns:
        Tensor like x (same dtype).
    """
    return apply_rope(rms_norm(x, weight, eps), positions, inv_freq)
