"""Manifold-constrained hyper-connections (mHC): collapse, Sinkhorn mixing and expansion."""

from __future__ import annotations

import torch
from torch import Tensor

from .norm import rms_norm


def hc_pre(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Compute the mixing weights of one mHC site and collapse the streams.

    Args:
        streams: [num_tokens, hc, dim] residual streams.
        fn: [(2 + hc) * hc, hc * dim] float32 projection; scale: [3]; base: [(2 + hc) * hc].
    Returns:
        (collapsed [num_tokens, dim] in streams' dtype, post [num_tokens, hc] float32,
        comb [num_tokens, hc, hc] float32, doubly stochastic after Sinkhorn; the residual mix is
        `out[k] = Σ_j comb[j, k] · streams[j]`).
    """
    num_tokens, hc, _ = streams.shape
    mixes = rms_norm(streams.reshape(num_tokens, -1).float(), None, norm_eps) @ fn.float().t()
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def hc_post(block_out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Expand a block output back to hc streams and add the Sinkhorn-mixed residual.

    Args:
        block_out: [num_tokens, dim]; residual: [num_tokens, hc, dim];
        post: [num_tokens, hc]; comb: [num_tokens, hc, hc] (from `hc_pre`).
    Returns:
        [num_tokens, hc, dim] = post[k]·block_out + Σ_j comb[j, k]·residual[j].
    """
    dtype = residual.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), residual)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


def hc_head(streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, hc_eps: float, norm_eps: float) -> Tensor:
    """Final learned collapse of the hc streams (no Sinkhorn).

    Args:
        streams: [num_tokens, hc, dim]; fn: [hc, hc * dim] float32; scale: [1]; base: [hc].
    Returns:
        [num_tokens, dim] in streams' dtype.
    """
    num_tokens = streams.shape[0]
    mixes = rms_norm(streams.reshape(num_tokens, -1).float(), None, norm_eps) @ fn.float().t()
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
