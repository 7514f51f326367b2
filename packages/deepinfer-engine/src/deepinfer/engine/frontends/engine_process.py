"""The engine process of `deepinfer serve`: one `LLMEngine` stepped in a process of its own, so that
the HTTP server's per-token Python (server-sent events, stream wake-ups, metrics) runs beside it on
another core instead of taking turns with it for one interpreter lock. `async_process.AsyncLLMProcess`
is the front that spawns it; this module is the child's side and what travels between the two.

Front -> engine, over one pipe: `SubmitRequest`, `AbortRequests`, `StopEngine`. Engine -> front,
over another: `EngineReady` once, then one `StepReport` per engine step (and one after taking
requests it refused), or `EngineFailed` before the process exits on an error. Each message is one
pickle written with `Connection.send_bytes`, by the thread that made it (no feeder thread beside
the engine loop).

The loop (`core_loop.run_loop`, `EngineLoop` its transport): take every message waiting (new
requests into the engine with DELTA outputs, aborts applied); step while the engine has work and
report the step; with no work, block on the pipe. A
report carries the common output, a running request of one sample without logprobs whose prompt
the front has already seen, as three flat columns (id, new text, new token ids) and every other
output whole. The process ignores SIGINT (a Ctrl-C reaches the whole process group: the front
drains); SIGTERM (a service manager may send it to every process of the server) makes it finish the
requests it holds, as `StopEngine` does, then exit: its next report says so (`StepReport.stopping`,
the front takes no more requests), and a request that reaches it after the signal is refused with
`EngineStopped`. When the front's end of the pipe closes (the front died) it exits.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..config.engine_args import EngineArgs
from ..core.intake import PromptInput
from ..core.kv_handoff import KVTransfer, NullKVTransfer
from ..core.outputs import OutputKind, RequestOutput
from ..core.prefix_caching import host_cache_stats
from ..core.stats import HostCacheStats, TransferStats
from ..sampling.sampling_params import SamplingParams
from .async_front import EngineStopped
from .core_loop import run_loop

# ------------------------------------------------------------------ front -> engine


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """A new request: queued in the engine with DELTA outputs, or refused (`Refused`)."""

    request_id: str
    prompt: PromptInput | Sequence[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """Abort these requests (unknown or finished ids are ignored); each reports its finished output."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StopEngine:
    """Finish every request taken, report, and exit (the front sends nothing after it)."""


# ------------------------------------------------------------------ engine -> front


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The scheduler and KV cache after the latest step."""

    num_running: int
    num_free_kv_blocks: int
    num_kv_blocks: int            # usable blocks (block 0 excluded)
    host_cache: HostCacheStats = HostCacheStats()
    kv_transfer: TransferStats | None = None     # a prefill/decode pair's engine: KV handed over so far


@dataclass(frozen=True, slots=True)
class EngineReady:
    """The engine is built; what the front and the command line show of it."""

    model_dir: Path
    max_model_len: int
    load_seconds: float
    weight_bytes: int
    pid: int
    load: EngineLoad


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused a request (nothing was queued); `error` is raised to its caller."""

    request_id: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one engine step produced.

    Attributes:
        request_ids, texts, token_ids: the step's common DELTA outputs as columns: a running request
            with one sample and no logprobs, after its first output; its new text and new token ids.
        outputs: every other DELTA output of the step, whole (a request's first output, which
            carries its prompt; finished ones; n > 1; logprobs; prompt logprobs).
        refusals: requests refused since the previous report.
        load: the engine after the step.
        stopping: the process got SIGTERM: it finishes the requests it holds, refuses new ones and exits.
    """

    request_ids: tuple[str, ...]
    texts: tuple[str, ...]
    token_ids: tuple[list[int], ...]
    outputs: tuple[RequestOutput, ...]
    refusals: tuple[Refused, ...]
    load: EngineLoad
    stopping: bool = False


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The engine process failed and is exiting; `detail` is the exception's one-line text."""

    detail: str


def send(conn: Connection, message: object) -> None:
    """Write one message (one pickle) to `conn`."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    """Read one message from `conn` (blocks). Raises EOFError once the other end is closed."""
    return pickle.loads(conn.recv_bytes())


def picklable_error(err: BaseException) -> BaseException:
    """`err` itself when it survives pickling (to be raised in the front as the same type), else a
    RuntimeError with its type and text."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


# ------------------------------------------------------------------ the child


