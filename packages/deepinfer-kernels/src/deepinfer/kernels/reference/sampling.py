"""Token sampling from processed logits: temperature, top-k, top-p, min-p, then an exponential race."""

from __future__ import annotations

import torch
from torch import Tensor

# When every row has top_k <= this, top-k/top-p rank one torch.topk of the largest top_k, not a sort.
TOPK_INSTEAD_OF_SORT = 1024


def sample_race(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                noise: Tensor, num_candidates: int) -> Tensor:
    """One token per row, by an exponential race over the filtered tempered softmax.

    p = softmax(logits / temperature). Tokens rank by p descending, ties by ascending id. Keep the
    first top_k; of those, keep a token while the probability of the kept tokens ranked before it is
    < top_p * their total (so >= 1 token); then drop p < min_p * max(p). The token is the argmax of
    kept p / noise (ties -> lowest id), which picks token i with probability p_i / sum(kept p).

    Args:
        logits: [rows, vocab] float32, -inf where banned; every row has a finite entry.
        temperature: [rows] float32 > 0.
        top_k: [rows] int64 >= 1; >= vocab = off.
        top_p: [rows] float32 in (0, 1]; 1 = off.
        min_p: [rows] float32 in [0, 1); 0 = off.
        noise: [rows, vocab] float32 > 0, independent Exp(1) draws.
        num_candidates: how many of each row's most likely tokens the top-k / top-p cut must rank,
            known on the host when the batch is built (so nothing is read back from the device):
            0 when no row cuts (every top_k >= vocab and top_p = 1), else the largest top_k of all
            rows, at most vocab (so vocab when a row leaves top-k off). Up to 1024 the cut ranks one
            torch.topk of that many tokens, above it a full sort.

    Returns:
        [rows] int64 token ids.
    """
    check_num_candidates(logits, num_candidates)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    kept = _top_k_top_p(probs, top_k, top_p, num_candidates)
    floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return (kept.masked_fill(kept < floor, 0.0) / noise).argmax(dim=-1)


def check_num_candidates(logits: Tensor, num_candidates: int) -> None:
    """Refuse a `num_candidates` hint outside [0, vocab] (an empty batch takes any)."""
    if logits.shape[0] and not 0 <= num_candidates <= logits.shape[-1]:
        raise ValueError(f"num_candidates={num_candidates} must be in [0, vocab={logits.shape[-1]}]")


def _top_k_top_p(probs: Tensor, top_k: Tensor, top_p: Tensor, num_candidates: int) -> Tensor:
    """probs with the tokens outside each row's top-k / top-p prefix set to 0."""
    num_rows, vocab_size = probs.shape
    if num_rows == 0 or num_candidates == 0:
        return probs
    if num_candidates <= TOPK_INSTEAD_OF_SORT and num_candidates < vocab_size:
        cand_p, cand_ids = _topk_lowest_id_first(probs, num_candidates)
    else:
        cand_p, cand_ids = probs.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(cand_p.shape[1], device=probs.device)
    keep = positions[None, :] < top_k[:, None]
    kept_p = cand_p * keep
    cumulative = kept_p.cumsum(dim=-1)
    before = cumulative - kept_p   # probability of the more likely kept tokens; 0 at place 0
    keep &= (before < top_p[:, None] * cumulative[:, -1:]) | (top_p[:, None] >= 1)
    return torch.zeros_like(probs).scatter_(1, cand_ids, cand_p * keep)


def _topk_lowest_id_first(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """[rows, vocab] float32 >= 0 -> the k largest (values, ids), each [rows, k], descending; equal
    values rank by ascending id. torch.topk alone breaks ties arbitrarily, so rank unique int64 keys
    (the bit pattern of a non-negative float orders like its value) instead."""
    low_mask = 2**32 - 1
    keys = probs.view(torch.int32).to(torch.int64)
    keys.bitwise_left_shift_(32).add_(torch.arange(low_mask, low_mask - probs.shape[1], -1, device=probs.device))
    top_ids = low_mask - (keys.topk(k, dim=-1).values & low_mask)
    return probs.gather(1, top_ids), top_ids
