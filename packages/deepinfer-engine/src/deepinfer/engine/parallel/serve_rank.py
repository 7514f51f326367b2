"""One DP rank serving online requests: the process `dp_async.DPAsyncLLM` spawns per rank.

The loop (`core_loop.run_loop`, `RankServer` its transport), on every rank:

    take what the inbox holds (new requests into the engine, aborts applied)
    vote (one MIN all-reduce over the gloo group): does any rank have work? how many counted
        messages has the slowest / the fastest rank taken?
    some rank has work          -> step (a dummy EP forward when this rank has none), report
    a rank is behind the others -> wait until this rank has taken as many, vote again
    no work, nothing new        -> Stop taken: exit; else block on the inbox for the next counted message

Every request reaches every rank as one counted message (`messages.Submit` or `Wake`), so an idle
rank learns that a peer got work from its own inbox and sleeps until then (waking only every
`SIGNAL_CHECK_S` to see whether a SIGTERM came). Comparing counts in the vote keeps the ranks from
splitting: a rank that took a `Submit` after its own vote is caught up by the next vote, never left
waiting in a collective while its peer sleeps on its inbox.

SIGTERM (a service manager may signal every process of the server, or one rank) is handled as the
engine process of one engine handles it: the rank refuses the requests that reach it afterwards
(`EngineStopped`) and tells the front (`RankStopping`), which takes no more requests and sends `Stop`
to every rank; the ranks finish the requests they hold and exit 0 together. A rank never leaves its
peers on its own (they would wait for it in the vote).
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
from ..core.prefix_caching import host_cache_stats
from ..frontends.async_front import EngineStopped
from ..frontends.core_loop import run_loop
from ..frontends.engine_process import picklable_error
from .messages import (
    Abort,
    FrontMessage,
    RankError,
    RankLoad,
    RankReady,
    RankReport,
    RankStopping,
    Refusal,
    Stop,
    Submit,
)
from .rank import DPRank, RankFailure, RankSpec

SIGNAL_CHECK_S = 0.2       # an idle rank wakes this often to see whether a SIGTERM came


def serve_rank_main(spec: RankSpec, args: EngineArgs, inbox: Any, outbox: Any) -> None:
    """The entry point of a serving rank: build the rank, report `RankReady`, run `RankServer` until
    `Stop`. An error goes to `outbox` as `RankError` and exits the process with status 1. SIGINT is
    the front's to handle (a Ctrl-C reaches the whole process group); SIGTERM stops every rank once
    their requests have finished (module docstring); the host's cores are shared out among the ranks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    try:
        rank = DPRank(args, spec)
        server = RankServer(rank, inbox, outbox)
        signal.signal(signal.SIGTERM, server.on_sigterm)
        outbox.put(RankReady(spec.rank, rank.engine.max_model_len))
        server.run()
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
        self._stopping = False                    # Stop taken
        self._signalled = False                   # SIGTERM came
        self._said_stopping = False               # RankStopping sent
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
        self._tell_if_signalled()

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

    def on_sigterm(self, signum: int, frame: object) -> None:
        """SIGTERM: refuse new requests and ask the front to stop every rank (at the next `poll`, or
        within SIGNAL_CHECK_S when idle). Nothing is sent from here: the handler may run in the
        middle of a put."""
        self._signalled = True

    def _tell_if_signalled(self) -> None:
        if self._signalled and not self._said_stopping:
            self._said_stopping = True
            self._outbox.put(RankStopping(self._rank.spec.rank))

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
        """Block on the inbox until `num_taken` counted messages are taken (aborts applied meanwhile),
        waking every SIGNAL_CHECK_S to tell the front of a SIGTERM."""
        while self._num_taken < num_taken:
            try:
                message = self._inbox.get(timeout=SIGNAL_CHECK_S)
            except queue.Empty:
                self._tell_if_signalled()
                continue
            self._take(message)
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
            if self._signalled:
                self._refusals.append(Refusal(message.request_id, EngineStopped(
                    f"DP rank {self._rank.spec.rank} got SIGTERM: the ranks finish the requests they hold and take "
                    "no new ones")))
                return
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
        load = RankLoad(engine.scheduler.num_running, kv.num_free, kv.num_blocks - 1,
                        host_cache_stats(engine.scheduler.prefix_cache_stats))
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
