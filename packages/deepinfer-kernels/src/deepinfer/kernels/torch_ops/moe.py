"""Routed experts through two grouped GEMMs (`torch.nn.functional.grouped_mm`) over the active
experts only, with static shapes: the twin of `reference.moe_experts`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import reference


def moe_experts_grouped(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float
) -> Tensor:
    """Same contract as `deepinfer.kernels.reference.moe_experts`.

    The (token, expert) pairs are sorted by expert (stable), each expert's rows form one group of
    the grouped GEMMs, and each token's top-k results are summed in slot order (deterministic,
    no atomics). No `.item()`, no data-dependent shapes: capturable in a CUDA graph. CUDA's grouped
    GEMM takes bfloat16 only: other dtypes on CUDA run the reference (not graph-safe).

    Args:
        x: [num_tokens, hidden]; expert_ids, weights: [num_tokens, top_k];
        w13: [num_experts, 2 * inter, hidden]; w2: [num_experts, hidden, inter].
    Returns:
        [num_tokens, hidden] in x's dtype.
    """
    if x.is_cuda and x.dtype != torch.bfloat16:
        return reference.moe_experts(x, expert_ids, weights, w13, w2, limit)
    num_tokens, top_k = expert_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[-1]
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[order // top_k]
    h = F.grouped_mm(rows, w13.to(x.dtype).transpose(1, 2), offs=offs)
    act = F.silu(h[:, :inter].clamp(max=limit)) * h[:, inter:].clamp(min=-limit, max=limit)
    y = F.grouped_mm(act, w2.to(x.dtype).transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
