"""DPAsyncLLM: the asyncio front of `data_parallel_size` rank processes, for `deepinfer serve`.

    llm = DPAsyncLLM(EngineArgs(data_parallel_size=2, expert_parallel=True))
    async for out in llm.generate("def f(", SamplingParams(max_tokens=8), delta=True):
        print(out.outputs[0].text, end="")
    await llm.shutdown()

The front spawns one process per rank (`serve_rank.serve_rank_main`) and talks to them over
torch.multiprocessing queues (`messages`). It tokenizes a text prompt itself, sends the request to
the least-loaded rank (fewest tokens of prompt and output in its unfinished requests; ties to the
lower rank) and a `Wake` to every other rank, so all of them step in lockstep while any has work
and sleep on their inboxes when none has. A reader thread takes the ranks' reports: it adds each
DELTA output to its request's cumulative one and posts that to the request's `OutputStream`, and it
watches the rank processes: when one dies or reports an error, every request in flight fails with
`EngineDead` naming the rank, the others are stopped, and the front takes no more requests.

A SIGTERM to a rank (or to the whole server) stops the ranks as a SIGTERM stops one engine process:
the rank says so (`RankStopping`), the front takes no more requests (`EngineStopped`: the server's
503) and sends `Stop`, the ranks finish the requests they hold and exit 0; the front has then
stopped, not failed (`failure` stays None).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.multiprocessing as mp

from ..config.engine_args import EngineArgs
from ..core.intake import PromptInput
from ..core.outputs import RequestOutput
from ..core.stats import EngineStats, HostCacheStats, ParallelStats, RebalanceStats
from ..frontends.async_front import (
    DEFAULT_MAX_NUM_WAITING,
    EngineStopped,
    OutputStream,
    ProcessFront,
    ServedModel,
    accumulate,
    deliver,
)
from ..llm_engine import resolve_model_dir
from ..sampling.sampling_params import SamplingParams
from ..text.tokenizer import load_tokenizer
from .launcher import free_port
from .messages import (
    Abort,
    RankError,
    RankLoad,
    RankReady,
    RankReport,
    RankStopping,
    Stop,
    Submit,
    Wake,
)
from .rank import RankFailure, RankSpec
from .rank_processes import RankProcesses
from .serve_rank import serve_rank_main

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_PEER_DEATH_GRACE_S = 2.0    # a rank reporting a lost peer waits this long for the dead peer to be seen exited


class DPAsyncLLM(ProcessFront):
    """Async generation over `args.data_parallel_size` rank processes (an `async_front.EngineClient`).

    Args:
        args: the engine arguments; data_parallel_size >= 2 ranks are spawned, each running an
            `LLMEngine` (with expert_parallel, the routed experts are sharded over them).
        max_num_waiting: most requests accepted but not yet running, over all ranks; one more
            raises `EngineQueueFull` from `generate`.

    Raises:
        ValueError: data_parallel_size < 2 or a bad max_num_waiting.
        RankFailure: a rank failed to start (its error in the message); every rank is stopped.
    """

    def __init__(self, args: EngineArgs, *, max_num_waiting: int = DEFAULT_MAX_NUM_WAITING) -> None:
        if isinstance(max_num_waiting, bool) or not isinstance(max_num_waiting, int) or max_num_waiting < 1:
            raise ValueError(f"max_num_waiting={max_num_waiting!r} must be an int >= 1")
        if args.data_parallel_size < 2:
            raise ValueError(f"data_parallel_size={args.data_parallel_size} must be >= 2 (use AsyncLLM for one rank)")
        self.max_num_waiting = max_num_waiting
        self._num_ranks = args.data_parallel_size
        self._timeout_s = args.distributed_timeout_s
        self._eplb = args.eplb is not None
        self._streams: dict[str, OutputStream] = {}
        self._lock = threading.Lock()            # guards everything below, shared with the reader thread
        self._seq = 0                            # counted messages sent to every rank
        self._owner: dict[str, int] = {}         # request id -> its rank, until its last output
        self._cost: dict[str, int] = {}          # request id -> its tokens (prompt + output so far)
        self._cumulative: dict[str, RequestOutput] = {}
        self._loads = [0] * self._num_ranks      # per rank: the sum of its requests' costs
        self._num_owned = [0] * self._num_ranks
        self._num_sent = [0] * self._num_ranks
        self._rank_loads = [RankLoad(0, 0, 0)] * self._num_ranks
        self._rebalances: list[RebalanceStats] = []
        self._stopping = False
        self._shutdown_begun = False
        self._stop_sent = False                  # Stop sent to every rank: no counted message after it
        self._failure: str | None = None
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self._num_ranks)]
        self._procs = [ctx.Process(target=serve_rank_main, name=f"deepinfer-dp-serve-rank-{rank}", daemon=True,
                                   args=(RankSpec(rank, self._num_ranks, init_method), args, inbox, self._outbox))
                       for rank, inbox in enumerate(self._inboxes)]
        for proc in self._procs:
            proc.start()
        self._ranks = RankProcesses(self._procs)
        max_model_len = self._wait_ready()
        model_dir = resolve_model_dir(args.resolved().model)
        self._model = ServedModel(model_dir, load_tokenizer(model_dir), max_model_len, args.model is None)
        self._reader = threading.Thread(target=self._read, name="deepinfer-dp-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ state

    @property
    def pids(self) -> tuple[int, ...]:
        """The rank processes' ids, by rank."""
        return tuple(proc.pid for proc in self._procs)

    @property
    def stats(self) -> EngineStats:
        """The sum of `parallel_stats().rank_stats`."""
        ranks = self._rank_stats()
        return EngineStats(sum(s.num_running for s in ranks), sum(s.num_waiting for s in ranks),
                           sum(s.num_free_kv_blocks for s in ranks), sum(s.num_kv_blocks for s in ranks),
                           sum((s.host_cache for s in ranks), HostCacheStats()))

    def parallel_stats(self) -> ParallelStats:
        """Per-rank running / waiting requests, KV cache and requests sent, and the EPLB re-placements so far."""
        with self._lock:
            rebalances, num_sent = tuple(self._rebalances), tuple(self._num_sent)
        return ParallelStats(self._rank_stats(), num_sent, self._eplb, rebalances)

    def _rank_stats(self) -> tuple[EngineStats, ...]:
        with self._lock:      # waiting: owned by the rank (queued here or there) and not running there
            return tuple(EngineStats(load.num_running, max(0, owned - load.num_running), load.num_free_kv_blocks,
                                     load.num_kv_blocks, load.host_cache)
                         for load, owned in zip(self._rank_loads, self._num_owned))

    # ------------------------------------------------------------------ event-loop side

    def _submit(self, prompt: PromptInput | Sequence[int], params: SamplingParams,
                request_id: str | None) -> tuple[str, OutputStream]:
        request_id = self._accept(request_id, self.stats.num_running, self._owner.__contains__)
        prompt, num_prompt_tokens = self._tokenized(prompt)
        stream = OutputStream(asyncio.get_running_loop())
        with self._lock:
            if self._stop_sent:          # a rank's SIGTERM (reader thread) got in after `_accept`
                raise EngineStopped(self._stop_reason)
            self._streams[request_id] = stream
            rank = self._loads.index(min(self._loads))
            self._owner[request_id] = rank
            self._cost[request_id] = num_prompt_tokens
            self._loads[rank] += num_prompt_tokens
            self._num_owned[rank] += 1
            self._num_sent[rank] += 1
            self._send_counted(lambda seq, r: Submit(seq, request_id, prompt, params) if r == rank else Wake(seq))
        return request_id, stream

    def _tokenized(self, prompt: PromptInput | Sequence[int]) -> tuple[PromptInput | Sequence[int], int]:
        """(the prompt to send, its token count). Text becomes {"prompt_token_ids", "prompt"} here (the
        engine gives both forms the same result), so the rank does not tokenize it again; a prompt
        the front cannot read goes as it is, to be refused by the rank's engine."""
        tokenizer = self.model.tokenizer
        if isinstance(prompt, str):
            if tokenizer is None:
                return prompt, 0
            ids = tokenizer.encode(prompt)
            return {"prompt_token_ids": ids, "prompt": prompt}, len(ids)
        given = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        return prompt, len(given) if isinstance(given, list | tuple) else 0

    def _send_counted(self, make: Any) -> None:
        """Send `make(seq, rank)` to every rank under the next sequence number (lock held)."""
        self._seq += 1
        for rank, inbox in enumerate(self._inboxes):
            inbox.put(make(self._seq, rank))

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); its stream ends without a last output."""
        with self._lock:
            rank = self._owner.get(request_id)
            if rank is not None and self._failure is None:
                self._inboxes[rank].put(Abort(request_id))

    async def shutdown(self, *, drain: bool = True, poll_s: float = 0.05) -> None:
        """Stop taking requests; with drain, let every accepted request finish (else abort them), then
        stop the ranks (they exit once none has work) and wait for them."""
        if not self._begin_shutdown(drain):
            return
        self._send_stop()
        await asyncio.to_thread(self._ranks.join, self._timeout_s)   # a drained rank exits by itself
        await asyncio.to_thread(self._reader.join)
        await self._wait_streams_ended(poll_s)

    def _send_stop(self) -> None:
        """`Stop` to every rank, once, unless a rank failed."""
        with self._lock:
            if not self._stop_sent and self._failure is None:
                self._stop_sent = True
                self._send_counted(lambda seq, _: Stop(seq))

    # ------------------------------------------------------------------ start-up

    def _wait_ready(self) -> int:
        """Wait for every rank's `RankReady`; the max_model_len they report. A rank that fails first
        stops them all and raises RankFailure; a rank's SIGTERM meanwhile stops them once all are up."""
        max_model_len = 0
        ready: set[int] = set()
        while len(ready) < self._num_ranks:
            try:
                message = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                dead = self._dead_ranks()
                if dead:
                    self._ranks.kill()
                    raise RankFailure(f"{dead} while starting") from None
                continue
            if isinstance(message, RankError):
                self._ranks.kill()
                raise RankFailure(f"DP rank {message.rank} failed while starting: {message.detail}")
            if isinstance(message, RankReady):
                ready.add(message.rank)
                max_model_len = message.max_model_len
            elif isinstance(message, RankStopping):     # a ready rank got SIGTERM while a peer still starts
                self._rank_signalled(message.rank)
        return max_model_len

    def _dead_ranks(self) -> str:
        """'DP rank R exited with code C; ...' for the ranks that exited (after Stop, exit code 0 is fine)."""
        return self._ranks.exited(clean_exit_expected=self._stop_sent)

    # ------------------------------------------------------------------ reader thread

    def _read(self) -> None:
        """Take the ranks' reports until every rank has exited (and its last report is read), or one fails."""
        while True:
            try:
                message = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                message = None
            dead = self._dead_ranks()
            if isinstance(message, RankError) and not dead:
                dead = self._wait_for_dead_peer()
            if isinstance(message, RankError) or dead:
                error = f"DP rank {message.rank}: {message.detail}" if isinstance(message, RankError) else ""
                self._fail("; ".join(part for part in (dead, error) if part))
                return
            if isinstance(message, RankReport):
                self._take_report(message)
            elif isinstance(message, RankStopping):
                self._rank_signalled(message.rank)
            elif message is None and not self._ranks.any_alive():
                self._stopped()         # every rank exited cleanly and its reports are read
                return

    def _rank_signalled(self, rank: int) -> None:
        """A rank got SIGTERM: take no more requests, stop every rank once their requests are done."""
        if not self._stopping:
            self._stop_reason = (f"DP rank {rank} got SIGTERM: the ranks finish the requests they hold and the server "
                                 "takes no new ones")
            self._stopping = True
            logger.warning("%s (%d in flight)", self._stop_reason, len(self._owner))
        self._send_stop()

    def _stopped(self) -> None:
        """Every rank exited 0 after `Stop`. A request none of them answered (none is expected: every
        counted message comes before `Stop`) fails rather than waiting forever."""
        with self._lock:
            lost = len(self._owner)
        if lost:
            logger.error("the DP ranks stopped with %d request(s) unanswered; they fail", lost)
            self._fail_streams("the DP ranks stopped before answering the request", stopped=True)

    def _wait_for_dead_peer(self) -> str:
        """A rank's error is often the echo of a peer that died (its collective lost the connection) and may
        arrive before that peer is seen exited: wait up to _PEER_DEATH_GRACE_S so the failure names the root
        cause ('DP rank 1 exited with code -9') first. '' when every other rank stays alive."""
        deadline = time.monotonic() + _PEER_DEATH_GRACE_S
        while not (dead := self._dead_ranks()) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return dead

    def _take_report(self, report: RankReport) -> None:
        posts: list[tuple[OutputStream, RequestOutput]] = []
        with self._lock:
            self._rank_loads[report.rank] = report.load
            self._rebalances.extend(report.rebalances)
            for delta in report.outputs:
                request_id = delta.request_id
                out = accumulate(self._cumulative.get(request_id), delta)
                num_new = sum(len(c.token_ids) for c in delta.outputs)
                if out.finished:
                    self._forget(request_id)
                else:
                    self._cumulative[request_id] = out
                    self._cost[request_id] += num_new
                    self._loads[report.rank] += num_new
                stream = self._streams.get(request_id)
                if stream is not None:
                    posts.append((stream, out))
            for refusal in report.refusals:
                self._forget(refusal.request_id)
                stream = self._streams.get(refusal.request_id)
                if stream is not None:
                    stream.fail(refusal.error)
        deliver(posts, self.abort)

    def _forget(self, request_id: str) -> None:
        """Drop a request that ended on its rank (lock held)."""
        rank = self._owner.pop(request_id)
        self._loads[rank] -= self._cost.pop(request_id)
        self._num_owned[rank] -= 1
        self._cumulative.pop(request_id, None)

    def _fail(self, reason: str) -> None:
        """A rank failed: fail every stream with EngineDead(reason), stop the other ranks."""
        logger.error("the DP ranks stopped: %s; every request in flight fails", reason)
        with self._lock:
            self._failure = reason
        self._fail_streams(reason)
        self._ranks.kill()


__all__ = ["DPAsyncLLM"]
