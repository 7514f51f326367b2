"""The one loop that steps an engine, whichever front drives it.

Every front runs `run_loop` with its own `Transport`, which says where requests come from, when to
step and where the outputs go:

    while True:
        transport.poll()                       take what arrived (new requests, aborts), no waiting
        if transport.has_work():               this engine has work (DP ranks: any rank has, the vote)
            transport.deliver(step())          one engine step; its outputs to the callers
        elif not transport.idle():             nothing to step: wait for more, or end the loop
            return

The transports: `LLM.generate` (offline: the outputs of one call's requests, until all are in),
`AsyncLLM` (a thread of the caller's process: an inbox under a lock, asyncio streams), the engine
process of `deepinfer serve` (`engine_process.EngineLoop`: pipes), `parallel.DPRank.generate`
(lockstep DP ranks over a gloo vote) and the serving DP rank (`parallel.serve_rank.RankServer`:
queues, a vote that also counts the messages taken). `step` is `LLMEngine.step`, or
`parallel.DPRank.step` on a DP rank (a dummy expert-parallel forward when the vote left it without
work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..core.outputs import RequestOutput


class Transport(Protocol):
    """Where a front's requests come from and its outputs go (module docstring)."""

    def poll(self) -> None:
        """Take what has arrived (new requests, aborts) into the engine, without blocking."""

    def has_work(self) -> bool:
        """Whether to step now."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand one step's outputs on."""

    def idle(self) -> bool:
        """No work: block until something may have arrived (True), or end the loop (False)."""


def run_loop(step: Callable[[], list[RequestOutput]], transport: Transport) -> None:
    """Step while `transport` has work, until it ends the loop (module docstring)."""
    while True:
        transport.poll()
        if transport.has_work():
            transport.deliver(step())
        elif not transport.idle():
            return


__all__ = ["Transport", "run_loop"]
