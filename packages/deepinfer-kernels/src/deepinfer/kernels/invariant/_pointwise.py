"""Elementwise functions built only from primitives that give the same bits at any position.

A CPU elementwise kernel runs its vectorised body over whole vectors and a scalar version of the
function over the tail of the tensor (ATen's `vectorized_loop`), so an element's result can depend on
where it falls in the tensor — that is, on the batch. In torch 2.13 (CPU, AVX-512) torch.sigmoid,
F.silu and F.softplus (float32) and torch.rsqrt (bfloat16) differ between the two paths by an ulp
on some inputs; exp, log1p, +, ×, ÷ and sqrt do not (tests/test_batch_invariant.py pins this). These
twins compose the latter, in float32, and round once to the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

SOFTPLUS_THRESHOLD = 20.0   # above it softplus(x) = x, as torch's


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + e^−x), computed in float32, in x's dtype."""
    xf = x.float()
    return (1.0 / (1.0 + torch.exp(-xf))).to(x.dtype)


def silu(x: Tensor) -> Tensor:
    """x / (1 + e^−x), computed in float32, in x's dtype."""
    xf = x.float()
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


def softplus(x: Tensor) -> Tensor:
    """log(1 + e^x) (x itself above SOFTPLUS_THRESHOLD), computed in float32, in x's dtype."""
    xf = x.float()
    return torch.where(xf > SOFTPLUS_THRESHOLD, xf, torch.log1p(torch.exp(xf.clamp(max=SOFTPLUS_THRESHOLD)))
                       ).to(x.dtype)


def sum_along(x: Tensor, dim: int, *, keepdim: bool = False) -> Tensor:
    """Sum over `dim` by adding its slices one after another (a fixed order whatever the other
    dimensions are; meant for short dims: mHC streams, top-k slots, heads)."""
    total = x.select(dim, 0)
    for i in range(1, x.shape[dim]):
        total = total + x.select(dim, i)
    return total.unsqueeze(dim) if keepdim else total
