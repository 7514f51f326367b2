"""mHC whose rows do not depend on the batch: the projection through the tiled `linear`, the sums
over streams and over the comb matrix's rows and columns added slice after slice, the sigmoid
from position-independent primitives (`_pointwise`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..reference.norm import rms_norm as reference_rms_norm
from ._pointwise import sigmoid, sum_along
from .linear import Linear, linear

RmsNorm = Callable[[Tensor, Tensor | None, float], Tensor]


def _collapse(pre: Tensor, streams: Tensor) -> Tensor:
    """Σ_h pre[:, h] · streams[:, h] in float32, added stream after stream, in streams' dtype."""
    return sum_along(pre.unsqueeze(-1) * streams.float(), 1).to(streams.dtype)


def hc_pre(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
    linear: Linear = linear,
) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as `reference.hc_pre`."""
    num_tokens, hc, _ = streams.shape
    mixes = linear(reference_rms_norm(streams.reshape(num_tokens, -1).float(), None, norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.reshape(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (sum_along(comb, -2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (sum_along(comb, -1, keepdim=True) + hc_eps)
        comb = comb / (sum_along(comb, -2, keepdim=True) + hc_eps)
    return _collapse(pre, streams), post, comb


def hc_post(block_out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Same contract as `reference.hc_post`, computed in float32 (the residual streams mixed one after
    another) and rounded once to the residual's dtype."""
    mixed = sum_along(comb.float()[..., None] * residual.float()[:, :, None, :], 1)       # [tokens, hc, dim]
    return (post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2) + mixed).to(residual.dtype)


def hc_head(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, hc_eps: float, norm_eps: float,
    linear: Linear = linear, rms_norm: RmsNorm = reference_rms_norm,
) -> Tensor:
    """Same contract as `reference.hc_head`; `linear` and `rms_norm` are the device's batch-invariant
    ones (on CUDA the registry passes its Triton kernels, leaving only elementwise work here)."""
    num_tokens = streams.shape[0]
    mixes = linear(rms_norm(streams.reshape(num_tokens, -1).float(), None, norm_eps), fn.float())
    pre = sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return _collapse(pre, streams)
