"""Routes beside the OpenAI ones, as vLLM's server has them: POST /tokenize, POST /detokenize and
GET /v1/models/{model_id}. Each checks the API key as the /v1 routes do.

    POST /tokenize   {"prompt": "text", "add_special_tokens": true}
                  or {"messages": [...], "add_generation_prompt": true, "chat_template_kwargs": {...}}
                  -> {"count": n, "max_model_len": m, "tokens": [id, ...]}
    POST /detokenize {"tokens": [id, ...]} -> {"prompt": "text"}

Both take an optional "model" (404 unless it is the served name); any other field is a 400 naming it.
Messages are rendered by the server's chat template, as /v1/chat/completions renders them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request

from ..frontends.async_front import EngineClient
from ..text.chat_messages import InvalidChatRequest
from ..text.chat_template import ChatTemplate, ChatTemplateError, chat_prompt
from ..text.tokenizer import Tokenizer, require_tokenizer
from .errors import APIError, bad_request


class ServedState(Protocol):
    """What these routes read of the server's state (`app._Server`, which registers them)."""

    llm: EngineClient
    name: str
    created: int

    def template(self) -> ChatTemplate: ...

    def check_model(self, model: str | None) -> None: ...

_TOKENIZE_PROMPT = frozenset({"model", "prompt", "add_special_tokens"})
_TOKENIZE_CHAT = frozenset({"model", "messages", "add_generation_prompt", "chat_template_kwargs"})
_DETOKENIZE = frozenset({"model", "tokens"})


def model_card(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    """The /v1/models entry of the served model."""
    return {"id": name, "object": "model", "created": created, "owned_by": "deepinfer", "max_model_len": max_model_len}


def add_utility_routes(app: FastAPI, server: ServedState, check_key: Callable[[Request], None],
                       json_body: Callable[[Request], Awaitable[Any]]) -> None:
    """Add /tokenize, /detokenize and /v1/models/{model_id} to `app`, over `server`'s engine."""

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        check_key(request)
        server.check_model(model_id)
        return model_card(server.name, server.created, server.llm.model.max_model_len)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        check_key(request)
        raw = await json_body(request)
        body = _object(raw, _TOKENIZE_CHAT if isinstance(raw, dict) and "messages" in raw else _TOKENIZE_PROMPT)
        server.check_model(_optional(body, "model", str))
        tokenizer = _tokenizer(server)
        if "messages" in body:        # tokenized off the event loop (a body may hold megabytes of text)
            token_ids = await asyncio.to_thread(_chat_tokens, server, tokenizer, body)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise bad_request(f"prompt={text!r} must be a str (or send messages)", "prompt")
            add_special = _optional(body, "add_special_tokens", bool)
            token_ids = await asyncio.to_thread(tokenizer.encode, text,
                                                add_special_tokens=True if add_special is None else add_special)
        return {"count": len(token_ids), "max_model_len": server.llm.model.max_model_len, "tokens": token_ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        check_key(request)
        body = _object(await json_body(request), _DETOKENIZE)
        server.check_model(_optional(body, "model", str))
        tokenizer = _tokenizer(server)
        tokens = body.get("tokens")
        vocab = tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad_request("tokens must be a list of token ids (ints)", "tokens")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens holds {bad[:3]}: ids must be in [0, {vocab})", "tokens")
        return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}


def _object(body: object, fields: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(f"{unknown[0]} is not a field of this request (fields: {', '.join(sorted(fields))})",
                          unknown[0])
    return body


def _optional(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise bad_request(f"{name}={value!r} must be a {kind.__name__}", name)
    return value


def _tokenizer(server: ServedState) -> Tokenizer:
    model = server.llm.model
    try:
        return require_tokenizer(model.tokenizer, model.model_dir)
    except ValueError as error:
        raise APIError(400, str(error)) from None


def _chat_tokens(server: ServedState, tokenizer: Tokenizer, body: dict[str, Any]) -> list[int]:
    add_generation_prompt = _optional(body, "add_generation_prompt", bool)
    options = _optional(body, "chat_template_kwargs", dict)
    try:
        rendered = chat_prompt(server.template(), tokenizer, body["messages"],
                               add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
                               options=options)
    except InvalidChatRequest as error:
        raise bad_request(str(error), error.field) from None
    except (ChatTemplateError, ValueError) as error:
        raise bad_request(str(error), "messages") from None
    return rendered["prompt_token_ids"]
