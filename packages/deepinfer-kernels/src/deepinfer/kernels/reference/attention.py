"""Sparse single-latent attention with a per-head sink, and the grouped output projection."""

from __future__ import annotations

import torch
from torch import Tensor


def sparse_attention(q: Tensor, kv: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Attention of each query over its own gathered key rows (K = V), with an attention sink.

    `out = Σ_j e^{s_j − m} v_j / (Σ_j e^{s_j − m} + e^{sink_h − m})` with `s_j = scale · q·k_j`
    over valid rows only; the sink only enlarges the denominator. A query with no valid row
    returns 0.

    Args:
        q: [num_queries, num_heads, head_dim].
        kv: [num_queries, num_rows, head_dim] gathered rows (window ∪ selected compressed).
        valid: [num_queries, num_rows] bool; invalid rows (padding, −1 picks) are ignored.
        sink: [num_heads] float32 per-head sink logits.
        scale: softmax scale, head_dim^-0.5 for V4.
    Returns:
        [num_queries, num_heads, head_dim] in q's dtype.
    """
    logits = torch.einsum("qhd,qkd->qhk", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sinks = sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    combined = torch.cat((logits, sinks), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("qhk,qkd->qhd", probs, kv.float()).to(q.dtype)


def grouped_linear(x: Tensor, weight: Tensor) -> Tensor:
    """Block-diagonal projection: group g of x goes through its own slice of weight.

    Args:
        x: [num_tokens, groups, in_per_group].
        weight: [groups * out_per_group, in_per_group] (the checkpoint's `wo_a` layout).
    Returns:
        [num_tokens, groups, out_per_group].
    """
    groups = x.shape[1]
    w = weight.view(groups, -1, x.shape[-1])
    return torch.einsum("tgi,goi->tgo", x, w.to(x.dtype))
