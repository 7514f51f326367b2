"""A chat output's text -> the assistant message: reasoning_content, content and tool_calls.

The reasoning parser (when the server has one) splits the thinking off first; the tool parser (when
the request may call tools) splits the calls out of the rest. Whole, `OutputParsers.message` gives
the message; streamed, one `ChoiceStream` per choice reparses the text so far after each delta and
sends what grew: `delta.reasoning_content` / `delta.content` suffixes and `delta.tool_calls` entries
(a new call: index, id, type, name and its arguments so far; then arguments suffixes by index).
Since the parsers' results only extend as the text grows (`tool_parsers`), the deltas of a stream
joined are the whole message.

A choice with tool calls that stopped by itself (EOS, a stop string) finishes with "tool_calls";
one cut by max_tokens keeps "length".
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from .reasoning import ReasoningParser
from .tool_parsers import ParsedCall, ParsedOutput, ToolParser


def new_call_id() -> str:
    """A fresh tool call id ("call_" and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class OutputParsers:
    """How one chat request's output becomes a message.

    Attributes:
        reasoning: splits the thinking off (None = the server has no reasoning parser).
        tools: splits the tool calls out (None = the request may not call tools).
        parallel_tool_calls: False keeps only the first call (the request's parallel_tool_calls).
    """

    reasoning: ReasoningParser | None
    tools: ToolParser | None
    parallel_tool_calls: bool = True

    def parse(self, text: str, *, final: bool) -> tuple[str | None, ParsedOutput]:
        """(reasoning or None, content and calls) of `text`: the whole output when `final`, else a prefix."""
        reasoning, rest = self.reasoning.split(text, final=final) if self.reasoning is not None else (None, text)
        parsed = self.tools.parse(rest, final=final) if self.tools is not None else ParsedOutput(rest)
        if not self.parallel_tool_calls and len(parsed.tool_calls) > 1:
            parsed = ParsedOutput(parsed.content, parsed.tool_calls[:1])
        return reasoning, parsed

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole output (content None when it is empty and there are calls)."""
        reasoning, parsed = self.parse(text, final=True)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": parsed.content or (None if parsed.tool_calls else "")}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tools is not None:
            message["tool_calls"] = [_call_entry(call, new_call_id()) for call in parsed.tool_calls]
        return message


def _call_entry(call: ParsedCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChoiceStream:
    """One streamed choice: feed it each text delta, get the message delta to send."""

    def __init__(self, parsers: OutputParsers) -> None:
        self._parsers = parsers
        self._text = ""
        self._reasoning = ""                   # sent so far
        self._content = ""
        self._calls: list[ParsedCall] = []     # as sent so far (arguments: the sent prefix)

    @property
    def has_tool_calls(self) -> bool:
        """Whether a tool call has been sent."""
        return bool(self._calls)

    def delta(self, text: str, *, final: bool) -> dict[str, Any]:
        """The message delta after `text` (new output text; `final`: the output ended), {} if none."""
        self._text += text
        reasoning, parsed = self._parsers.parse(self._text, final=final)
        delta: dict[str, Any] = {}
        if reasoning and len(reasoning) > len(self._reasoning):
            assert reasoning.startswith(self._reasoning), "reasoning parser result shrank"
            delta["reasoning_content"] = reasoning[len(self._reasoning):]
            self._reasoning = reasoning
        if len(parsed.content) > len(self._content):
            assert parsed.content.startswith(self._content), "tool parser content shrank"
            delta["content"] = parsed.content[len(self._content):]
            self._content = parsed.content
        assert len(parsed.tool_calls) >= len(self._calls), "tool calls disappeared"
        entries = []
        for index, call in enumerate(parsed.tool_calls):
            if index == len(self._calls):
                entries.append({"index": index, **_call_entry(call, new_call_id())})
                self._calls.append(call)
                continue
            sent = self._calls[index]
            assert call.name == sent.name and call.arguments.startswith(sent.arguments), "tool call changed"
            if len(call.arguments) > len(sent.arguments):
                entries.append({"index": index, "function": {"arguments": call.arguments[len(sent.arguments):]}})
                self._calls[index] = call
        if entries:
            delta["tool_calls"] = entries
        return delta
