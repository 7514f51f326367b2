"""One DP rank serving online requests: the process `dp_async.DPAsyncLLM` spawns per rank.

The loop (`core_loop.run_loop`, `RankServer` its transport), on every rank:

    take what the inbox holds (new requests into the engine, aborts applied)
    vote (one MIN all-reduce over the gloo group): does any rank have work? how many counted
        messages has the slowest / the fastest rank taken?
    some rank has work          -> step (a dummy EP forward when this rank has none), report
    a rank is behind the others -> wait until this rank has taken as many, vote again
    no work, nothing new        -> Stop taken: exit; else block on the inbox for the next counted message

Every request reaches every rank as one counted message (`messages.Submit` or `Wake`), so an idle
rank learns that a peer got work from its own inbox and sleeps until then (no polling). Comparing
counts in the vote keeps the ranks from splitting: a rank that took a `Submit` after its own vote
is caught up by the next vote, never left waiting in a collective while its peer sleeps on its inbox.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import traceback
from typing import Any

import torch

from ..config.engine_args import EngineArgs
from ..core.outputs import OutputKind, RequestOutput
from ..frontends.core_loop import run_loop
from ..frontends.engine_process import picklable_error
from .messages import (
    Abort,
    FrontMessage,
    RankError,
    RankLoad,
    RankReady,
    RankReport,
    Refusal,
    Stop,
    Submit,
)
from .rank import DPRank, RankFailure, RankSpec


def serve_rank_main(spec: RankSpec, args: EngineArgs, inbox: Any, outbox: Any) -> None:
    """The entry point of a serving rank: build the rank, report `RankReady`, run `RankServer` until
    `Stop`. An error goes to `outbox` as `RankError` and exits the process with status 1. SIGINT is
    the front's to handle (a Ctrl-C reaches the whole process group); the host's cores are shared out
    among the ranks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    try:
        rank = DPRank(args, spec)
        outbox.put(RankReady(spec.rank, rank.engine.max_model_len))
        RankServer(rank, inbox, outbox).run()
        rank.close()
    except BaseException as err:        # reported to the front, then the process exits
        detail = "".join(traceback.format_exception_only(type(err), err)).strip()
        outbox.put(RankError(spec.rank, detail))
        raise SystemExit(1) from None


class RankServer:
    """The serving loop of one rank (module docstring).

    Args:
        rank: this process's rank, its engine built.
        inbox: the front's messages to this rank (`messages.FrontMessage`).
        outbox: this rank's reports to the front (`messages.RankMessage`).
    """

    def __init__(self, rank: DPRank, inbox: Any, outbox: Any) -> None:
        self._rank = rank
        self._engine = rank.engine
        self._inbox = inbox
        self._outbox = outbox
        self._num_taken = 0                       # counted messages taken
        self._stopping = False
        self._refusals: list[Refusal] = []
        self._prompt_sent: set[str] = set()
        self._prompt_logprobs_sent: set[str] = set()
        self._num_rebalances_sent = 0
        self._fewest = self._most = 0             # counted messages taken by the slowest / fastest rank

    def run(self) -> None:
        """Serve until `Stop` (returns) or a failure (raises; `RankFailure` when a peer stopped answering)."""
        run_loop(self._step, self)

    # ------------------------------------------------------------------ core_loop.Transport

    def poll(self) -> None:
        self._take_waiting()

    def has_work(self) -> bool:
        """The vote (module docstring): whether any rank has work; also how many counted messages
        the slowest and the fastest rank have taken (for `idle`)."""
        try:
            no_work, self._fewest, most = self._rank.vote_group.all_reduce_min(
                [int(not self._engine.has_unfinished_requests()), self._num_taken, -self._num_taken])
        except RuntimeError as err:
            raise RankFailure(f"DP rank {self._rank.spec.rank}: a peer rank died or did not answer: {err}") from err
        self._most = -most
        return not no_work

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self._report(outputs)

    def idle(self) -> bool:
        """No rank has work: catch up with the fastest rank's messages, else end after `Stop`, else
        block on the inbox for the next counted message."""
        if self._fewest < self._most:
            self._wait_until(self._most)
        elif self._stopping:
            return False
        else:
            self._wait_until(self._most + 1)
        return True

    def _step(self) -> list[RequestOutput]:
        try:
            return self._rank.step()
        except RuntimeError as err:
            raise RankFailure(f"DP rank {self._rank.spec.rank}: a step failed (a peer died or did not answer?): "
                              f"{err}") from err

    def _take_waiting(self) -> None:
        """Take every message already in the inbox, without blocking."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._take(message)
        self._report_refusals()

    def _wait_until(self, num_taken: int) -> None:
        """Block on the inbox until `num_taken` counted messages are taken (aborts applied meanwhile)."""
        while self._num_taken < num_taken:
            self._take(self._inbox.get())
        self._report_refusals()

    def _take(self, message: FrontMessage) -> None:
        if isinstance(message, Abort):
            self._engine.abort_request(message.request_id)
            return
        self._num_taken += 1
        assert message.seq == self._num_taken, f"counted message {message.seq} arrived as number {self._num_taken}"
        if isinstance(message, Stop):
            self._stopping = True
        elif isinstance(message, Submit):
            try:
                self._engine.add_request(message.request_id, message.prompt, message.params,
                                         output_kind=OutputKind.DELTA)
            except Exception as err:     # refused: nothing was queued; the caller gets the error
                self._refusals.append(Refusal(message.request_id, picklable_error(err)))

    def _report_refusals(self) -> None:
        if self._refusals:
            self._report([])

    def _report(self, outputs: list[RequestOutput]) -> None:
        engine = self._engine
        kv = engine.kv_blocks
        load = RankLoad(engine.scheduler.num_running, kv.num_free, kv.num_blocks - 1)
        rebalances = self._rank.rebalances[self._num_rebalances_sent:] if self._rank.spec.rank == 0 else ()
        self._num_rebalances_sent += len(rebalances)
        refusals, self._refusals = tuple(self._refusals), []
        self._outbox.put(RankReport(self._rank.spec.rank, tuple(map(self._slim, outputs)), refusals, load,
                                    rebalances))

    def _slim(self, out: RequestOutput) -> RequestOutput:
        """`out` without what the front already has: the prompt after the first output, the prompt
        logprobs after they were sent filled."""
        request_id = out.request_id
        if out.prompt_logprobs:
            if request_id in self._prompt_logprobs_sent:
                out = dataclasses.replace(out, prompt_logprobs=None)
            else:
                self._prompt_logprobs_sent.add(request_id)
        if request_id in self._prompt_sent:
            out = dataclasses.replace(out, prompt=None, prompt_token_ids=[])
        else:
            self._prompt_sent.add(request_id)
        if out.finished:
            self._prompt_sent.discard(request_id)
            self._prompt_logprobs_sent.discard(request_id)
        return out
