"""deepinfer.engine.serve — the OpenAI-compatible HTTP server (`deepinfer serve`).

    from deepinfer.engine.serve import ServeOptions, run_server, serve_client
    serve_client(AsyncLLMProcess(EngineArgs()), ServeOptions(port=8000))   # blocks; SIGTERM drains (up to
                                                    # shutdown_timeout_s), then returns a ServeEnd
    serve_client(DPAsyncLLM(EngineArgs(data_parallel_size=2)), ServeOptions(port=8000))   # DP ranks
    run_server(LLMEngine(EngineArgs()), ServeOptions(port=8000))      # the engine in a thread of this process

`deepinfer serve` runs the first (the engine in a process of its own, `async_process`), the second
with --data-parallel-size N, the third with --engine-in-thread. `build_app(llm, served_model_name=...)`
over any `async_front.EngineClient` gives the FastAPI app alone (to embed or test).
FastAPI, uvicorn and prometheus_client are imported only when one of these names is first used, so
`import deepinfer.engine` and the CLI's other commands (`deepinfer bench`, `generate`), which read
`serve.flags`, stay light and run where no server dependency is installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import build_app
    from .errors import APIError
    from .protocol import NOT_SUPPORTED_YET
    from .server import ServeEnd, ServeOptions, run_server, serve_client

_EXPORTS = {
    "NOT_SUPPORTED_YET": ".protocol",
    "APIError": ".errors",
    "ServeEnd": ".server",
    "ServeOptions": ".server",
    "build_app": ".app",
    "run_server": ".server",
    "serve_client": ".server",
}
__all__ = ["NOT_SUPPORTED_YET", "APIError", "ServeEnd", "ServeOptions", "build_app", "run_server", "serve_client"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
