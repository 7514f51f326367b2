"""The V4.1 two-level indexer's selection (reference/deepseek-v4-spec.md §2.9.4).

Level one (the candidate source layer): compressed positions form blocks of `block_size`; a block
scores the max of its positions; the block holding each query's newest visible position is always
kept; the `topk_blocks` best blocks are the candidates. Level two (every later index source): the
scores outside the candidates are −inf before the top-k. Ties go to the lowest index at both levels,
so the choice never depends on the call shape (prefill vs decode).
"""

from __future__ import annotations

import torch
from torch import Tensor


def candidate_blocks(scores: Tensor, num_visible: Tensor, topk_blocks: int, block_size: int) -> Tensor:
    """Candidate mask of the first level.

    Args:
        scores: [num_queries, num_keys] float32, −inf where a key is not visible.
        num_visible: [num_queries] int64 visible keys per query.
    Returns:
        [num_queries, num_keys] bool: the key lies in a kept block (a block whose score is −inf is
        never kept, even when it is among the `topk_blocks` best).
    """
    num_queries, num_keys = scores.shape
    num_blocks = -(-num_keys // block_size)
    padded = scores.float().new_full((num_queries, num_blocks * block_size), float("-inf"))
    padded[:, :num_keys] = scores.float()
    block_scores = padded.view(num_queries, num_blocks, block_size).amax(-1)
    newest = torch.div(num_visible - 1, block_size, rounding_mode="floor")
    block_ids = torch.arange(num_blocks, device=scores.device)
    block_scores = block_scores.masked_fill(block_ids[None, :] == newest[:, None], float("inf"))
    width = min(topk_blocks, num_blocks)
    order = torch.sort(block_scores, dim=1, descending=True, stable=True)
    keep_sorted = order.values[:, :width] > float("-inf")
    keep = torch.zeros(num_queries, num_blocks, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, order.indices[:, :width], keep_sorted)
    return keep.repeat_interleave(block_size, dim=1)[:, :num_keys]


def topk_finite(scores: Tensor, k: int) -> Tensor:
    """The k best keys per row among those scoring above −inf, ties to the lowest index.

    Args:
        scores: [num_queries, num_keys] float32 (−inf = not selectable).
    Returns:
        [num_queries, min(k, num_keys)] int64 key ids in descending score order, −1 where fewer
        than k keys are selectable.
    """
    width = min(k, scores.shape[1])
    order = torch.sort(scores.float(), dim=1, descending=True, stable=True)
    picks = order.indices[:, :width]
    return torch.where(order.values[:, :width] > float("-inf"), picks, torch.full_like(picks, -1))
