"""Greedy verification in the verify forward's own token order, with static shapes.

`verify` takes target logits packed one row per request ([num_seqs, k + 1, vocab], gathered from the
forward's [total_q, vocab]); a CUDA graph keyed by the forward's total query tokens cannot hold that
gather for every split into rows without a buffer of rows × (k + 1) × vocab. `greedy_verify_flat`
reads the forward's logits where they are: one argmax and one log-sum-exp per fed token, then
integer work on a [rows + 1, k + 1] grid (the extra row takes the padding tokens). Its outputs are
`greedy_verify`'s for the same rows (tested against it), so the engine can verify greedy rows inside
the graph of the verify forward and the others outside it, and get the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class FlatVerifyResult:
    """Per row (num_rows of them): what `VerifyResult` holds for a greedy row, and whether its logits are usable."""

    output_ids: Tensor      # [num_rows, k + 1] int64: accepted drafts, the target's token, then -1
    num_accepted: Tensor    # [num_rows] int64
    finite: Tensor          # [num_rows] bool: every fed token's log-sum-exp is within ±max_magnitude


def greedy_verify_flat(logits: Tensor, fed_ids: Tensor, token_rows: Tensor, columns: Tensor, num_rows: int,
                       k: int, max_magnitude: float) -> FlatVerifyResult:
    """Accept each row's drafts while they equal the target's argmax, from the verify forward's logits.

    Args:
        logits: [T, vocab] float32 target logits of every fed token, in the forward's order.
        fed_ids: [T] int64 the fed tokens: row i's column 0 is its anchor, column c its draft c − 1.
        token_rows: [T] int64 the row of each token in [0, num_rows]; num_rows marks a padding token.
        columns: [T] int64 the column of each token in [0, k]; a row's columns are 0 … q − 1 (q ≥ 1),
            its drafts 1 … q − 1 are verified.
        num_rows: rows (a host int: the static shape).
        k: drafts per row at most.
        max_magnitude: a row whose token's log-sum-exp is beyond it (or NaN) is not finite.
    Returns:
        `FlatVerifyResult`; rows without a token (padding rows of a static shape) accept nothing.
    """
    width = k + 1
    cells = (num_rows + 1) * width
    device = logits.device
    flat = token_rows * width + columns
    best = logits.argmax(dim=-1)
    ok = logits.logsumexp(dim=-1).abs() <= max_magnitude
    fed = torch.full((cells,), -1, dtype=torch.int64, device=device).index_put_((flat,), fed_ids).view(-1, width)
    target = torch.full((cells,), -1, dtype=torch.int64, device=device).index_put_((flat,), best).view(-1, width)
    usable = torch.ones(cells, dtype=torch.bool, device=device).index_put_((flat,), ok).view(-1, width)
    drafts = fed[:num_rows, 1:]
    accept = (drafts >= 0) & (drafts == target[:num_rows, :k])
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    final = target[:num_rows].gather(1, num_accepted[:, None])
    steps = torch.arange(width, device=device)[None, :]
    shifted = torch.cat((drafts, drafts[:, :1]), dim=1)          # column j: draft j (the last is never used)
    out = torch.where(steps < num_accepted[:, None], shifted, torch.where(steps == num_accepted[:, None], final, -1))
    return FlatVerifyResult(out, num_accepted, usable[:num_rows].all(dim=1))
