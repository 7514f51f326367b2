"""AsyncLLMProcess: async generation over an `LLMEngine` that runs in a process of its own, the front
`deepinfer serve` uses by default.

    llm = AsyncLLMProcess(EngineArgs())
    async for out in llm.generate("def f(", SamplingParams(max_tokens=8), delta=True):
        print(out.outputs[0].text, end="")
    await llm.shutdown()

The engine loop (`engine_process`) steps in a spawned child; this process keeps the event loop, the
HTTP work and a reader thread. The front tokenizes text prompts itself (on a worker thread, before
the request is registered: `StreamingFront._prepare`) and writes each request to
the child's pipe; the reader thread takes one `StepReport` per engine step, turns its columns back
into `RequestOutput`s (the prompt from the request's first output) and posts them to their
`DeltaStream`s with one `call_soon_threadsafe` per step and event loop. When the child dies (or
reports an error) every request in flight fails with `EngineDead`, `failure` says how, and the front
takes no more requests. A SIGTERM to the child (a service manager signals every process of the
server) is a stop, not a failure: the child finishes the requests it holds and says so in its next
report, from which the front refuses new requests (`EngineStopped`, the server's 503); a request
that reached the child after the signal is refused by it; the child then exits 0, logged as a clean
stop, and `failure` stays None. `shutdown` stops the child and waits for it: no process is left behind.

`AsyncLLM` (an engine in a thread of this process) stays for library use and `deepinfer serve
--engine-in-thread`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
from collections.abc import Callable, Sequence

from ..config.engine_args import EngineArgs
from ..core.intake import PromptInput
from ..core.kv_handoff import KVTransfer
from ..core.outputs import RequestOutput, running_output
from ..sampling.sampling_params import SamplingParams
from ..text.tokenizer import load_tokenizer
from .async_front import (
    DEFAULT_MAX_NUM_WAITING,
    DeltaStream,
    EngineStats,
    OutputStream,
    ProcessFront,
    ServedModel,
    deliver,
)
from .engine_process import (
    AbortRequests,
    EngineFailed,
    EngineLoad,
    EngineReady,
    StepReport,
    StopEngine,
    SubmitRequest,
    engine_process_main,
    receive,
    send,
)

logger = logging.getLogger(__name__)


class EngineStartFailed(RuntimeError):
    """The engine process could not build its engine (the message says why) or died while starting."""


class AsyncLLMProcess(ProcessFront):
    """Async generation over one `LLMEngine` in a child process (an `async_front.EngineClient`).

    Args:
        args: the engine arguments (data_parallel_size 1; `parallel.DPAsyncLLM` runs more ranks).
        max_num_waiting: most requests accepted but not yet running; one more raises
            `EngineQueueFull` from `generate`.
        kv_transfer_factory: a picklable callable the engine process calls for its engine's
            `KVTransfer` (a decode server's: `functools.partial(disagg.HttpPrefillClient, url)`).

    Raises:
        ValueError: data_parallel_size > 1 or a bad max_num_waiting.
        EngineStartFailed: the engine could not be built (a bad model folder, device, ...); the child
            has exited.
    """

    def __init__(self, args: EngineArgs, *, max_num_waiting: int = DEFAULT_MAX_NUM_WAITING,
                 kv_transfer_factory: Callable[[], KVTransfer] | None = None) -> None:
        if isinstance(max_num_waiting, bool) or not isinstance(max_num_waiting, int) or max_num_waiting < 1:
            raise ValueError(f"max_num_waiting={max_num_waiting!r} must be an int >= 1")
        if args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size} must be 1 (use parallel.DPAsyncLLM)")
        self.max_num_waiting = max_num_waiting
        self._streams: dict[str, OutputStream] = {}
        self._prompts: dict[str, RequestOutput] = {}   # running request -> its first output (its prompt)
        self._num_unfinished = 0                        # submitted, not yet finished or refused
        self._load = EngineLoad(0, 0, 0)
        self._stopping = False
        self._shutdown_begun = False
        self._failure: str | None = None
        self._send_lock = threading.Lock()
        self._wait_lock = threading.Lock()              # one waitpid at a time (`_wait_exit`)
        ctx = mp.get_context("spawn")
        from_engine, engine_out = ctx.Pipe(duplex=False)
        engine_in, to_engine = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=engine_process_main, name="deepinfer-engine", daemon=True,
                                 args=(args, engine_in, engine_out, kv_transfer_factory))
        self._proc.start()
        engine_in.close()           # the child's ends: closed here, so that its death reads as EOF
        engine_out.close()
        self._from_engine, self._to_engine = from_engine, to_engine
        self.ready = self._wait_ready()
        self._load = self.ready.load
        self._model = ServedModel(self.ready.model_dir, load_tokenizer(self.ready.model_dir), self.ready.max_model_len,
                                 args.model is None)
        self._reader = threading.Thread(target=self._read, name="deepinfer-engine-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ state

    @property
    def pid(self) -> int:
        """The engine process's id."""
        assert self._proc.pid is not None
        return self._proc.pid

    @property
    def stats(self) -> EngineStats:
        """The engine after its latest reported step; waiting = submitted, unfinished and not running."""
        load = self._load
        return EngineStats(load.num_running, max(0, self._num_unfinished - load.num_running), load.num_free_kv_blocks,
                           load.num_kv_blocks, load.host_cache, load.kv_transfer)

    def parallel_stats(self) -> None:
        """None: one engine, no DP ranks."""
        return None

    # ------------------------------------------------------------------ event-loop side

    def _submit(self, prompt: PromptInput | Sequence[int], params: SamplingParams,
                request_id: str | None) -> tuple[str, OutputStream]:
        # Text was tokenized by `_prepare` (off the event loop; a refusal there registers nothing).
        # Nothing below raises after the request is registered.
        request_id = self._accept(request_id, self._load.num_running, lambda _: False)
        stream = DeltaStream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._num_unfinished += 1
        self._send(SubmitRequest(request_id, prompt, params))
        return request_id, stream

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); its stream ends without a last output."""
        if self._failure is None:
            self._send(AbortRequests((request_id,)))

    def _send(self, message: object) -> None:
        with self._send_lock:
            try:
                send(self._to_engine, message)
            except OSError:          # the engine process is gone (or stopped): the reader reports it
                pass

    async def shutdown(self, *, drain: bool = True, poll_s: float = 0.05) -> None:
        """Stop taking requests; with drain, let every accepted request finish (else abort them); the
        engine process then exits and is waited for."""
        if not self._begin_shutdown(drain):
            return                              # a shutdown in progress waits for the process
        self._send(StopEngine())                # lost (and not needed) when the process is stopping on SIGTERM
        await asyncio.to_thread(self._wait_exit, None)
        await asyncio.to_thread(self._reader.join)
        self._to_engine.close()
        await self._wait_streams_ended(poll_s)

    # ------------------------------------------------------------------ start-up

    def _wait_ready(self) -> EngineReady:
        try:
            message = receive(self._from_engine)
        except EOFError:
            message = None
        if isinstance(message, EngineReady):
            return message
        self._kill()
        if isinstance(message, EngineFailed):
            raise EngineStartFailed(message.detail)
        raise EngineStartFailed(f"the engine process exited with code {self._proc.exitcode} while starting")

    def _wait_exit(self, timeout: float | None) -> int | None:
        """Wait up to `timeout` s (None: no bound) for the engine process to exit; its exit code, None
        while it runs. Two threads may wait (the reader and `shutdown`): the lock keeps a second
        waitpid from racing the first, which would find the child reaped and read the code as None."""
        with self._wait_lock:
            self._proc.join(timeout)
            return self._proc.exitcode

    def _kill(self) -> None:
        with self._wait_lock:
            if self._proc.is_alive():
                self._proc.kill()
        self._wait_exit(None)
        self._from_engine.close()
        with self._send_lock:
            self._to_engine.close()

    # ------------------------------------------------------------------ reader thread

    def _read(self) -> None:
        """Take the engine's reports until it exits (after `StopEngine`, its last report read) or fails."""
        while True:
            try:
                message = receive(self._from_engine)
            except (EOFError, OSError):
                # After StopEngine the process is exiting: wait for it (its teardown can outlast any
                # fixed bound on a loaded machine; `shutdown` waits too). Else give it 60 s to say how (a
                # process that closed its pipe is exiting; 10 s was outrun once on a loaded 2-core box).
                code = self._wait_exit(None if self._stopping else 60)
                if code == 0:
                    self._exited_cleanly()
                else:
                    self._fail(f"the engine process exited with code {code}")
                self._from_engine.close()
                return
            if isinstance(message, StepReport):
                self._take_report(message)
            elif isinstance(message, EngineFailed):
                self._fail(f"the engine process failed: {message.detail}")
                return

    def _take_report(self, report: StepReport) -> None:
        streams, prompts = self._streams, self._prompts
        posts: list[tuple[OutputStream, RequestOutput]] = []
        for request_id, text, token_ids in zip(report.request_ids, report.texts, report.token_ids):
            stream = streams.get(request_id)
            first = prompts.get(request_id)
            if stream is not None and first is not None:
                posts.append((stream, running_output(request_id, first.prompt, first.prompt_token_ids, text,
                                                     token_ids, None)))
        for out in report.outputs:
            request_id = out.request_id
            if out.finished:
                first = prompts.pop(request_id, None)
                self._num_unfinished -= 1
            elif request_id not in prompts:
                prompts[request_id] = out
            stream = streams.get(request_id)
            if stream is not None:
                posts.append((stream, out))
        for refusal in report.refusals:
            self._num_unfinished -= 1
            stream = streams.get(refusal.request_id)
            if stream is not None:
                stream.fail(refusal.error)
        self._load = report.load
        deliver(posts, self.abort)
        if report.stopping and not self._stopping:
            self._stop_reason = ("the engine process got SIGTERM: it finishes the requests it holds and the server "
                                 "takes no new ones")
            self._stopping = True
            logger.warning("%s (%d in flight)", self._stop_reason, self._num_unfinished)

    def _exited_cleanly(self) -> None:
        """The engine process exited 0: after `StopEngine`, or on a SIGTERM (a service manager signals
        every process of the server) once it had finished its requests. The front takes no more
        requests; a request sent after the engine's last read (possible only after SIGTERM) fails."""
        if not self._stopping:                   # SIGTERM while idle: the process exited without a report
            self._stop_reason = "the engine process got SIGTERM and stopped; the server takes no new requests"
        self._stopping = True
        lost = self._num_unfinished              # sent, and neither finished nor refused by the engine
        if lost:
            logger.error("the engine process stopped (SIGTERM: exit code 0) with %d request(s) it never received; "
                         "they fail", lost)
            self._fail_streams("the engine process stopped on SIGTERM before it received the request", stopped=True)
        elif not self._shutdown_begun:
            logger.warning("the engine process stopped cleanly (SIGTERM: exit code 0, no request in flight); "
                           "the server takes no more requests")

    def _fail(self, reason: str) -> None:
        """The engine process died or failed: fail every stream with EngineDead(reason), take no more
        requests, make sure the process is gone."""
        logger.error("the engine process stopped: %s; every request in flight fails", reason)
        self._failure = reason
        self._fail_streams(reason)
        self._kill()


__all__ = ["AsyncLLMProcess", "EngineStartFailed"]
