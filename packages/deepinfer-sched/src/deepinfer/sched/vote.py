"""Step-type vote over the DP group (docs/design.md §3.1): attempt points, the MIN all-reduce and the
second confirmation round.

Every `schedule()` call of every rank runs round one (one all-reduce of three ints, four with prefix
caching: the fourth says some rank has a prompt cut at a snapshot point, whose rest goes next), so the
collective sequence is identical on all ranks; round two runs exactly when round one chose
prefill, which every rank computes from the same reduced values. A group of one rank makes no
collective call at all: the minimum over one rank is its own values, so the decisions are the same.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .config import EngineType, SchedulerConfig

__all__ = ["AttemptPoint", "SingleRankVoteGroup", "StepVoteGroup", "VoteResult"]


@runtime_checkable
class StepVoteGroup(Protocol):
    """The DP group the step-type vote runs over (a gloo CPU group in deepinfer.engine)."""

    @property
    def world_size(self) -> int:
        """Ranks in the group, >= 1."""
        ...

    @property
    def rank(self) -> int:
        """This rank, in [0, world_size)."""
        ...

    def all_reduce_min(self, values: Sequence[int]) -> tuple[int, ...]:
        """Element-wise minimum of `values` over all ranks; every rank passes the same length.

        Blocks until every rank has called it. Returns a tuple of len(values) ints.
        """
        ...


class SingleRankVoteGroup:
    """The trivial group of a single-process run: the minimum over one rank is the input."""

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def all_reduce_min(self, values: Sequence[int]) -> tuple[int, ...]:
        return tuple(int(value) for value in values)


class AttemptPoint(enum.Enum):
    """Whether this decode step count lets prefill interrupt decoding, and under which rule."""

    NONE = "none"   # decode unless no rank has anything running
    ALL = "all"     # prefill if every rank wants it
    ANY = "any"     # prefill if any rank wants it


def attempt_point(config: SchedulerConfig, num_decode_steps: int) -> AttemptPoint:
    """ANY and ALL points fall on multiples of their intervals (counting decode steps; step 0 is
    both); ANY wins where they coincide. PROMPT engines are always at an ANY point."""
    if config.engine_type is EngineType.PROMPT:
        return AttemptPoint.ANY
    if num_decode_steps % config.prefill_any_attempt_interval == 0:
        return AttemptPoint.ANY
    if num_decode_steps % config.prefill_attempt_interval == 0:
        return AttemptPoint.ALL
    return AttemptPoint.NONE


@dataclass(frozen=True, slots=True)
class VoteResult:
    """Round one, reduced over the group."""

    any_wants: bool      # some rank wants prefill
    all_want: bool       # every rank wants prefill
    none_running: bool   # no rank has a running (or prompted) sequence
    urgent: bool = False  # some rank has a prompt cut at a prefix-cache snapshot point, rest pending

    def prefill_chosen(self, point: AttemptPoint) -> bool:
        """Prefill now? With nothing running anywhere, or the rest of a prompt cut at a snapshot point
        pending (it would otherwise wait for the next attempt point), any rank's wish suffices."""
        if not self.any_wants:
            return False
        if self.none_running or self.urgent or point is AttemptPoint.ANY:
            return True
        return point is AttemptPoint.ALL and self.all_want


def _reduce(group: StepVoteGroup, values: tuple[int, ...]) -> tuple[int, ...]:
    reduced = tuple(group.all_reduce_min(values))
    if len(reduced) != len(values):
        raise RuntimeError(f"all_reduce_min returned {len(reduced)} values for {len(values)} inputs")
    return reduced


def cast_vote(group: StepVoteGroup, wants_prefill: bool, has_running: bool, urgent: bool | None = None) -> VoteResult:
    """Round one: MIN over (not wants, wants, not running[, not urgent]) tells any/all/none[/urgent].
    `urgent` is None without prefix caching (three ints), else a bool on every rank (four)."""
    if group.world_size == 1:
        return VoteResult(any_wants=wants_prefill, all_want=wants_prefill, none_running=not has_running,
                          urgent=bool(urgent))
    values: tuple[int, ...] = (0 if wants_prefill else 1, 1 if wants_prefill else 0, 0 if has_running else 1)
    if urgent is not None:
        values += (0 if urgent else 1,)
    reduced = _reduce(group, values)
    return VoteResult(any_wants=reduced[0] == 0, all_want=reduced[1] == 1, none_running=reduced[2] == 1,
                      urgent=urgent is not None and reduced[3] == 0)


def confirm_prefill(group: StepVoteGroup, scheduled_prefill: bool) -> bool:
    """Round two: True if at least one rank actually scheduled a prefill chunk."""
    if group.world_size == 1:
        return scheduled_prefill
    (not_scheduled,) = _reduce(group, (0 if scheduled_prefill else 1,))
    return not_scheduled == 0
