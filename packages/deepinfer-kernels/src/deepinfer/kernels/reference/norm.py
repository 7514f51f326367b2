"""RMS normalisation, weighted and unweighted."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Root-mean-square normalisation over the last dim, computed in float32.

    Args:
        x: [..., dim], any float dtype.
        weight: [dim] (kept in float32 by the model) or None for the unweighted form.
        eps: added to the mean square before the reciprocal square root.
    Returns:
        [..., dim] in x's dtype.
    """
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = weight.float() * out
    return out.to(x.dtype)
