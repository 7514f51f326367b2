"""The OpenAI-compatible HTTP app (FastAPI) over an `EngineClient`: `AsyncLLMProcess` (one engine
process), `AsyncLLM` (one engine in a thread) or `parallel.DPAsyncLLM` (data-parallel ranks).

Routes: POST /v1/completions, POST /v1/chat/completions (server-sent events when "stream": true,
ending with `data: [DONE]`), GET /v1/models, /v1/models/{id}, POST /tokenize, /detokenize
(`utility_routes`), GET /health, /version, /metrics, and FastAPI's /openapi.json and /docs. Errors are
OpenAI-shaped (`errors.APIError`): 400 naming the bad field (a lone surrogate anywhere in the body
included: its path), 401 without the API key, 404 for an unknown model, 413 for a body over
`max_body_bytes`,
503 when the waiting queue is full or the server is draining, 500 naming the cause when the engine
failed (the engine process or a DP rank died; a stream in progress then ends with an error event and
/health answers 503). A client that disconnects aborts its request: from a stream, Starlette cancels the response,
closing `generate`; from a whole response, a watcher of the connection cancels the collecting task.

Chat output goes through `chat_output.OutputParsers` when the server has a reasoning parser or the
request may call tools: tools are rendered by the chat template, and calls and thinking are split
out of the output (`tool_parsers`, `reasoning`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib.metadata import version as package_version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.intake import GRAMMAR_FAILED
from ..core.outputs import FINISH_ERROR, FINISH_IGNORED, RequestOutput
from ..frontends.async_front import EngineClient, EngineDead, EngineQueueFull, EngineStopped
from ..sampling.grammar_backend import StructuredOutputUnavailable
from ..sampling.sampling_params import InvalidSamplingParams
from ..text.chat_messages import InvalidChatRequest, parse_messages
from ..text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from ..text.text_checks import check_prompt_length, find_lone_surrogate
from ..text.tokenizer import require_tokenizer
from .chat_output import OutputParsers
from .errors import APIError, bad_request, from_sampling_error
from .metrics import RequestTracker, ServerMetrics
from .protocol import GenerateRequest, parse_chat, parse_completion
from .reasoning import REASONING_PARSERS, thinking_requested
from .responses import ResponseWriter
from .shutdown import CutRequests, RequestCounts
from .tool_parsers import TOOL_PARSERS, NamedCallParser, RequiredCallsParser, ToolParser
from .utility_routes import add_utility_routes, model_card

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20      # the largest request body read (413 beyond); `build_app(max_body_bytes=...)`
MAX_INT_DIGITS = 100           # the longest integer a JSON body may hold (Python refuses > 4300 with a ValueError)


def check_parser_options(tool_call_parser: str | None, enable_auto_tool_choice: bool,
                         reasoning_parser: str | None) -> None:
    """Raises ValueError for an unknown parser name, or auto tool choice without a tool-call parser."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser={tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser")


