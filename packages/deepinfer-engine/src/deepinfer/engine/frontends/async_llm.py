"""AsyncLLM: an `LLMEngine` driven by its own thread, consumed from asyncio.

    llm = AsyncLLM(LLMEngine(EngineArgs()))
    async for out in llm.generate("def f(", SamplingParams(max_tokens=8), delta=True):
        print(out.outputs[0].text, end="")
    await llm.shutdown()

One engine thread owns every engine call: new requests and aborts go through an inbox it drains
before each step, so the event loop never waits on the engine's lock (a step can take tens of ms).
With nothing to run the thread sleeps on an event; a submission wakes it. Outputs travel back in one
`call_soon_threadsafe` per step and event loop; each request keeps only its latest (cumulative)
output, so a slow consumer sees fewer, larger updates rather than a growing backlog (the
streaming machinery it shares with the other fronts is in `async_front`).

The engine's steps and the event loop's per-token work (a server's SSE chunks, stream wake-ups,
metrics) take turns on one interpreter lock here; `deepinfer serve` therefore runs the engine in a
process of its own by default (`async_process.AsyncLLMProcess`) and uses this class with
--engine-in-thread. It stays for library use: no child process, and the engine object at hand.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.intake import PromptInput
from ..core.outputs import RequestOutput
from ..core.prefix_caching import host_cache_stats
from ..llm_engine import LLMEngine
from ..sampling.sampling_params import SamplingParams
from .async_front import (
    DEFAULT_MAX_NUM_WAITING,
    EngineDead,
    EngineQueueFull,
    EngineStats,
    EngineStopped,
    OutputStream,
    ServedModel,
    StreamingFront,
    deliver,
)
from .core_loop import run_loop
from .engine_process import transfer_stats

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Submission:
    request_id: str
    prompt: PromptInput | Sequence[int]
    params: SamplingParams
    stream: OutputStream


class AsyncLLM(StreamingFront):
    """Async generation over one `LLMEngine`, whose steps run in a dedicated thread.

    Args:
        engine: the engine to drive; nothing else may call it while this AsyncLLM runs.
        max_num_waiting: most requests accepted but not yet running; one more raises
            `EngineQueueFull` from `generate`.

    The thread starts here and stops in `shutdown`.
    """

    def __init__(self, engine: LLMEngine, *, max_num_waiting: int = DEFAULT_MAX_NUM_WAITING) -> None:
        if isinstance(max_num_waiting, bool) or not isinstance(max_num_waiting, int) or max_num_waiting < 1:
            raise ValueError(f"max_num_waiting={max_num_waiting!r} must be an int >= 1")
        self.engine = engine
        self.max_num_waiting = max_num_waiting
        self._streams: dict[str, OutputStream] = {}
        self._inbox: list[_Submission] = []
        self._aborts: list[str] = []
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False        # no new requests; the thread exits once the engine is idle
        self._dead: BaseException | None = None
        self.stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event-loop side

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); its stream ends without a last output."""
        with self._inbox_lock:
            self._aborts.append(request_id)
        self._wake.set()

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and taking requests (not shut down, not failed)."""
        return self._thread.is_alive() and not self._stopping and self._dead is None

    @property
    def model(self) -> ServedModel:
        """The engine's model folder, tokenizer and length limit."""
        engine = self.engine
        return ServedModel(engine.model_dir, engine.tokenizer, engine.max_model_len, engine.args.model is None)

    @property
    def failure(self) -> str | None:
        """Why the engine thread died (None while it runs or after a clean shutdown)."""
        return None if self._dead is None else f"the engine thread failed: {self._dead!r}"

    def parallel_stats(self) -> None:
        """None: one engine, no DP ranks."""
        return None

    async def shutdown(self, *, drain: bool = True, poll_s: float = 0.05) -> None:
        """Stop taking requests; with drain, wait until every accepted request has finished (its last
        output delivered; a consumer that never reads it does not hold this up), else abort them.
        The engine thread stops once the engine is idle."""
        self._stopping = True
        if not drain:
            for request_id in list(self._streams):
                self.abort(request_id)
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        await self._wait_streams_ended(poll_s)      # the last outputs, posted by the thread, reach their streams

    def _submit(self, prompt: PromptInput | Sequence[int], params: SamplingParams,
                request_id: str | None) -> tuple[str, OutputStream]:
        if self._dead is not None:
            raise EngineDead(f"the engine thread failed: {self._dead!r}")
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        if len(self._streams) - self.stats.num_running >= self.max_num_waiting:
            raise EngineQueueFull(f"{self.max_num_waiting} requests are already waiting (max_num_waiting); retry later")
        request_id = f"req-{uuid.uuid4().hex}" if request_id is None else request_id
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use")
        stream = OutputStream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        with self._inbox_lock:
            self._inbox.append(_Submission(request_id, prompt, params, stream))
        self._wake.set()
        return request_id, stream

    # ------------------------------------------------------------------ engine-thread side

    def _run(self) -> None:
        try:
            transport = _ThreadTransport(self)
            run_loop(transport.step, transport)
        except BaseException as error:          # a bug: fail every stream rather than hang them
            logger.exception("the engine thread failed; every request in flight fails")
            self._dead = error
            for stream in list(self._streams.values()):
                stream.fail(EngineDead(f"the engine thread failed: {error!r}"))

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for sub in inbox:
            try:
                self.engine.add_request(sub.request_id, sub.prompt, sub.params)
            except Exception as error:   # refused: nothing was queued
                sub.stream.fail(error)
        for request_id in aborts:
            self.engine.abort_request(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deliver(((stream, out) for out in outputs if (stream := self._streams.get(out.request_id)) is not None),
                self.abort)

    def _snapshot(self) -> EngineStats:
        engine = self.engine
        num_running = engine.scheduler.num_running
        kv = engine.kv_blocks
        return EngineStats(num_running, max(0, len(self._streams) - num_running), kv.num_free, kv.num_blocks - 1,
                           host_cache_stats(engine.scheduler.prefix_cache_stats), transfer_stats(engine))


class _ThreadTransport:
    """The `core_loop.Transport` of `AsyncLLM`'s engine thread: its inbox in, its streams out; with
    nothing to run the thread sleeps on the front's event, which a submission or an abort sets."""

    def __init__(self, front: AsyncLLM) -> None:
        self._front = front

    def step(self) -> list[RequestOutput]:
        return self._front.engine.step()

    def poll(self) -> None:
        self._front._wake.clear()
        self._front._take_inbox()

    def has_work(self) -> bool:
        return self._front.engine.has_unfinished_requests()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        front = self._front
        front._deliver(outputs)
        front.stats = front._snapshot()

    def idle(self) -> bool:
        front = self._front
        front.stats = front._snapshot()
        if front._stopping:          # every accepted request has finished (or was refused)
            return False
        front._wake.wait()
        return True


__all__ = ["DEFAULT_MAX_NUM_WAITING", "AsyncLLM", "EngineDead", "EngineQueueFull", "EngineStats", "EngineStopped"]
