"""The Step protocol: how `LLMEngine` runs one scheduled step, and the queue of launched steps.

A step implementation turns a `SchedulerOutput` into device work and, later, its results into
tokens on the requests. The engine's loop (`LLMEngine.step`, docs/design.md §2) drives it in four
phases:

    handle = step.launch(out, guarded=...)   (1) the forward of step N is queued on the device
    queue.commit_older(...)                  (2) the steps launched before N are committed: their
                                                 tokens reach the requests, grammars and scheduler
    step.sample(handle)                      (3) N's sampling / verification is queued; it reads the
                                                 grammars, which (2) brought up to date
    engine._pump_grammars()                  (4) pre_sampler_sync: host work beside the device's
    queue.push(handle) / step.commit(handle)     N is committed now, or stays in flight

Implementations: `plain_step.PlainStep` (prefill steps, and decode steps of one token per row) and
`spec_step.SpeculativeDecoder` (decode steps with DSpark drafts verified in one forward). A
prefill-only engine (EngineType.PROMPT) runs `PlainStep` and hands the prefilled requests over
at its commit; a future prefill-only or disaggregated step plugs in as a third implementation.

Overlap (ZOS, docs/design.md §6) is the depth of `InFlightQueue`: with depth 1 a decode step's handle
stays in the queue when `step()` returns, and is committed by the next `step()` in phase (2), after
the next forward is queued; with depth 0 every handle is committed in the `step()` that launched
it. A handle launched to stay in flight is launched `guarded` (under `forbid_cuda_sync`): nothing in
its launch may wait for the device. Nothing else about ZOS is threaded through the phases.

While a handle is in flight the scheduler may preempt its rows (`mark_preempted`): a row preempted
for recompute drops its token at the commit (the recompute samples it again); a row preempted for
good keeps it, then finishes as "preempted".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from deepinfer.sched import SchedulerOutput, StepKind

from .request import ParallelRequest, Request

Changed = dict[str, Request | ParallelRequest]     # request id -> what is reported for it


@dataclass(slots=True, eq=False)
class Launched:
    """What every launched step keeps until its commit (implementations add their device work).

    Attributes:
        out: the scheduler's output for the step.
        reqs: the request of each row, in row order (objects, not ids: an id may be reused by a new
            request before the step is committed); filled by `launch` or `sample`.
        recomputed: ids of rows preempted for recompute since the step was launched (token dropped).
        preempted: ids of rows preempted for good since the step was launched (the scheduler has
            freed them): their token still counts, then the request finishes as "preempted".
    """

    out: SchedulerOutput
    reqs: list[Request] = field(default_factory=list)
    recomputed: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)

    @property
    def rows_generation(self) -> int | None:
        """The scheduler's decode-rows generation of the step (`DecodeBatch.rows_generation`); None
        for a step without decode rows."""
        decode = self.out.decode
        return None if decode is None else decode.rows_generation


HandleT = TypeVar("HandleT", bound=Launched)   # the handle type of one `Step` implementation


class Step(Protocol[HandleT]):
    """One kind of engine step (module docstring): launch the forward, launch the sampling, commit."""

    def launch(self, out: SchedulerOutput, *, guarded: bool) -> HandleT | None:
        """Queue step `out`'s forward on the device (None: nothing to run). `guarded`: the handle
        may stay in flight, so the launch must not wait for the device."""

    def sample(self, handle: HandleT) -> None:
        """Queue the step's sampling (or verification) and start copying its results to the host;
        every step launched before it has been committed."""

    def commit(self, handle: HandleT, *, rows_unchanged: bool = False) -> Changed:
        """Read the step's results (waiting only for their copy) and hand its tokens to the requests
        and the scheduler; returns the requests to report. `rows_unchanged`: the caller knows that
        no request of the step has ended since it was launched."""


@dataclass(slots=True, eq=False)
class _Entry:
    step: Step[Any]
    handle: Launched              # of `step`'s handle type (`InFlightQueue.push`)


class InFlightQueue:
    """The launched steps not committed yet, oldest first; at most `depth` stay between two
    `LLMEngine.step()` calls (0: ZOS off, 1: ZOS on)."""

    def __init__(self, depth: int) -> None:
        if depth not in (0, 1):
            raise ValueError(f"depth={depth} must be 0 (ZOS off) or 1 (ZOS on)")
        self.depth = depth
        self._entries: deque[_Entry] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def handles(self) -> Iterator[Launched]:
        """The handles in flight, oldest first."""
        return (entry.handle for entry in self._entries)

    def keeps(self, out: SchedulerOutput) -> bool:
        """Whether the handle of step `out` may stay in flight after its `step()` (ZOS decode steps)."""
        return self.depth > 0 and out.kind is StepKind.DECODE

    def push(self, step: Step[HandleT], handle: HandleT) -> None:
        self._entries.append(_Entry(step, handle))

    def commit_down_to(self, size: int, changed: Changed, *, generation: int | None = None) -> None:
        """Commit the oldest handles until at most `size` are left. `generation`: the decode-rows
        generation of the step launched last: a handle of the same one has had no row change since
        (every end drops its sequence from the scheduler's rows), so none of its requests ended."""
        entries = self._entries
        while len(entries) > size:
            entry = entries.popleft()
            unchanged = generation is not None and entry.handle.rows_generation == generation
            changed.update(entry.step.commit(entry.handle, rows_unchanged=unchanged))

    def mark_preempted(self, out: SchedulerOutput, on_idle: Callable[[str], None]) -> None:
        """Record the rows `out` preempted on the handles in flight that hold them; `on_idle` gets the
        preempted-for-good ids that no handle holds (finished at once)."""
        if not out.preempted_seq_ids:
            return
        recomputed = set(out.recomputed_seq_ids)
        held: dict[str, Launched] = {r.seq_id: e.handle for e in self._entries for r in e.handle.reqs}
        for seq_id in out.preempted_seq_ids:
            handle = held.get(seq_id)
            if handle is not None:
                (handle.recomputed if seq_id in recomputed else handle.preempted).add(seq_id)
            elif seq_id not in recomputed:
                on_idle(seq_id)

    def clear(self) -> list[Launched]:
        """Drop every handle (its rows are failed or gone); returns them, oldest first."""
        handles = [entry.handle for entry in self._entries]
        self._entries.clear()
        return handles


__all__ = ["Changed", "HandleT", "InFlightQueue", "Launched", "Step"]