class _Server:
    """The state behind the routes: the engine, the served name, the API key, the chat template, the
    output parsers' names, the metrics and the requests in progress (`requests`)."""

    def __init__(self, llm: EngineClient, served_model_name: str, api_key: str | None, chat_template: str | None,
                 tool_call_parser: str | None, enable_auto_tool_choice: bool, reasoning_parser: str | None) -> None:
        self.llm = llm
        self.name = served_model_name
        self._api_key = api_key
        self.metrics = ServerMetrics(llm)
        self.requests = RequestCounts()
        self.created = int(time.time())
        self._template_override = chat_template
        self._template: ChatTemplate | None = None
        self._tool_parser = tool_call_parser if enable_auto_tool_choice else None
        self._reasoning_parser = reasoning_parser

    def template(self) -> ChatTemplate:
        if self._template is None:
            model = self.llm.model
            try:
                self._template = load_chat_template(model.model_dir, embedded=model.embedded,
                                                    override=self._template_override)
            except ChatTemplateError as error:
                raise bad_request(f"chat is not available for this model: {error}", "messages") from None
        return self._template

    def output_parsers(self, req: GenerateRequest) -> OutputParsers | None:
        """How a chat request's output becomes a message; None = all of it is content.

        Raises:
            APIError: 400 when the request leaves the tool choice to the model ("auto") and the server
                was not started with --enable-auto-tool-choice and --tool-call-parser.
        """
        tools = req.tools
        tool_parser: ToolParser | None = None
        if tools is not None and tools.choice == "named":
            assert tools.name is not None
            tool_parser = NamedCallParser(tools.name)
        elif tools is not None and tools.choice == "required":
            tool_parser = RequiredCallsParser()
        elif tools is not None and tools.choice == "auto":
            if self._tool_parser is None:
                raise bad_request('tool_choice="auto" (the default with tools) needs the server started with '
                                  "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
            tool_parser = TOOL_PARSERS[self._tool_parser]()
        reasoning = None
        if self._reasoning_parser is not None:
            reasoning = REASONING_PARSERS[self._reasoning_parser](thinking=thinking_requested(req.chat_template_kwargs))
        if tool_parser is None and reasoning is None:
            return None
        return OutputParsers(reasoning, tool_parser, tools.parallel_tool_calls if tools is not None else True)

    def check_key(self, request: Request) -> None:
        """Raises APIError 401 (invalid_api_key) unless the request carries the server's API key
        (`_bearer_matches`); nothing is checked without one. Every route that needs the key calls
        this (/v1/*, /tokenize, /detokenize, a prefill server's /v1/pd/*)."""
        # A check in each route rather than an HTTP middleware: Starlette's BaseHTTPMiddleware
        # relays every chunk of a streamed response through an extra task, which costs per token.
        if self._api_key is not None and not _bearer_matches(request.headers.get("authorization"), self._api_key):
            raise APIError(401, "a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.name!r}", param="model",
                           code="model_not_found")

    async def generate(self, http: Request, req: GenerateRequest, chat: bool) -> Response:
        self.check_model(req.model)
        field = "messages" if chat else "prompt"
        parsers = self.output_parsers(req) if chat else None
        if chat:
            prompt: Any = await self._rendered_chat(req)
        else:
            prompt = req.prompt if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tracker = self.metrics.track()
        outputs = self.llm.generate(prompt, req.params, request_id, delta=req.stream)
        first = await _first_output(outputs, req, field)
        completion = first.outputs[0]
        if completion.finish_reason == FINISH_IGNORED:
            await outputs.aclose()              # its stream leaves the front now, not when collected
            tracker.finish(FINISH_IGNORED, len(first.prompt_token_ids), 0)
            reason = completion.ignored_reason or ""
            grammar = req.params.structured is not None and reason.startswith(GRAMMAR_FAILED)
            raise bad_request(f"the request was not run: {reason}", req.structured_field if grammar else field)
        writer = ResponseWriter(request_id, self.name, chat, req, self.llm.model.tokenizer, parsers)
        if req.stream:
            return StreamingResponse(self._stream(writer, first, outputs, tracker), media_type="text/event-stream")
        return await self._whole_response(http, writer, first, outputs, tracker)

    async def _rendered_chat(self, req: GenerateRequest) -> dict[str, Any]:
        """`_chat_prompt` off the event loop, its errors as 400s."""
        try:
            return await asyncio.to_thread(self._chat_prompt, req)
        except InvalidChatRequest as error:
            raise bad_request(str(error), error.field) from None
        except (ChatTemplateError, ValueError) as error:
            raise bad_request(str(error), "messages") from None

    async def _whole_response(self, http: Request, writer: ResponseWriter, first: RequestOutput,
                              outputs: AsyncGenerator[RequestOutput, None], tracker: RequestTracker) -> Response:
        """The non-streamed body once the request finishes; the request is aborted if the client leaves."""
        whole = asyncio.ensure_future(self._whole(first, outputs, tracker))
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait((whole, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not whole.done():
                whole.cancel()                  # the client left (or we are cancelled): abort the request
                await asyncio.gather(whole, return_exceptions=True)
        if whole.cancelled():
            return Response(status_code=499)    # nginx's "client closed request"; nobody reads it
        if isinstance(whole.exception(), EngineDead):
            raise APIError(500, str(whole.exception()), code="engine_dead")
        last = whole.result()
        if all(c.finish_reason == FINISH_ERROR for c in last.outputs):    # nothing of it is an answer
            raise APIError(500, f"the engine failed the request: {last.outputs[0].error_reason}",
                           code="request_failed")
        return JSONResponse(writer.full(last))

    def _chat_prompt(self, req: GenerateRequest) -> dict[str, Any]:
        """The rendered chat prompt and its token ids; a text too long for max_model_len tokens is
        refused before it is tokenized (ValueError naming "messages")."""
        model = self.llm.model
        tokenizer = require_tokenizer(model.tokenizer, model.model_dir)
        text = self.template().render(parse_messages(req.messages), add_generation_prompt=req.add_generation_prompt,
                                      options=req.chat_template_kwargs,
                                      tools=req.tools.tools if req.tools is not None else None)
        check_prompt_length(text, tokenizer.max_token_chars, model.max_model_len, "messages")
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    async def _whole(self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None],
                     tracker: RequestTracker) -> RequestOutput:
        last = first
        num_tokens = _num_tokens(first)
        tracker.on_tokens(num_tokens)
        try:
            async for last in outputs:
                tracker.on_tokens(_num_tokens(last) - num_tokens)
                num_tokens = _num_tokens(last)
        finally:
            await outputs.aclose()            # aborts the request unless it finished
            tracker.finish(last.outputs[0].finish_reason or "abort", len(last.prompt_token_ids), num_tokens,
                           last.num_cached_tokens)
        return last

    async def _stream(self, writer: ResponseWriter, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None],
                      tracker: RequestTracker) -> AsyncIterator[str]:
        out, num_tokens, reason, num_cached = first, 0, "abort", 0
        try:
            for chunk in writer.start():
                yield chunk
            while True:
                tracker.on_tokens(_num_tokens(out))
                num_tokens += _num_tokens(out)
                num_cached = max(num_cached, out.num_cached_tokens)
                for chunk in writer.delta(out):
                    yield chunk
                if out.finished:
                    reason = out.outputs[0].finish_reason or "abort"
                    break
                try:
                    out = await anext(outputs)
                except EngineDead as error:        # the headers are sent: the error goes as the last event
                    yield f"data: {json.dumps(APIError(500, str(error), code='engine_dead').body())}\n\n"
                    return
            for chunk in writer.end(len(first.prompt_token_ids), num_tokens, num_cached):
                yield chunk
        finally:
            await outputs.aclose()            # aborts the request unless it finished
            tracker.finish(reason, len(first.prompt_token_ids), num_tokens, num_cached)


def build_app(llm: EngineClient, *, served_model_name: str, api_key: str | None = None,
              chat_template: str | None = None, drain_on_shutdown: bool = True, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `llm` under `served_model_name`.

    Args:
        api_key: when set, /v1/* needs `Authorization: Bearer <api_key>` (401 otherwise; the scheme
            in any case, spaces around the key ignored; a key anywhere else, the query string
            included, does not count).
        chat_template: a named chat template or a jinja file; None = the model folder's.
        drain_on_shutdown: at shutdown (SIGTERM), let accepted requests finish before the engine
            stops (else abort them). Requests that uvicorn's graceful shutdown cut (its
            timeout_graceful_shutdown, `--shutdown-timeout-s`) are aborted in any case
            (`shutdown.CutRequests`; their number is `app.state.server.requests.num_cut` once the server
            has stopped).
        tool_call_parser: finds tool calls in the output of tool_choice="auto" requests (a name of
            `tool_parsers.TOOL_PARSERS`: "deepseek_v4", "hermes"); used with enable_auto_tool_choice.
        enable_auto_tool_choice: accept tool_choice="auto" (else such requests get 400).
        reasoning_parser: splits the thinking into reasoning_content ("deepseek_v4"); None = none.
        max_body_bytes: the largest request body read (413 beyond, before it is parsed).
    Raises:
        ValueError: as `check_parser_options`, or max_body_bytes < 1.
    """
    check_parser_options(tool_call_parser, enable_auto_tool_choice, reasoning_parser)
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r} must be an int >= 1")
    server = _Server(llm, served_model_name, api_key, chat_template, tool_call_parser, enable_auto_tool_choice,
                     reasoning_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        num_cut = server.requests.num_open_or_cut
        if num_cut:
            logger.warning("%d request(s) still open when the graceful shutdown timed out were cut; the engine "
                           "aborts them and stops", num_cut)
        await llm.shutdown(drain=drain_on_shutdown and not num_cut)

    app = FastAPI(title="DeepInfer", lifespan=lifespan, redoc_url=None)      # /docs and /openapi.json
    app.state.server = server
    app.add_middleware(CutRequests, counts=server.requests)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def _internal(_: Request, error: Exception) -> JSONResponse:
        # Reached only by a fault outside the routes' own guard (`_internal_errors_answered`):
        # Starlette re-raises after this answer, and uvicorn then closes the connection.
        logger.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {type(error).__name__}: {error}").body(), status_code=500)

    check_key = server.check_key

    @app.post("/v1/completions")
    @_internal_errors_answered
    async def completions(request: Request) -> Response:
        check_key(request)
        return await server.generate(request, parse_completion(await _json_body(request, max_body_bytes)), chat=False)

    @app.post("/v1/chat/completions")
    @_internal_errors_answered
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        return await server.generate(request, parse_chat(await _json_body(request, max_body_bytes)), chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request)
        return {"object": "list", "data": [model_card(server.name, server.created, llm.model.max_model_len)]}

    add_utility_routes(app, server, check_key, lambda request: _json_body(request, max_body_bytes))

    @app.get("/health")
    async def health() -> Response:
        if llm.is_running:
            return JSONResponse({"status": "ok"})
        failure = llm.failure
        body = {"status": "engine stopped"} if failure is None else {"status": "engine failed", "error": failure}
        return JSONResponse(body, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version("deepinfer-engine")}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _internal_errors_answered(route: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """`route` with any exception other than an APIError answered as a 500 APIError naming it. An
    exception that reaches Starlette's catch-all handler is re-raised to uvicorn after the answer,
    and uvicorn closes the connection: the client's next request on it (keep-alive) would fail."""
    @functools.wraps(route)
    async def guarded(*args: Any, **kwargs: Any) -> Response:
        try:
            return await route(*args, **kwargs)
        except APIError:
            raise
        except Exception as error:
            logger.exception("request failed")
            raise APIError(500, f"internal error: {type(error).__name__}: {error}") from None
    return guarded


def _bearer_matches(header: str | None, api_key: str) -> bool:
    """`Authorization: Bearer <api_key>`: the scheme in any case, spaces around the key ignored;
    compared in constant time."""
    scheme, _, key = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode())


async def _first_output(outputs: AsyncGenerator[RequestOutput, None], req: GenerateRequest,
                        field: str) -> RequestOutput:
    """The request's first output; the front's and the engine's refusals as API errors."""
    try:
        return await anext(outputs)
    except EngineQueueFull as error:
        raise APIError(503, str(error), code="queue_full") from None
    except EngineDead as error:
        raise APIError(500, str(error), code="engine_dead") from None
    except EngineStopped as error:
        raise APIError(503, str(error), code="shutting_down") from None
    except StructuredOutputUnavailable as error:
        raise bad_request(str(error), req.structured_field) from None
    except InvalidSamplingParams as error:          # checked against the model: logit_bias ids, ...
        raise from_sampling_error(error, req.structured_field) from None
    except ValueError as error:
        raise bad_request(str(error), field) from None


def _num_tokens(out: RequestOutput) -> int:
    """Output tokens of every sample (of a cumulative output: all so far; of a delta: the new ones)."""
    return sum(len(c.token_ids) for c in out.outputs)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read: only that is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _BodyError(ValueError):
    """A JSON body the server refuses although `json` would read it (duplicate keys, huge integers)."""


def _object_without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise _BodyError(f"the key {ascii(duplicate)} appears twice in one object")
    return obj


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _BodyError(f"it holds an integer of {len(digits.lstrip('-'))} digits; at most {MAX_INT_DIGITS} "
                         "are allowed")
    return int(digits)


async def _json_body(request: Request, max_bytes: int) -> object:
    """The request's JSON body, read up to `max_bytes` (413 beyond) and checked: valid UTF-8 JSON
    with no duplicate keys, no integer of more than MAX_INT_DIGITS digits and no lone surrogate in
    any string (a 400 naming where it is)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks), object_pairs_hook=_object_without_duplicate_keys, parse_int=_bounded_int)
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply", None) from None
    except ValueError as error:      # JSONDecodeError, UnicodeDecodeError, _BodyError
        raise bad_request(f"the request body is not valid JSON: {error}", None) from None
    where = find_lone_surrogate(body)
    if where is not None:
        raise bad_request(f"{where or 'the request body'} holds a lone surrogate (a \\ud800-\\udfff escape "
                          "not paired into one character): not valid Unicode text", where or None)
    return body


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than {max_bytes} bytes (the server's limit)",
                    code="request_too_large")
