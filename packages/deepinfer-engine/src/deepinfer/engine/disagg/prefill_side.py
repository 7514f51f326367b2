"""The prefill server's side of a pair (`deepinfer serve --pd-role prefill`): `PrefillExports`, the
PROMPT engine's `kv_handoff.KVTransfer`, which keeps each prefilled request until the HTTP request that
ordered it takes it, and `run_prefill`, what POST /v1/pd/prefill does (the route itself is
`serve.pd_routes`'s). The engine steps in a thread of the server's process (`AsyncLLM`), so a handoff
never crosses a process boundary before it goes on the wire."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass

from ..core.kv_handoff import ModelFingerprint, PrefilledRequest, PrefillOrder, TransferFailed
from ..core.outputs import RequestOutput
from ..core.stats import TransferStats
from ..frontends.async_front import EngineClient
from .framing import handoff_frames, order_from_json


class PrefillExports:
    """The `KVTransfer` of a prefill server's PROMPT engine: `send` keeps the handoff of a request some
    HTTP request `expect`s until it `take`s it; `discard` forgets one (its HTTP request left), and a
    handoff made after that (the engine was mid-step when the abort came) is dropped at `send`.
    Thread-safe (the engine thread sends, the event loop takes)."""

    prefills = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handoffs: dict[str, PrefilledRequest | None] = {}     # expected ids; None = not sent yet
        self._stats = TransferStats()
        self.fingerprint: ModelFingerprint | None = None

    def connect(self, fingerprint: ModelFingerprint) -> None:
        self.fingerprint = fingerprint       # the decode servers compare theirs with it (GET /v1/pd/info)

    def expect(self, request_id: str) -> None:
        """A handoff of `request_id` is wanted (before the request is submitted)."""
        with self._lock:
            self._handoffs[request_id] = None

    def send(self, handoff: PrefilledRequest) -> None:
        with self._lock:
            if handoff.request_id in self._handoffs:
                self._handoffs[handoff.request_id] = handoff

    def take(self, request_id: str) -> PrefilledRequest | None:
        """The handoff of `request_id` (None if it never came); the id is no longer expected."""
        with self._lock:
            return self._handoffs.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        self.take(request_id)

    def record(self, num_bytes: int, seconds: float) -> None:
        """A handoff's KV went out: `num_bytes` in `seconds`."""
        with self._lock:
            s = self._stats
            self._stats = TransferStats(s.num_transfers + 1, s.num_bytes + num_bytes, s.seconds + seconds)

    def request_prefill(self, order: PrefillOrder) -> None:
        raise ValueError("a prefill server's engine takes prefills over HTTP (POST /v1/pd/prefill)")

    def cancel(self, request_id: str) -> None:
        self.discard(request_id)

    def poll(self, timeout_s: float) -> list[PrefilledRequest | TransferFailed]:
        return []

    def stats(self) -> TransferStats:
        with self._lock:
            return self._stats

    def __len__(self) -> int:
        """Requests expected or held."""
        with self._lock:
            return len(self._handoffs)


class PrefillRefused(Exception):
    """POST /v1/pd/prefill cannot be served: `status` (400 bad order, 409 another model, 500 the
    prefill failed, 503 the engine is full or stopped) and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True, eq=False)
class PrefillAnswer:
    """A prefilled request ready to go out: its frames (`stream()`), counted in `exports` once written."""

    handoff: PrefilledRequest
    exports: PrefillExports

    def stream(self) -> Iterator[bytes | memoryview]:
        """The frames' buffers; the handoff is counted as the last one goes out (a decode server that has
        read it closes the connection, and Starlette then stops the response before this resumes)."""
        started = time.perf_counter()
        buffers = list(handoff_frames(self.handoff))       # views of the tensors: nothing is copied here
        yield from buffers[:-1]
        kv = self.handoff.kv
        self.exports.record(0 if kv is None else kv.num_bytes, time.perf_counter() - started)
        yield buffers[-1]


async def run_prefill(llm: EngineClient, exports: PrefillExports, body: object,
                      client_gone: Awaitable[None]) -> PrefillAnswer:
    """Prefill one order (the JSON body of POST /v1/pd/prefill) on the PROMPT engine behind `llm`; the
    request is aborted if `client_gone` completes first (the decode server cancelled it).

    Raises:
        PrefillRefused: as its docstring says; nothing is left behind.
    """
    gone = asyncio.ensure_future(client_gone)
    try:
        return await _prefill(llm, exports, body, gone)
    finally:
        gone.cancel()


async def _prefill(llm: EngineClient, exports: PrefillExports, body: object,
                   gone: asyncio.Future[None]) -> PrefillAnswer:
    from ..frontends.async_front import EngineQueueFull, EngineStopped

    try:
        order, asking = order_from_json(body)
    except ValueError as err:
        raise PrefillRefused(400, str(err)) from None
    own = exports.fingerprint
    if own is None or asking.key != own.key:
        mine = "no engine yet" if own is None else f"{own.model} (key {own.key[:12]})"
        raise PrefillRefused(409, f"this prefill server serves {mine}, the decode server {asking.model} (key "
                                  f"{asking.key[:12]}): they cannot hand KV over")
    internal_id = f"pd-{uuid.uuid4().hex}"       # the decode server's ids need not be unique here

    async def prefilled() -> RequestOutput | None:
        last = None
        async for out in llm.generate({"prompt_token_ids": list(order.prompt_token_ids)}, order.params,
                                      internal_id):
            last = out
        return last

    exports.expect(internal_id)
    work = asyncio.ensure_future(prefilled())
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()                       # closes `generate`: the request is aborted
            await asyncio.gather(work, return_exceptions=True)
            raise PrefillRefused(499, "the decode server cancelled the prefill")
        error = work.exception()
        if isinstance(error, EngineQueueFull | EngineStopped):
            raise PrefillRefused(503, f"the prefill engine cannot take it: {error}")
        if isinstance(error, ValueError):
            raise PrefillRefused(400, f"the prefill engine refused it: {error}")
        if error is not None:
            raise error
        handoff = exports.take(internal_id)
        if handoff is None:
            last = work.result()
            sample = None if last is None else last.outputs[0]
            why = "no output" if sample is None else \
                sample.error_reason or sample.ignored_reason or sample.finish_reason
            raise PrefillRefused(500, f"the prefill engine ended the request without a handoff: {why}")
        return PrefillAnswer(dataclasses.replace(handoff, request_id=order.request_id), exports)
    finally:
        exports.discard(internal_id)


__all__ = ["PrefillAnswer", "PrefillExports", "PrefillRefused", "run_prefill"]