def engine_process_main(args: EngineArgs, inbox: Connection, outbox: Connection,
                        kv_transfer_factory: Callable[[], KVTransfer] | None = None) -> None:
    """The entry point of the engine process: build the engine (with `kv_transfer_factory()` as its
    `KVTransfer` when given: a decode server's), report `EngineReady`, serve until `StopEngine` (exit
    0) or the front's end closes. An error goes to `outbox` as `EngineFailed`, and the process exits
    with status 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from ..llm_engine import LLMEngine

        engine = LLMEngine(args, kv_transfer=None if kv_transfer_factory is None else kv_transfer_factory())
        send(outbox, EngineReady(Path(engine.model_dir), engine.max_model_len, engine.load_seconds,
                                 engine.weight_bytes, os.getpid(), engine_load(engine)))
        loop = EngineLoop(engine, inbox, outbox)
        signal.signal(signal.SIGTERM, loop.on_sigterm)
        loop.run()
    except (EOFError, SystemExit):   # the front is gone (nobody to report to), or SIGTERM while idle
        raise SystemExit(0) from None
    except BaseException as err:     # reported to the front, then the process exits
        detail = " ".join("".join(traceback.format_exception_only(type(err), err)).split())
        try:
            send(outbox, EngineFailed(detail))
        except OSError:
            pass
        raise SystemExit(1) from None


class EngineLoop:
    """The serving loop of the engine process (module docstring).

    Args:
        engine: the engine (an `LLMEngine`), driven only by this loop.
        inbox: the front's messages.
        outbox: this process's reports.
    """

    def __init__(self, engine: Any, inbox: Connection, outbox: Connection) -> None:
        self._engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._stopping = False                    # StopEngine or SIGTERM: finish, refuse new requests, exit
        self._signalled = False                   # SIGTERM came
        self._said_stopping = False               # a report told the front
        self._refusals: list[Refused] = []
        self._reported: set[str] = set()          # requests whose first output was sent (whole)
        self._load = engine_load(engine)          # as last reported
        self._idle = False                        # blocked on the inbox with no work

    def run(self) -> None:
        """Serve until `StopEngine` and no work is left (returns). Raises EOFError when the front's
        end of the pipe closes."""
        run_loop(self._engine.step, self)

    # ------------------------------------------------------------------ core_loop.Transport

    def poll(self) -> None:
        """Take every message waiting; report the requests refused, and a SIGTERM not yet told."""
        while self._inbox.poll():
            self._take(receive(self._inbox))
        if self._refusals or self._signalled != self._said_stopping:
            self._report([])

    def has_work(self) -> bool:
        return self._engine.has_unfinished_requests()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self._report(outputs)

    def idle(self) -> bool:
        """No work: end after `StopEngine`, else report the state the metrics show while idle and
        sleep on the pipe until the front says something."""
        if self._stopping:
            return False
        if engine_load(self._engine) != self._load:
            self._report([])
        self._idle = True
        message = receive(self._inbox)
        self._idle = False
        self._take(message)
        return True

    def on_sigterm(self, signum: int, frame: object) -> None:
        """SIGTERM: no work -> exit now (SystemExit); else exit once the requests taken have finished,
        refusing new ones (the next `poll` tells the front). Nothing is sent from here: the handler
        may run in the middle of a send."""
        self._stopping = self._signalled = True
        if self._idle:
            raise SystemExit(0)

    def _take(self, message: object) -> None:
        engine = self._engine
        if isinstance(message, SubmitRequest):
            if self._stopping:   # after SIGTERM (the front sends nothing after StopEngine)
                self._refusals.append(Refused(message.request_id, EngineStopped(
                    "the engine process got SIGTERM: it finishes the requests it had taken and takes no new ones")))
                return
            try:
                engine.add_request(message.request_id, message.prompt, message.params, output_kind=OutputKind.DELTA)
            except Exception as err:   # refused: nothing was queued; the caller gets the error
                self._refusals.append(Refused(message.request_id, picklable_error(err)))
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                engine.abort_request(request_id)
        elif isinstance(message, StopEngine):
            self._stopping = True
        else:
            raise TypeError(f"unexpected message from the front: {type(message).__name__}")

    def _report(self, outputs: list[RequestOutput]) -> None:
        request_ids: list[str] = []
        texts: list[str] = []
        token_ids: list[list[int]] = []
        whole: list[RequestOutput] = []
        reported = self._reported
        for out in outputs:
            request_id = out.request_id
            samples = out.outputs
            if out.finished:
                reported.discard(request_id)
                whole.append(out)
            elif request_id in reported and len(samples) == 1 and samples[0].logprobs is None and \
                    out.prompt_logprobs is None:
                request_ids.append(request_id)
                texts.append(samples[0].text)
                token_ids.append(samples[0].token_ids)
            else:
                reported.add(request_id)
                whole.append(out)
        self._load = engine_load(self._engine)
        refusals, self._refusals = tuple(self._refusals), []
        self._said_stopping = self._signalled
        send(self._outbox, StepReport(tuple(request_ids), tuple(texts), tuple(token_ids), tuple(whole), refusals,
                                      self._load, self._signalled))


def engine_load(engine: Any) -> EngineLoad:
    """The engine's scheduler and KV cache now."""
    kv = engine.kv_blocks
    return EngineLoad(engine.scheduler.num_running, kv.num_free, kv.num_blocks - 1,
                      host_cache_stats(engine.scheduler.prefix_cache_stats), transfer_stats(engine))


def transfer_stats(engine: Any) -> TransferStats | None:
    """The KV an engine of a prefill/decode pair handed over so far; None for one without a transfer
    (`NullKVTransfer`: a NORMAL engine)."""
    transfer = engine.kv_transfer
    return None if isinstance(transfer, NullKVTransfer) else transfer.stats()
