"""Tool-call parsers: a model's output text -> its content and OpenAI tool calls, whole or while it streams.

    parser = TOOL_PARSERS["hermes"]()
    parser.parse('Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', final=True)
    -> ParsedOutput(content="Sure.", tool_calls=(ParsedCall("f", '{"x": 1}'),))

`parse(text, final=False)` reads a prefix of the output and returns only what that prefix settles:
text that might still turn into a tool-call marker is held back, and a call appears once its name
is known. A longer prefix only extends the result (the content grows at its end, calls are appended,
only the last call's arguments grow), and the whole output parsed with `final=True` extends every
prefix's result; so a stream that sends the differences sends exactly the whole result.

Parsers, chosen by `deepinfer serve --tool-call-parser NAME`:
- "deepseek_v4": DeepSeek-V4's DSML block (`tool_parser_dsml`);
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes / Qwen style),
  what the "plain" chat template describes to the model.

Two more serve forced tool choices (the output is constrained by a JSON schema, see `tools.py`):
`NamedCallParser` (the output is the arguments of one named function) and `RequiredCallsParser`
(the output is a JSON array of `{"name", "parameters"}`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from .parsed_calls import ParsedCall, ParsedOutput, ToolParser, held_back
from .tool_parser_dsml import DsmlToolParser


def _call_from_object(value: object, arguments_key: str) -> ParsedCall | None:
    """`{"name": str, arguments_key: object or JSON text}` -> a call; anything else -> None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):
        return ParsedCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text.

    A block whose body is not such an object stays in the content, as written; whitespace between
    and after blocks is dropped. A call appears whole, when its closing tag arrives.
    """

    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(self.START, pos)
            gap = text[pos:start] if start >= 0 else text[pos:]
            if start < 0 and not final:
                gap = gap[:len(gap) - held_back(gap, (self.START,))]
            if not calls or gap.strip():      # whitespace after a call is dropped (held while it may be)
                content.append(gap)
            if start < 0:
                break
            end = text.find(self.END, start)
            if end < 0:
                if final:
                    content.append(text[start:])      # an unclosed block is text
                break
            try:
                call = _call_from_object(json.loads(text[start + len(self.START):end]), "arguments")
            except json.JSONDecodeError:
                call = None
            pos = end + len(self.END)
            if call is None:
                content.append(text[start:pos])
            else:
                calls.append(call)
        return ParsedOutput("".join(content), tuple(calls))


class NamedCallParser:
    """The whole output is the JSON arguments of one call to `name` (a named tool_choice)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        return ParsedOutput("", (ParsedCall(self.name, text),))


class RequiredCallsParser:
    """The output is a JSON array of `{"name": str, "parameters": object}` (tool_choice "required").

    Each element becomes a call once it is complete; what follows the last element that parses,
    other than the closing bracket, is content (only a truncated output has any).
    """

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = _skip_space(text, 0)
        if text.startswith("[", pos):
            pos = _skip_space(text, pos + 1)
            while pos < len(text) and text[pos] != "]":
                try:
                    value, end = decoder.raw_decode(text, pos)
                except json.JSONDecodeError:
                    break
                call = _call_from_object(value, "parameters")
                if call is None:
                    break
                calls.append(call)
                pos = _skip_space(text, end)
                if text.startswith(",", pos):
                    pos = _skip_space(text, pos + 1)
            else:
                if pos < len(text):
                    pos = _skip_space(text, pos + 1)       # the closing bracket
        rest = text[pos:] if final else ""
        return ParsedOutput(rest, tuple(calls))


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {"deepseek_v4": DsmlToolParser, "hermes": HermesToolParser}
