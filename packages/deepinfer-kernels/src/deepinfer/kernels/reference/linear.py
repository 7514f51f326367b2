"""The bias-free projection every layer uses."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weightᵀ.

    Args:
        x: [..., in]; weight: [out, in] in x's dtype.
    Returns:
        [..., out] in x's dtype (float32 accumulation).
    """
    return F.linear(x, weight)
