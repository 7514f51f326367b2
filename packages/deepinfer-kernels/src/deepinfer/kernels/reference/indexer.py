"""Lightning-indexer scoring and the deterministic top-k selection."""

from __future__ import annotations

import torch
from torch import Tensor


def indexer_scores(q: Tensor, keys: Tensor, head_weights: Tensor, softmax_scale: float) -> Tensor:
    """score[i, t] = Σ_h head_weights[i, h] · ReLU(q[i, h] · keys[t]) · softmax_scale.

    Args:
        q: [num_queries, num_heads, index_dim]; keys: [num_keys, index_dim] shared by every query,
            or [num_queries, num_keys, index_dim] per query (batched decode);
        head_weights: [num_queries, num_heads] (already scaled by num_heads^-0.5).
    Returns:
        [num_queries, num_keys] float32.
    """
    pattern = "qhd,td->qht" if keys.dim() == 2 else "qhd,qtd->qht"
    dots = torch.einsum(pattern, q.float(), keys.float())
    return (torch.relu(dots) * softmax_scale * head_weights.float().unsqueeze(-1)).sum(dim=1)


def topk_lowest_index(scores: Tensor, num_visible: Tensor, k: int) -> Tensor:
    """Top-k over the visible prefix of each row, ties broken by the lowest index.

    Row i may only pick among keys 0 .. num_visible[i] − 1. It keeps min(k, num_visible[i])
    of them; unused picks are −1. Among equal scores the lower key index wins (a stable
    descending sort), so the choice never depends on the call shape (prefill vs decode).

    Args:
        scores: [num_queries, num_keys] float32.
        num_visible: [num_queries] int64.
        k: picks per row (≥ 1).
    Returns:
        [num_queries, min(k, num_keys)] int64 key indices, −1 where nothing is picked.
    """
    num_keys = scores.shape[1]
    width = min(k, num_keys)
    if width == 0:
        return scores.new_empty((scores.shape[0], 0), dtype=torch.int64)
    visible = torch.arange(num_keys, device=scores.device)[None, :] < num_visible[:, None]
    masked = scores.float().masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :width]
    keep = torch.arange(width, device=scores.device)[None, :] < num_visible[:, None].clamp(max=width)
    return torch.where(keep, order, torch.full_like(order, -1))
