"""The routes a prefill server adds (`deepinfer serve --pd-role prefill`, docs/design.md §15):

- GET /v1/pd/info: `{"model", "fingerprint_key"}` of its engine; a decode server compares its own at
  start and refuses another model.
- POST /v1/pd/prefill: a prefill order (`disagg.framing.order_json`); answers the handoff's frames
  (application/octet-stream) once the prompt is prefilled, or an OpenAI-shaped error: 400 a bad order,
  409 another model, 500 the prefill failed, 503 the engine is full or stopped. A decode server that
  closes the connection aborts the prefill.

Both check the server's API key as /v1/* do (`--api-key`: 401 invalid_api_key without
`Authorization: Bearer <key>`); a decode server sends its `--pd-prefill-api-key` (by default its own
`--api-key`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ..disagg.prefill_side import PrefillExports, PrefillRefused, run_prefill
from ..frontends.async_front import EngineClient
from .app import _disconnected
from .errors import APIError


def add_pd_routes(app: FastAPI, llm: EngineClient, exports: PrefillExports) -> None:
    """Add the two routes above to a prefill server's app (`build_app`'s: they check its API key; `llm`
    drives the PROMPT engine whose `KVTransfer` is `exports`); /metrics reads the KV sent from `exports`."""
    server = app.state.server
    server.metrics.transfer_source = exports.stats

    @app.get("/v1/pd/info")
    async def pd_info(request: Request) -> dict[str, Any]:
        server.check_key(request)
        fingerprint = exports.fingerprint
        if fingerprint is None:
            raise APIError(503, "the prefill engine is not built yet")
        return {"model": fingerprint.model, "fingerprint_key": fingerprint.key}

    @app.post("/v1/pd/prefill")
    async def pd_prefill(request: Request) -> Response:
        server.check_key(request)
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "a prefill order is a JSON body") from None
        try:
            answer = await run_prefill(llm, exports, body, _disconnected(request))
        except PrefillRefused as refused:
            if refused.status == 499:
                return Response(status_code=499)          # nobody reads it: the decode server left
            raise APIError(refused.status, str(refused), code="prefill_refused") from None
        return StreamingResponse(answer.stream(), media_type="application/octet-stream")


__all__ = ["add_pd_routes"]
