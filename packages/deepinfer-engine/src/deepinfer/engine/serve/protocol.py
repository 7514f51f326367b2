"""Request bodies of /v1/completions and /v1/chat/completions -> frozen requests with SamplingParams.

Every field is either used, refused with "not supported yet" (unless it holds its neutral value,
e.g. use_beam_search=false; best_of only equal to n), or unknown and refused: none is silently ignored. A bad value is a
400 naming the field (`APIError.param`); the range checks are SamplingParams' own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..sampling.sampling_params import MAX_LOGIT_BIAS_ENTRIES, InvalidSamplingParams, SamplingParams, StructuredOutput
from .errors import APIError, bad_request, from_sampling_error
from .reasoning import thinking_requested
from .tools import ToolsRequest, parse_tools

# Request field -> SamplingParams field (same name): passed as given; null = the default.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "min_tokens", "include_stop_str_in_output", "n", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "allowed_token_ids", "bad_words", "skip_special_tokens",
                   "prompt_logprobs")


def _is(*neutral: object) -> Callable[[object], bool]:
    return lambda value: any(value is n or (type(value) is type(n) and value == n) for n in neutral)


# Fields the engine does not implement yet: accepted only with their neutral value.
NOT_SUPPORTED_YET: dict[str, Callable[[object], bool]] = {
    "length_penalty": _is(None, 1, 1.0),
    "use_beam_search": _is(None, False),
}
COMPLETION_ONLY = {"prompt": None, "echo": _is(None, False), "suffix": _is(None), "logprobs": None}
# tools / tool_choice / parallel_tool_calls are checked by `tools.parse_tools`.
CHAT_ONLY = {"messages": None, "max_completion_tokens": None, "logprobs": None, "top_logprobs": None,
             "chat_template_kwargs": None, "add_generation_prompt": None, "tools": None, "tool_choice": None,
             "parallel_tool_calls": None}
# Used by both endpoints; "user" is an end-user id for the caller's own records (it changes nothing).
COMMON = {"model", "stream", "stream_options", "response_format", "structured_outputs", "user", "best_of",
          "logit_bias", *SAMPLING_FIELDS}


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A checked request of either endpoint.

    Attributes:
        model: the requested model name, or None (= the served one).
        params: the request's SamplingParams (logprobs set when any were asked for).
        stream: answer by server-sent events.
        include_usage: stream_options.include_usage: a last chunk with `usage`.
        prompt: /v1/completions: the prompt text, or its token ids; None for chat.
        messages: /v1/chat/completions: the raw messages (checked when rendered); None otherwise.
        chat_template_kwargs: the chat template's options.
        add_generation_prompt: end the chat prompt where the assistant's answer starts.
        tools: the chat request's tools and tool_choice, or None when it gives no tools.
        structured_param: the field that set the output constraint ("response_format" or
            "structured_outputs"; a forced tool choice is charged to "tool_choice").
    """

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt: str | list[int] | None = None
    messages: list[Any] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: ToolsRequest | None = None
    structured_param: str = "response_format"

    @property
    def structured_field(self) -> str:
        """The request field charged with errors of the output constraint."""
        return "tool_choice" if self.tools is not None and self.tools.forced else self.structured_param


def parse_completion(body: object) -> GenerateRequest:
    """Check a /v1/completions body. Raises: APIError (400) naming the field at fault."""
    body = _object(body)
    _check_fields(body, COMPLETION_ONLY)
    logprobs = body.get("logprobs")
    common = _common(body, default_max_tokens=16, logprobs=logprobs)
    return GenerateRequest(**common, prompt=_prompt(body.get("prompt")))


def parse_chat(body: object) -> GenerateRequest:
    """Check a /v1/chat/completions body. Raises: APIError (400) naming the field at fault."""
    body = _object(body)
    _check_fields(body, CHAT_ONLY)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {'role': ..., 'content': ...} objects", "messages")
    if body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    want = _bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request(f"chat_template_kwargs={kwargs!r} must be an object", "chat_template_kwargs")
    tools = parse_tools(body)
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        if body.get("response_format") is not None or body.get("structured_outputs") is not None:
            raise bad_request(f"tool_choice={body.get('tool_choice')!r} constrains the output itself: it cannot be "
                              "combined with response_format or structured_outputs", "tool_choice")
        if thinking_requested(kwargs):
            raise bad_request(f"tool_choice={body.get('tool_choice')!r} with thinking on is not supported yet (the "
                              "constraint would apply from the first token, leaving no thinking)", "tool_choice")
    common = _common(body, default_max_tokens=None, logprobs=(0 if top is None else top) if want else None,
                     structured=forced)
    return GenerateRequest(**common, messages=messages, chat_template_kwargs=kwargs,
                           add_generation_prompt=_bool(body, "add_generation_prompt", True), tools=tools)


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    return body


