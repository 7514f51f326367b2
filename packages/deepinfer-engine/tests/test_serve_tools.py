"""Tool calling and reasoning through `deepinfer serve` with the real `openai` client: the embedded
model served with DeepSeek-V4's chat format, `--tool-call-parser deepseek_v4
--enable-auto-tool-choice --reasoning-parser deepseek_v4`. The model never calls tools by itself, so
forced tool choices (structured output) and a regex-forced thinking section stand in for it; the
parsers on crafted text are tested in test_tool_parsers.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from serve_helpers import start_uvicorn

from deepinfer.engine import EngineArgs
from deepinfer.engine.frontends.async_process import AsyncLLMProcess
from deepinfer.engine.serve import ServeOptions, build_app

pytest.importorskip("xgrammar")
MODEL = "tiny"

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 6}}, "required": ["text"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is 1 + 2?"}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """The server on 127.0.0.1 (a free port), run in a thread (as test_serve_api.start_server)."""
    app = build_app(AsyncLLMProcess(EngineArgs(seed=0, stop_preempted_request=False)), served_model_name=MODEL,
                    chat_template="deepseek_v4", tool_call_parser="deepseek_v4", enable_auto_tool_choice=True,
                    reasoning_parser="deepseek_v4")
    url, server, thread = start_uvicorn(app)
    yield url
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _streamed_calls(chunks: list) -> tuple[list[dict[str, str]], str | None]:
    calls: list[dict[str, str]] = []
    for chunk in chunks:
        for entry in chunk.choices[0].delta.tool_calls or ():
            if entry.index == len(calls):
                calls.append({"name": entry.function.name, "arguments": entry.function.arguments or ""})
            else:
                calls[entry.index]["arguments"] += entry.function.arguments
    return calls, chunks[-1].choices[0].finish_reason


def test_a_named_tool_choice_gives_a_valid_call_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": ASK, "tools": [ADD, ECHO], "max_tokens": 40, "temperature": 0,
              "tool_choice": {"type": "function", "function": {"name": "add"}}}
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"a", "b"} and all(type(v) is int for v in arguments.values())
    calls, reason = _streamed_calls(list(client.chat.completions.create(**kwargs, stream=True)))
    assert calls == [{"name": "add", "arguments": call.function.arguments}] and reason == "tool_calls"


def test_required_tool_choice_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[ADD, ECHO], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    arguments = json.loads(call.arguments)
    if call.name == "add":
        assert set(arguments) == {"a", "b"} and all(type(v) is int for v in arguments.values())
    else:
        assert call.name == "echo" and isinstance(arguments["text"], str) and len(arguments["text"]) <= 6


def test_reasoning_content_is_split_from_the_answer_whole_and_streamed(client: openai.OpenAI) -> None:
    # thinking on: the prompt ends with <think>; the regex makes the model close it like V4 does
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
              "extra_body": {"chat_template_kwargs": {"thinking": True},
                             "structured_outputs": {"regex": "[a-z]{2,6}</think>[a-z]{2,6}"}}}
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert 2 <= len(reasoning) <= 6 and reasoning.isalpha() and 2 <= len(message.content) <= 6
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           temperature=0).choices[0].message
    assert plain.model_extra["reasoning_content"] is None and plain.content       # thinking off: all answer


def test_auto_tool_choice_without_a_call_answers_text_and_tool_history_is_accepted(client: openai.OpenAI) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[ADD], max_tokens=4, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content and not choice.message.tool_calls


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0]"),
    ({"tools": {"add": ADD}}, "tools"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "required", "chat_template_kwargs": {"thinking": True}}, "tool_choice"),
])
def test_bad_tool_fields_get_400_naming_the_field(base_url: str, fields: dict, param: str) -> None:
    reply = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **fields})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_parser_options_are_checked() -> None:
    with pytest.raises(ValueError, match="tool_call_parser='qwen'"):
        ServeOptions(tool_call_parser="qwen")
    with pytest.raises(ValueError, match="reasoning_parser='r1'"):
        ServeOptions(reasoning_parser="r1")
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ServeOptions(enable_auto_tool_choice=True)
    assert ServeOptions(tool_call_parser="hermes", enable_auto_tool_choice=True).tool_call_parser == "hermes"
