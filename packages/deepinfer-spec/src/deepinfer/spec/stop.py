"""Cutting an accepted run at a stop token or the token budget (a pure host function)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True, slots=True)
class AcceptedRun:
    """The tokens of one verify step a request keeps, and why it finished (None = still running)."""

    token_ids: tuple[int, ...]
    finish_reason: str | None          # FINISH_STOP, FINISH_LENGTH or None
    stop_token_id: int | None = None   # the stop / EOS token that ended it (kept as the last token)


def cut_accepted_run(token_ids: Sequence[int], *, num_output_tokens: int, max_tokens: int,
                     stop_token_ids: Collection[int] = (), eos_token_id: int | None = None,
                     ignore_eos: bool = False, min_tokens: int = 0) -> AcceptedRun:
    """Keep a verify step's output tokens up to the first stop token or the max_tokens budget.

    Args:
        token_ids: the accepted drafts and the bonus token, in order.
        num_output_tokens: tokens the request had generated before this step.
        max_tokens: the request's budget of generated tokens (>= 1).
        stop_token_ids: ids that end the request (kept as its last token).
        eos_token_id: the model's EOS; ends the request unless ignore_eos.
        min_tokens: a stop token only stops once the request has this many generated tokens (itself included).
    Returns:
        the kept prefix; a stop token that ends it is the last kept token.
    Raises:
        ValueError: max_tokens < 1 or num_output_tokens < 0.
    """
    if max_tokens < 1 or num_output_tokens < 0:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1 and num_output_tokens={num_output_tokens} >= 0")
    stops = set(stop_token_ids)
    if eos_token_id is not None and not ignore_eos:
        stops.add(eos_token_id)
    kept: list[int] = []
    for token in token_ids:
        if num_output_tokens + len(kept) >= max_tokens:
            return AcceptedRun(tuple(kept), FINISH_LENGTH)
        kept.append(int(token))
        if token in stops and num_output_tokens + len(kept) >= min_tokens:
            return AcceptedRun(tuple(kept), FINISH_STOP, int(token))
    if num_output_tokens + len(kept) >= max_tokens:
        return AcceptedRun(tuple(kept), FINISH_LENGTH)
    return AcceptedRun(tuple(kept), None)
