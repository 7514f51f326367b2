"""How many tokens of one sequence go into a prefill step (docs/design.md §3.2)."""

from __future__ import annotations

from bisect import bisect_right


def chunk_len(
    num_computed: int,
    num_remaining: int,
    budget: int,
    checkpoints: tuple[int, ...],
    step_is_empty: bool,
) -> int:
    """Tokens to prefill now for a sequence with `num_computed` tokens already cached.

    Everything remaining when it fits `budget`; otherwise a chunk cut at the last checkpoint in
    (num_computed, num_computed + budget] when checkpoints are configured, or at the budget when
    they are not (or when none fits and the step is otherwise empty, so the prompt still
    progresses). 0 means the sequence cannot go into this step.
    """
    if budget <= 0 or num_remaining <= 0:
        return 0
    if num_remaining <= budget:
        return num_remaining
    if not checkpoints:
        return budget
    index = bisect_right(checkpoints, num_computed + budget) - 1
    if index >= 0 and checkpoints[index] > num_computed:
        return checkpoints[index] - num_computed
    return budget if step_is_empty else 0