def _check_fields(body: dict[str, Any], endpoint_fields: Mapping[str, Callable[[object], bool] | None]) -> None:
    for name, value in body.items():
        neutral = NOT_SUPPORTED_YET.get(name) or endpoint_fields.get(name)
        if name not in COMMON and name not in NOT_SUPPORTED_YET and name not in endpoint_fields:
            raise bad_request(f"{name} is not a known field of this endpoint", name)
        if neutral is not None and not neutral(value):
            raise bad_request(f"{name}={value!r} is not supported yet", name)


def _common(body: dict[str, Any], *, default_max_tokens: int | None, logprobs: Any,
            structured: StructuredOutput | None = None) -> dict[str, Any]:
    """The fields both endpoints share; `structured` (a forced tool choice) replaces response_format."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model={model!r} must be a str", "model")
    stream = _bool(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad_request(f"stream_options={options!r} must be an object with only include_usage", "stream_options")
        if not stream:
            raise bad_request("stream_options needs stream=true", "stream_options")
        include_usage = _bool(options, "include_usage", False, where="stream_options.include_usage")
    fields: dict[str, Any] = {"max_tokens": default_max_tokens}
    fields.update({name: body[name] for name in SAMPLING_FIELDS
                   if name in body and (body[name] is not None or name == "max_tokens")})
    fields["logit_bias"] = _logit_bias(body.get("logit_bias"))
    best_of = body.get("best_of")
    if best_of is not None and best_of != fields.get("n", 1):
        raise bad_request(f"best_of={best_of!r} is not supported yet unless it equals n={fields.get('n', 1)!r} "
                          "(no ranking of extra samples)", "best_of")
    field = "tool_choice" if structured is not None else _structured_field(body)
    try:
        params = SamplingParams(**fields, logprobs=logprobs, structured=structured or _structured(body))
    except InvalidSamplingParams as error:
        raise from_sampling_error(error, field) from None
    return {"model": model, "params": params, "stream": stream, "include_usage": include_usage,
            "structured_param": _structured_field(body)}


def _logit_bias(bias: object) -> dict[int, object] | None:
    """OpenAI's logit_bias: an object of token id (a decimal string, JSON keys being strings) -> bias."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad_request(f"logit_bias={bias!r} must be an object of token id -> bias", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:      # before any key is converted
        raise bad_request(f"logit_bias has {len(bias)} entries: at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
                          "logit_bias")
    result: dict[int, object] = {}
    spelled: dict[int, str] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii() and len(key) <= 20):
            raise bad_request(f"logit_bias key {key[:40]!r} must be a token id (a non-negative integer)", "logit_bias")
        token_id = int(key)
        if token_id in spelled:
            raise bad_request(f"logit_bias keys {spelled[token_id]!r} and {key!r} are the same token id {token_id}",
                              "logit_bias")
        spelled[token_id] = key
        result[token_id] = value
    return result


def _structured_field(body: dict[str, Any]) -> str:
    return "structured_outputs" if body.get("structured_outputs") is not None else "response_format"


def _structured(body: dict[str, Any]) -> StructuredOutput | None:
    """response_format (OpenAI) or structured_outputs (vLLM's spelling) -> StructuredOutput."""
    response_format, vllm = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and vllm is not None:
        raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
    try:
        if vllm is not None:
            if not isinstance(vllm, dict) or set(vllm) - {"json", "regex", "grammar", "choice"}:
                raise bad_request(f"structured_outputs={vllm!r} must be an object with one of json, regex, grammar, "
                                  "choice", "structured_outputs")
            return StructuredOutput(**vllm)
        if response_format is None:
            return None
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutput(json={"type": "object"})
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise bad_request("response_format.json_schema.schema is required (a JSON schema)",
                                  "response_format.json_schema.schema")
            return StructuredOutput(json=schema)
    except InvalidSamplingParams as error:
        raise from_sampling_error(error, _structured_field(body)) from None
    raise bad_request(f"response_format={response_format!r}: type must be 'text', 'json_object' or 'json_schema'",
                      "response_format")


def _bool(body: Mapping[str, Any], name: str, default: bool, *, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{where or name}={value!r} must be true or false", where or name)
    return value


def _prompt(prompt: object) -> str | list[int]:
    """One prompt: a str, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise bad_request("prompt: several prompts in one request are not supported yet", "prompt")
    raise bad_request("prompt must be a non-empty str or a non-empty list of token ids", "prompt")


__all__ = ["APIError", "GenerateRequest", "NOT_SUPPORTED_YET", "parse_chat", "parse_completion"]
