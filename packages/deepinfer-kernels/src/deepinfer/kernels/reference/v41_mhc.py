"""Single-pass mHC of DeepSeek-V4.1 (reference/deepseek-v4-spec.md §2.9.1).

Each site computes (pre, post, comb) from its own input exactly as V4's `hc_pre`, but the streams
are collapsed with the `pre` of the site before (attention with the previous layer's FFN pre, the
FFN with this layer's attention pre; the first site with stream 0 alone). All in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .norm import rms_norm


def hc_mixes(streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, sinkhorn_iters: int, hc_eps: float,
             norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(pre [t, hc], post [t, hc], comb [t, hc, hc]) float32 of one site, from streams [t, hc, dim]."""
    num_tokens, hc, _ = streams.shape
    mixes = rms_norm(streams.reshape(num_tokens, -1).float(), None, norm_eps) @ fn.float().t()
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: Tensor, pre: Tensor) -> Tensor:
    """Σ_j pre[:, j] · streams[:, j] in float32, returned in streams' dtype ([t, dim])."""
    return (pre.float().unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


def hc_expand(block_out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """out[k] = post[k]·block_out + Σ_j comb[j, k]·residual[j], in float32, returned in residual's dtype."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.float(), residual.float())
    return (post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2) + mixed).to(residual.dtype)
