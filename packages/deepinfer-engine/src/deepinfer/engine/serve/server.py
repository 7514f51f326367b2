"""Run the app under uvicorn: `serve_client(AsyncLLMProcess(args), ServeOptions(...))` (one engine
process, `deepinfer serve`'s default), `serve_client(DPAsyncLLM(args), ...)` (DP ranks) or
`run_server(engine, ServeOptions(...))` (the engine in a thread of this process) blocks until SIGINT
/ SIGTERM.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits for the responses in flight
(streams included), for up to `ServeOptions.shutdown_timeout_s`; the app's shutdown then waits until
every accepted request has finished and stops the engine process, the engine thread or the DP ranks
(`shutdown(drain=True)`), and `run_server` returns, so that `deepinfer serve` exits 0 after a drain
(uvicorn would re-raise the signal and die by it). Requests still running when the timeout ends (a
client that never reads its stream holds its response open) are cut: uvicorn cancels them and
closes their connections, the engine aborts them instead of draining (`shutdown.CutRequests`), and
the return value counts them (`ServeEnd.num_cut`); the process still exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..frontends.async_front import DEFAULT_MAX_NUM_WAITING, EngineClient
from ..frontends.async_llm import AsyncLLM
from ..llm_engine import LLMEngine
from .app import build_app, check_parser_options
from .flags import SHUTDOWN_TIMEOUT_S

HEADER_TIMEOUT_S = 15.0      # a connection's request headers must be complete this long after it opened
KEEP_ALIVE_TIMEOUT_S = 30.0  # an idle keep-alive connection is closed after this


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """How `deepinfer serve` listens and answers.

    Attributes:
        host: address to bind ("127.0.0.1" = this machine only; "0.0.0.0" = every interface).
        port: TCP port, in [0, 65535] (0 = any free port).
        served_model_name: the model name clients send and /v1/models lists.
        api_key: when set, /v1/* needs `Authorization: Bearer <api_key>`.
        chat_template: a named chat template ("deepseek_v4", "plain") or a jinja file; None = the model folder's.
        max_num_waiting: requests accepted but not running before new ones get 503.
        log_level: uvicorn's log level ("info", "warning", ...).
        tool_call_parser: "deepseek_v4" or "hermes": finds tool calls in tool_choice="auto" output.
        enable_auto_tool_choice: accept tool_choice="auto" (needs tool_call_parser).
        reasoning_parser: "deepseek_v4": thinking goes to reasoning_content; None = none.
        enable_log_requests: uvicorn's access log, one line per HTTP request (at log_level "info").
        shutdown_timeout_s: on SIGTERM, how long the requests in flight may take to finish (> 0,
            finite); those still running then are cut (module docstring).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "deepinfer"
    api_key: str | None = None
    chat_template: str | None = None
    max_num_waiting: int = DEFAULT_MAX_NUM_WAITING
    log_level: str = "info"
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    enable_log_requests: bool = False
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port!r} must be an int in [0, 65535]")
        if isinstance(self.max_num_waiting, bool) or not isinstance(self.max_num_waiting, int) or \
                self.max_num_waiting < 1:
            raise ValueError(f"max_num_waiting={self.max_num_waiting!r} must be an int >= 1")
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError(f"served_model_name={self.served_model_name!r} must be a non-empty str")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty str or None")
        check_parser_options(self.tool_call_parser, self.enable_auto_tool_choice, self.reasoning_parser)
        timeout = self.shutdown_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ValueError(f"shutdown_timeout_s={timeout!r} must be a number of seconds > 0 (and finite)")


@dataclass(frozen=True, slots=True)
class ServeEnd:
    """How a server stopped (`serve_client`, `run_server`).

    Attributes:
        failure: why the engine had failed (`EngineClient.failure`); None after a clean stop.
        num_cut: requests still running when the SIGTERM drain reached shutdown_timeout_s: their
            connections were closed and the engine aborted them; 0 when every request finished.
    """

    failure: str | None
    num_cut: int


def run_server(engine: LLMEngine, options: ServeOptions) -> ServeEnd:
    """Serve `engine`, stepped in a thread of this process (`AsyncLLM`), over HTTP until SIGINT /
    SIGTERM; returns once in-flight requests are done, as `serve_client`."""
    return serve_client(AsyncLLM(engine, max_num_waiting=options.max_num_waiting), options)


def serve_client(llm: EngineClient, options: ServeOptions,
                 extra_routes: Callable[[FastAPI], None] | None = None) -> ServeEnd:
    """Serve `llm` (built with options.max_num_waiting) as `run_server` does; it is shut down on return.
    `extra_routes(app)` adds routes to the app first (a prefill server's, `pd_routes.add_pd_routes`).
    Returns why the engine had failed, if it had, and how many requests the drain cut."""
    app = build_app(llm, served_model_name=options.served_model_name, api_key=options.api_key,
                    chat_template=options.chat_template, tool_call_parser=options.tool_call_parser,
                    enable_auto_tool_choice=options.enable_auto_tool_choice, reasoning_parser=options.reasoning_parser)
    if extra_routes is not None:
        extra_routes(app)
    config = uvicorn_config(app, host=options.host, port=options.port, log_level=options.log_level,
                            access_log=options.enable_log_requests, shutdown_timeout_s=options.shutdown_timeout_s)
    with _signals_end_quietly():
        uvicorn.Server(config).run()
    return ServeEnd(llm.failure, app.state.server.requests.num_cut)


def uvicorn_config(app: Callable[..., Any], *, host: str = "127.0.0.1", port: int = 0, log_level: str = "info",
                   access_log: bool = False, header_timeout_s: float = HEADER_TIMEOUT_S,
                   keep_alive_timeout_s: float = KEEP_ALIVE_TIMEOUT_S,
                   shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> uvicorn.Config:
    """How `deepinfer serve` runs uvicorn: HTTP/1.1 through h11 (`_H11WithHeaderTimeout`), an access log
    only with access_log (`--enable-log-requests`);
    an idle keep-alive connection is closed after keep_alive_timeout_s, and a connection whose
    request headers are not complete header_timeout_s after it opened (or after its previous
    response) is closed; a graceful shutdown (SIGTERM) waits up to shutdown_timeout_s for the requests
    in flight, then cancels those left (module docstring)."""
    protocol = type("H11Protocol", (_H11WithHeaderTimeout,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log, http=protocol,
                          timeout_keep_alive=keep_alive_timeout_s,  # type: ignore[arg-type]  # typed int, a float delay
                          timeout_graceful_shutdown=shutdown_timeout_s)  # type: ignore[arg-type]  # the same


class _H11WithHeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for request headers. uvicorn arms no timer while a
    connection waits for its first request, and the keep-alive timer it arms after a response is
    cancelled by any byte received: a client that opens connections (or sends a partial header line)
    and stops would hold them forever."""

    header_timeout_s: float = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self.loop.call_later(self.header_timeout_s, self._header_deadline, self.cycle)

    def _header_deadline(self, cycle: object) -> None:
        """No request started since the deadline was armed (the same finished cycle, or none): close."""
        idle = cycle is None or cycle.response_complete  # type: ignore[attr-defined]
        if self.cycle is cycle and idle and not self.transport.is_closing():
            self.transport.close()


@contextlib.contextmanager
def _signals_end_quietly() -> Iterator[None]:
    """While serving, SIGINT / SIGTERM belong to uvicorn (graceful shutdown); the handler it restores
    and re-raises into afterwards is this no-op, so a drained server returns instead of dying."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
