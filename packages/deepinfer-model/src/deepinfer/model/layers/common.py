"""Small building blocks shared by the layers."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Weighted RMSNorm holding its weight in float32 (parameter `weight`, [dim])."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps


def linear(dim_in: int, dim_out: int) -> nn.Linear:
    """A bias-free projection (weights stored [out, in])."""
    return nn.Linear(dim_in, dim_out, bias=False)


@functools.cache
def hadamard(dim: int, device: torch.device | str = "cpu") -> Tensor:
    """Orthonormal Sylvester–Hadamard matrix [dim, dim] (dim a power of two), float32 (cached)."""
    if dim & (dim - 1):
        raise ValueError(f"hadamard dim={dim} must be a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(dim)).to(device)
