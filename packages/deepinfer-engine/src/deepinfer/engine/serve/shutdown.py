"""The bound on a SIGTERM drain (`deepinfer serve --shutdown-timeout-s`, docs/reliability.md §6a).

uvicorn's graceful shutdown waits for every request in flight; with `timeout_graceful_shutdown` set
(`server.uvicorn_config`) it cancels the tasks of those still running after that many seconds (a
client that never reads its stream, a request that runs long). `CutRequests` wraps the app to tell
them apart: a cancelled request task is counted as cut and ends without an error of its own (a request
whose response had not started gets a 503 `shutting_down`; a started one has its connection closed by
uvicorn), and the app's shutdown then stops the engine without draining (`CutRequests.num_open_or_cut`),
which aborts the requests cut.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_CUT = APIError(503, "the server shut down before this request finished (its drain reached --shutdown-timeout-s)",
                code="shutting_down")


class RequestCounts:
    """The HTTP requests in progress and those cut, kept by `CutRequests` and read by the app's shutdown
    and `server.serve_client`."""

    def __init__(self) -> None:
        self.num_open = 0     # request tasks running
        self.num_cut = 0      # request tasks cancelled (only uvicorn's shutdown timeout cancels them), ended

    @property
    def num_open_or_cut(self) -> int:
        """Requests cut so far. Once uvicorn's graceful shutdown has ended, every request still open was
        cut (it waits for all of them otherwise) and is counted, whether or not its task has ended yet."""
        return self.num_open + self.num_cut


class CutRequests:
    """ASGI middleware counting `counts` (pure ASGI: it adds one call per response message, not a task
    per chunk as Starlette's BaseHTTPMiddleware would).

    Args:
        app: the wrapped ASGI app.
        counts: where the counts go.
    """

    def __init__(self, app: ASGIApp, counts: RequestCounts) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        cut = False
        self.counts.num_open += 1
        try:
            await self.app(scope, receive, tracked_send)
        except asyncio.CancelledError:
            # uvicorn cancels a request's task only when its graceful shutdown timed out. Ended here,
            # not re-raised: uvicorn would log the cancellation's traceback for every request cut.
            cut = True
            if not started:
                await send({"type": "http.response.start", "status": _CUT.status,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": json.dumps(_CUT.body()).encode()})
        finally:
            self.counts.num_open -= 1
            self.counts.num_cut += cut


__all__ = ["CutRequests", "RequestCounts"]
