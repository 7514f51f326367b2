"""Routing and experts whose rows do not depend on the batch.

The routed experts run per active expert as in the reference, but each expert's GEMMs go through
the tiled `linear` (the rows an expert gets vary with the batch), and each token's top-k results are
added in slot order. Router scores and SwiGLU use the position-independent `_pointwise` functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..reference.moe import SCORING_FUNCS, fp8_expert, mxfp4_expert, select_experts
from ._pointwise import sigmoid, silu, softplus, sum_along
from .linear import Linear, linear


def router_scores(logits: Tensor, scoring_func: str) -> Tensor:
    """Same contract as `reference.router_scores`."""
    logits = logits.float()
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(softplus(logits))
    if scoring_func == "sigmoid":
        return sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"scoring_func={scoring_func!r} must be one of {SCORING_FUNCS}")


def routing_weights(scores: Tensor, expert_ids: Tensor, *, normalize: bool, scaling: float) -> Tensor:
    """Same contract as `reference.routing_weights` (the renormalising sum taken slot after slot)."""
    weights = scores.gather(1, expert_ids)
    if normalize:
        weights = weights / (sum_along(weights, -1, keepdim=True) + 1e-20)
    return weights * scaling


def route(
    logits: Tensor, bias: Tensor | None, top_k: int, *, scoring_func: str, normalize: bool, scaling: float
) -> tuple[Tensor, Tensor]:
    """Same contract as `reference.route`."""
    scores = router_scores(logits, scoring_func)
    ids = select_experts(scores, bias, top_k)
    return ids, routing_weights(scores, ids, normalize=normalize, scaling=scaling)


def clamped_swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, limit: float, *, linear: Linear = linear) -> Tensor:
    """Same contract as `reference.clamped_swiglu`."""
    gate = linear(x, w1).clamp(max=limit)
    up = linear(x, w3).clamp(min=-limit, max=limit)
    return linear(silu(gate) * up, w2)


def moe_experts(x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """Same contract as `reference.moe_experts`."""
    return _active_experts(x, expert_ids, weights, lambda e: (w13[e], w2[e]), limit)


def moe_experts_fp8(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
    limit: float, block: int,
) -> Tensor:
    """Same contract as `reference.moe_experts_fp8`."""
    return _active_experts(x, expert_ids, weights, fp8_expert(w13, w13_scale, w2, w2_scale, block, x.dtype), limit)


def moe_experts_mxfp4(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
    limit: float, *, packed: bool = False,
) -> Tensor:
    """Same contract as `reference.moe_experts_mxfp4`."""
    expert = mxfp4_expert(w13, w13_scale, w2, w2_scale, x.dtype, packed=packed)
    return _active_experts(x, expert_ids, weights, expert, limit)


def _active_experts(x: Tensor, expert_ids: Tensor, weights: Tensor,
                    expert: Callable[[int], tuple[Tensor, Tensor]], limit: float) -> Tensor:
    """Each active expert's SwiGLU over its (token, slot) pairs, weighted, stored at the pair's slot;
    then every token's slots added in slot order."""
    num_tokens, top_k = expert_ids.shape
    pairs = x.new_zeros(num_tokens * top_k, x.shape[1])
    flat_ids = expert_ids.reshape(-1)
    flat_weights = weights.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        rows = (flat_ids == e).nonzero(as_tuple=True)[0]
        w13, w2 = expert(e)
        inter = w2.shape[-1]
        y = clamped_swiglu(x[rows // top_k], w13[:inter], w13[inter:], w2, limit)
        pairs[rows] = (y * flat_weights[rows, None].to(y.dtype)).to(pairs.dtype)
    return sum_along(pairs.view(num_tokens, top_k, -1), 1) if top_k else torch.zeros_like(x)
