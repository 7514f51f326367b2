"""AsyncLLM: an `LLMEngine` driven by its own thread, consumed from asyncio.

    llm = AsyncLLM(LLMEngine(EngineArgs()))
    async for out in llm.generate("def f(", SamplingParams(max_tokens=8), delta=True):
        print(out.outputs[0].text, end="")
    await llm.shutdown()

One engine thread owns every engine call: new requests and aborts go through an inbox it drains
before each step, so the event loop never waits on the engine's lock (a step can take tens of ms).
With nothing to run the thread sleeps on an event; a submission wakes it. Outputs travel back in one
`call_soon_threadsafe` per step and event loop; each request keeps only its latest (cumulative)
output, so a slow consumer sees fewer, larger updates rather than a growing backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from .intake import PromptInput
from .llm_engine import LLMEngine
from .outputs import RequestOutput, running_output
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_WAITING = 1024


class EngineQueueFull(RuntimeError):
    """The waiting queue holds `max_num_waiting` requests; retry later (the server answers 503)."""


class EngineStopped(RuntimeError):
    """The AsyncLLM is shut down (or its engine thread died); it takes no more requests."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine taken by its thread after each step (read without a lock).

    Attributes:
        num_running: sequences decoding (or about to), per the scheduler.
        num_waiting: requests accepted but not running: in the inbox, compiling a grammar or
            waiting for prefill.
        num_free_kv_blocks: free paged KV blocks (block 0, reserved, not counted).
        num_kv_blocks: usable paged KV blocks (block 0 excluded).
    """

    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_kv_blocks: int

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the usable KV blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


class _Stream:
    """One request's mailbox, owned by the event loop that called `generate`."""

    __slots__ = ("error", "event", "latest", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class _Submission:
    request_id: str
    prompt: PromptInput | Sequence[int]
    params: SamplingParams
    stream: _Stream


class AsyncLLM:
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
        self._streams: dict[str, _Stream] = {}
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

    async def generate(self, prompt: PromptInput | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, delta: bool = False) -> AsyncGenerator[RequestOutput, None]:
        """Run one request; yields its outputs as the engine produces them, the last one finished.

        Args:
            prompt: text, `{"prompt_token_ids": [...]}` or a list of token ids (as `LLMEngine.add_request`).
            params: None = SamplingParams().
            request_id: None = a fresh "req-<uuid>" id.
            delta: yield only what is new since the previous output (text, token_ids and logprobs of
                the new tokens) instead of the cumulative output.
        Raises (all from the first iteration, before any output):
            EngineQueueFull: max_num_waiting requests already wait; nothing was queued.
            EngineStopped: shut down, or the engine thread failed.
            ValueError / StructuredOutputUnavailable: the engine refused the request (a bad or
                duplicate id, a bad prompt, ...).
        Closing or cancelling the iterator before the last output aborts the request, which frees
        its cache blocks at the engine's next step.
        """
        request_id, stream = self._submit(prompt, params or SamplingParams(), request_id)
        finished = False
        reported: list[tuple[int, int]] = []      # per sample: (tokens, characters) already yielded
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    finished = True
                    raise stream.error
                out = stream.latest
                if out is None:
                    continue
                finished = out.finished
                if delta:
                    new = _delta(out, reported)
                    reported = [(len(c.token_ids), len(c.text)) for c in out.outputs]
                    out = new
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

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
    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished (running, waiting or in the inbox)."""
        return len(self._streams)

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
        while any(s.error is None and (s.latest is None or not s.latest.finished) for s in self._streams.values()):
            await asyncio.sleep(poll_s)       # the last outputs, posted by the thread, reach their streams

    def _submit(self, prompt: PromptInput | Sequence[int], params: SamplingParams,
                request_id: str | None) -> tuple[str, _Stream]:
        if self._dead is not None:
            raise EngineStopped(f"the engine thread failed: {self._dead!r}")
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        if len(self._streams) - self.stats.num_running >= self.max_num_waiting:
            raise EngineQueueFull(f"{self.max_num_waiting} requests are already waiting (max_num_waiting); retry later")
        request_id = f"req-{uuid.uuid4().hex}" if request_id is None else request_id
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        with self._inbox_lock:
            self._inbox.append(_Submission(request_id, prompt, params, stream))
        self._wake.set()
        return request_id, stream

    # ------------------------------------------------------------------ engine-thread side

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wake.clear()
                self._take_inbox()
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                    self.stats = self._snapshot()
                elif self._stopping:         # every accepted request has finished (or was refused)
                    self.stats = self._snapshot()
                    return
                else:
                    self.stats = self._snapshot()
                    self._wake.wait()
        except BaseException as error:          # a bug: fail every stream rather than hang them
            logger.exception("the engine thread failed; every request in flight fails")
            self._dead = error
            for stream in list(self._streams.values()):
                _post(stream, None, EngineStopped(f"the engine thread failed: {error!r}"))

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for sub in inbox:
            try:
                self.engine.add_request(sub.request_id, sub.prompt, sub.params)
            except Exception as error:   # refused: nothing was queued
                _post(sub.stream, None, error)
        for request_id in aborts:
            self.engine.abort_request(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_set_outputs, items)
            except RuntimeError:        # that event loop is closed: its consumers are gone
                for _, out in items:
                    self.abort(out.request_id)

    def _snapshot(self) -> EngineStats:
        engine = self.engine
        num_running = engine.scheduler.num_running
        kv = engine.kv_blocks
        return EngineStats(num_running, max(0, len(self._streams) - num_running), kv.num_free, kv.num_blocks - 1)


def _set_outputs(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.latest = out
        stream.event.set()


def _post(stream: _Stream, out: RequestOutput | None, error: BaseException | None) -> None:
    def apply() -> None:
        stream.latest, stream.error = out, error
        stream.event.set()

    with contextlib.suppress(RuntimeError):     # raised when the loop is closed: nobody waits on this stream
        stream.loop.call_soon_threadsafe(apply)


def _delta(out: RequestOutput, reported: list[tuple[int, int]]) -> RequestOutput:
    """`out` with each sample cut to what follows its first (tokens, characters) in `reported` (none
    there: nothing cut; the engine only appends to both, so the cut is exact). A running output of one
    sample is rebuilt without the field checks (`running_output`: it has no finish reason to check), as
    the engine builds it."""
    cut = []
    for index, completion in enumerate(out.outputs):
        num_tokens, num_chars = reported[index] if index < len(reported) else (0, 0)
        logprobs = None if completion.logprobs is None else completion.logprobs[num_tokens:]
        entries = None if completion.logprob_entries is None else completion.logprob_entries[num_tokens:]
        cut.append((completion, completion.text[num_chars:], completion.token_ids[num_tokens:], logprobs, entries))
    if not out.finished and len(cut) == 1:
        _, text, token_ids, logprobs, entries = cut[0]
        return running_output(out.request_id, out.prompt, out.prompt_token_ids, text, token_ids, logprobs, entries,
                              out.prompt_logprobs)
    return dataclasses.replace(out, outputs=[dataclasses.replace(c, text=text, token_ids=ids, logprobs=logprobs,
                                                                 logprob_entries=entries)
                                             for c, text, ids, logprobs, entries in cut])


__all__ = ["AsyncLLM", "EngineQueueFull", "EngineStats", "EngineStopped"]
