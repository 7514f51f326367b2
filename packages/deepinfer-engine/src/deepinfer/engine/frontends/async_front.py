"""What the asyncio fronts share: `AsyncLLM` (one engine in a thread), `async_process.AsyncLLMProcess`
(one engine in a process of its own, `deepinfer serve`'s default) and `parallel.DPAsyncLLM` (DP rank
processes) all hand each request's outputs to an `OutputStream` from a thread of their own and
implement `EngineClient`, the interface the HTTP server drives.

An `OutputStream` fed cumulative outputs keeps only the latest, so a slow consumer sees fewer,
larger updates rather than a growing backlog; `StreamingFront.generate` cuts them into deltas when
asked. A `DeltaStream` (the engine process reports DELTA outputs) queues them until taken and joins
what queued into one delta, or into the cumulative output for a cumulative consumer."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..core.intake import PromptInput
from ..core.outputs import CompletionOutput, RequestOutput, running_output
from ..core.stats import EngineStats, ParallelStats
from ..sampling.sampling_params import SamplingParams
from ..text.text_checks import check_prompt_length, check_unicode
from ..text.tokenizer import Tokenizer

DEFAULT_MAX_NUM_WAITING = 1024
MAX_PENDING_DELTAS = 64      # outputs a DeltaStream queues for its consumer before joining them into one


class EngineQueueFull(RuntimeError):
    """The waiting queue holds `max_num_waiting` requests; retry later (the server answers 503)."""


class EngineStopped(RuntimeError):
    """The front is shut down (or its engine failed); it takes no more requests."""


class EngineDead(EngineStopped):
    """The engine behind the front failed (a DP rank died); the message says which and how."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the server needs to know of the model: where it is, its tokenizer and length limit.

    Attributes:
        model_dir: the model folder (chat templates are read from it).
        tokenizer: its tokenizer, or None when the folder has no tokenizer.json.
        max_model_len: most tokens of prompt + output per request.
        embedded: the engine runs the embedded default model (EngineArgs.model None).
    """

    model_dir: Path
    tokenizer: Tokenizer | None
    max_model_len: int
    embedded: bool


class EngineClient(Protocol):
    """The interface `serve.build_app` drives: `AsyncLLM`, `async_process.AsyncLLMProcess` or `parallel.DPAsyncLLM`."""

    @property
    def model(self) -> ServedModel: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def failure(self) -> str | None:
        """Why the engine stopped when it failed (None while healthy or after a clean shutdown)."""

    def parallel_stats(self) -> ParallelStats | None:
        """Per-rank stats and EPLB re-placements (None for one engine)."""

    def generate(self, prompt: PromptInput | Sequence[int], params: SamplingParams | None = None,
                 request_id: str | None = None, *, delta: bool = False) -> AsyncGenerator[RequestOutput, None]: ...

    def abort(self, request_id: str) -> None: ...

    async def shutdown(self, *, drain: bool = True) -> None: ...


class OutputStream:
    """One request's mailbox, owned by the event loop that called `generate`; filled from another
    thread with `deliver` / `fail`. Fed cumulative outputs: each replaces the one before (a slow
    consumer sees fewer, larger updates); `take(delta=True)` cuts what was already taken off."""

    __slots__ = ("_reported", "error", "event", "latest", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self._reported: list[tuple[int, int]] = []     # per sample: (tokens, characters) already taken

    @property
    def ended(self) -> bool:
        """Its last output (or its error) has reached the event loop."""
        return self.error is not None or (self.latest is not None and self.latest.finished)

    def put(self, out: RequestOutput) -> None:
        """Post an output (on the stream's event loop)."""
        self.latest = out
        self.event.set()

    def take(self, delta: bool) -> RequestOutput | None:
        """The output to yield now, cumulative or cut to what is new (None: nothing posted yet)."""
        out = self.latest
        if out is None or not delta:
            return out
        cut = _delta(out, self._reported)
        self._reported = [(len(c.token_ids), len(c.text)) for c in out.outputs]
        return cut

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (thread-safe; nothing happens once its event loop is closed, nor
        to a stream whose last output was posted first: the request did finish)."""
        def apply() -> None:
            if not self.ended:
                self.error = error
                self.event.set()

        with contextlib.suppress(RuntimeError):     # raised when the loop is closed: nobody waits on this stream
            self.loop.call_soon_threadsafe(apply)


class DeltaStream(OutputStream):
    """An `OutputStream` fed DELTA outputs (what is new since the previous one, as an engine process
    reports them): they queue until taken, then are joined into one delta (`accumulate`), or into
    the cumulative output so far for a cumulative consumer. Only the first output of a request needs
    its prompt and prompt token ids: the joined outputs keep the first's."""

    __slots__ = ("_cumulative", "_final", "_pending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._pending: list[RequestOutput] = []
        self._cumulative: RequestOutput | None = None
        self._final = False

    @property
    def ended(self) -> bool:
        return self.error is not None or self._final

    def put(self, out: RequestOutput) -> None:
        pending = self._pending
        pending.append(out)
        if len(pending) > MAX_PENDING_DELTAS:      # a consumer that does not read: one joined delta, not
            joined = pending[0]                     # one object per step for the rest of the request
            for more in pending[1:]:
                joined = accumulate(joined, more)
            self._pending = [joined]
        self._final = out.finished
        self.event.set()

    def take(self, delta: bool) -> RequestOutput | None:
        pending = self._pending
        if not pending:
            return None
        self._pending = []
        out = pending[0]
        for more in pending[1:]:
            out = accumulate(out, more)
        if delta:
            return out
        self._cumulative = out = accumulate(self._cumulative, out)
        return out


def deliver(items: Iterable[tuple[OutputStream, RequestOutput]], on_closed_loop: Callable[[str], None]) -> None:
    """Post each (stream, output) to its stream, one `call_soon_threadsafe` per event loop;
    the requests of a closed event loop (their consumers are gone) go to `on_closed_loop` (abort)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = {}
    for stream, out in items:
        by_loop.setdefault(stream.loop, []).append((stream, out))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_outputs, batch)
        except RuntimeError:
            for _, out in batch:
                on_closed_loop(out.request_id)


def _set_outputs(items: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)


class StreamingFront(abc.ABC):
    """`generate` over `OutputStream`s; a subclass queues requests (`_submit`) and aborts them (`abort`)."""

    _streams: dict[str, OutputStream]

    @property
    @abc.abstractmethod
    def model(self) -> ServedModel:
        """The served model's folder, tokenizer and length limit."""

    @property
    @abc.abstractmethod
    def is_running(self) -> bool:
        """The front takes requests (not shut down, not failed)."""

    @abc.abstractmethod
    def _submit(self, prompt: PromptInput | Sequence[int], params: SamplingParams,
                request_id: str | None) -> tuple[str, OutputStream]:
        """Queue a request (raising as `generate` says when it cannot); its id and its registered stream."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); its stream ends without a last output."""

    async def generate(self, prompt: PromptInput | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, delta: bool = False) -> AsyncGenerator[RequestOutput, None]:
        """Run one request; yields its outputs as the engine produces them, the last one finished.

        Args:
            prompt: text, `{"prompt_token_ids": [...]}` or a list of token ids (as `LLMEngine.add_request`).
            params: None = SamplingParams().
            request_id: None = a fresh "req-<uuid>" id.
            delta: yield only what is new since the previous output (text, token_ids and logprobs of
                the new tokens) instead of the cumulative output.
        Raises (all from the first iteration, before any output, unless said otherwise):
            EngineQueueFull: max_num_waiting requests already wait; nothing was queued.
            EngineStopped: shut down, or the engine failed (`EngineDead`, also after some outputs).
            ValueError / StructuredOutputUnavailable: the engine refused the request (a bad or
                duplicate id, a bad prompt, ...), or the text prompt was refused before tokenizing
                (`_prepare`). A refused request leaves nothing behind.
        Closing or cancelling the iterator before the last output aborts the request, which frees
        its cache blocks at the engine's next step.
        """
        prompt = await self._prepare(prompt)
        request_id, stream = self._submit(prompt, params or SamplingParams(), request_id)
        finished = False
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    finished = True
                    raise stream.error
                out = stream.take(delta)
                if out is None:
                    continue
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _prepare(self, prompt: PromptInput | Sequence[int]) -> PromptInput | Sequence[int]:
        """A text prompt checked and tokenized off the event loop, before anything is registered:
        {"prompt_token_ids", "prompt"} (the engine gives both forms the same result). Anything else,
        or text without a tokenizer, goes as it is (the engine checks it, or refuses it).

        Raises:
            ValueError: the text holds a lone surrogate, or is longer than max_model_len tokens could
                hold (`text_checks.check_prompt_length`: refused without tokenizing it).
        """
        if not isinstance(prompt, str) or not self.is_running:    # stopped: `_submit` says so, untokenized
            return prompt
        model = self.model
        if model.tokenizer is None:
            return prompt
        check_prompt_length(prompt, model.tokenizer.max_token_chars, model.max_model_len)
        check_unicode(prompt, "prompt")
        ids = await asyncio.to_thread(model.tokenizer.encode, prompt)
        return {"prompt_token_ids": ids, "prompt": prompt}

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished."""
        return len(self._streams)

    async def _wait_streams_ended(self, poll_s: float) -> None:
        """Until every open stream got its last output or error (a consumer that never reads it does
        not hold this up)."""
        while any(not stream.ended for stream in self._streams.values()):
            await asyncio.sleep(poll_s)


class ProcessFront(StreamingFront):
    """What the fronts over engine processes share (`async_process.AsyncLLMProcess`,
    `parallel.DPAsyncLLM`): the shut-down / failed state, the checks a request passes before it is
    queued, and failing every stream when an engine process fails. A subclass sets `_stopping`,
    `_shutdown_begun`, `_failure`, `_reader` (its thread reading the processes' reports), `_model` and
    `max_num_waiting`; it may set `_stop_reason` when its engine processes stop on their own (SIGTERM)."""

    _stopping: bool               # no new requests: shut down, or the engine processes are stopping
    _shutdown_begun: bool         # `shutdown` was called
    _stop_reason: str = "the server is shutting down"
    _failure: str | None
    _reader: threading.Thread
    _model: ServedModel
    max_num_waiting: int

    @property
    def model(self) -> ServedModel:
        """The served model, as the engine processes reported it when ready."""
        return self._model

    @property
    def is_running(self) -> bool:
        """The engine processes are alive and the front takes requests (not shut down or stopping, not
        failed)."""
        return not self._stopping and self._failure is None and self._reader.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the engine processes stopped when one failed ("... exited with code -9"), else None."""
        return self._failure

    def _accept(self, request_id: str | None, num_running: int, in_use: Callable[[str], bool]) -> str:
        """The id of a request that may be queued now (a fresh "req-<uuid>" for None).

        Raises:
            EngineDead: an engine process failed. EngineStopped: shutting down.
            EngineQueueFull: max_num_waiting requests already wait. ValueError: the id is in use.
        """
        if self._failure is not None:
            raise EngineDead(self._failure)
        if self._stopping:
            raise EngineStopped(self._stop_reason)
        if len(self._streams) - num_running >= self.max_num_waiting:
            raise EngineQueueFull(f"{self.max_num_waiting} requests are already waiting (max_num_waiting); retry later")
        request_id = f"req-{uuid.uuid4().hex}" if request_id is None else request_id
        if request_id in self._streams or in_use(request_id):
            raise ValueError(f"request_id={request_id!r} is already in use")
        return request_id

    def _begin_shutdown(self, drain: bool) -> bool:
        """Stop taking requests; without `drain`, abort every accepted one. False when a shutdown had
        already begun (nothing done); True also when the engine processes had begun to stop on their
        own (SIGTERM), so that this shutdown waits for them."""
        if self._shutdown_begun:
            return False
        self._shutdown_begun = self._stopping = True
        if not drain:
            for request_id in list(self._streams):
                self.abort(request_id)
        return True

    def _fail_streams(self, reason: str, *, stopped: bool = False) -> None:
        """Every open stream fails with EngineDead naming `reason` (with `stopped`: EngineStopped, the
        engine stopped cleanly without answering it)."""
        for stream in list(self._streams.values()):
            stream.fail(EngineStopped(reason) if stopped else EngineDead(f"the server's engine failed: {reason}"))


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
                              out.prompt_logprobs, out.num_cached_tokens)
    return dataclasses.replace(out, outputs=[dataclasses.replace(c, text=text, token_ids=ids, logprobs=logprobs,
                                                                 logprob_entries=entries)
                                             for c, text, ids, logprobs, entries in cut])


def accumulate(previous: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """The output after `previous` and then `delta` (a DELTA output): each sample's text, tokens and
    logprobs appended to `previous`'s, the finish fields of `delta`; the prompt, its ids and logprobs
    kept from the first output that had them (later deltas may leave them out: None, [], None)."""
    if previous is None:
        return delta
    prompt_logprobs = delta.prompt_logprobs or previous.prompt_logprobs
    num_cached_tokens = max(previous.num_cached_tokens, delta.num_cached_tokens)
    if not delta.finished and len(delta.outputs) == 1:
        old, new = previous.outputs[0], delta.outputs[0]
        return running_output(previous.request_id, previous.prompt, previous.prompt_token_ids, old.text + new.text,
                              old.token_ids + new.token_ids, _joined(old.logprobs, new.logprobs),
                              _joined(old.logprob_entries, new.logprob_entries), prompt_logprobs, num_cached_tokens)
    samples = [CompletionOutput(index=new.index, text=old.text + new.text, token_ids=old.token_ids + new.token_ids,
                                finish_reason=new.finish_reason, logprobs=_joined(old.logprobs, new.logprobs),
                                stop_reason=new.stop_reason, ignored_reason=new.ignored_reason,
                                error_reason=new.error_reason,
                                logprob_entries=_joined(old.logprob_entries, new.logprob_entries))
               for old, new in zip(previous.outputs, delta.outputs)]
    return RequestOutput(previous.request_id, previous.prompt, previous.prompt_token_ids, samples, delta.finished,
                         prompt_logprobs, num_cached_tokens)


def _joined(old: list | None, new: list | None) -> list | None:
    return None if old is None or new is None else old + new
