"""Chat messages in OpenAI's shape, checked once into frozen `ChatMessage`s.

    parse_messages([{"role": "user", "content": "hi"}]) -> (ChatMessage(role="user", content="hi"),)

`content` may be a str, None (an assistant turn that only calls tools) or a list of
`{"type": "text", "text": ...}` parts (joined with no separator); other part types (images, audio)
are refused, never dropped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 512
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_FIELDS = frozenset({"type", "function"})
_FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})

MAX_MESSAGES = 4096
# OpenAI's chat roles; a chat template may take fewer (deepseek_v4 refuses "function"-style roles).
ROLES = ("system", "developer", "user", "assistant", "tool")


class InvalidChatRequest(ValueError):
    """A chat request is malformed; `field` names the offending field (e.g. "messages[1].content")."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call made by an assistant turn: its name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a conversation.

    Attributes:
        role: one of `ROLES` ("system", "developer", "user", "assistant", "tool"; a template may take fewer).
        content: the text ("" for None).
        reasoning_content: an assistant turn's reasoning (thinking), or None.
        tool_calls: an assistant turn's function calls.
        tool_call_id: a tool result's call id, or None.
        name: the author's name, or None.
    """

    role: str
    content: str
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI-shaped dict a jinja chat template reads (unset optional fields left out)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


_FIELDS = frozenset({"role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name"})


def parse_messages(messages: object) -> tuple[ChatMessage, ...]:
    """Check OpenAI-shaped messages (a list of dicts, or ChatMessages) and freeze them.

    Raises:
        InvalidChatRequest: not a non-empty list of at most MAX_MESSAGES messages, or a message with
            an unknown field, a role not in `ROLES`, or content that is not text; `field` names it.
    """
    if isinstance(messages, str | bytes | dict) or not isinstance(messages, Sequence) or not messages:
        raise InvalidChatRequest("messages must be a non-empty list of {'role': ..., 'content': ...} objects",
                                 "messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidChatRequest(f"messages holds {len(messages)} messages; at most {MAX_MESSAGES} are allowed",
                                 "messages")
    return tuple(m if isinstance(m, ChatMessage) else _parse_one(i, m) for i, m in enumerate(messages))


def _parse_one(index: int, message: object) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidChatRequest(f"{where} must be an object with 'role' and 'content'", where)
    unknown = sorted(set(message) - _FIELDS)
    if unknown:
        raise InvalidChatRequest(f"{where}.{unknown[0]} is not supported", f"{where}.{unknown[0]}")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidChatRequest(f"{where}.role={role!r} must be one of {', '.join(ROLES)}", f"{where}.role")
    reasoning = _optional_str(message, "reasoning_content", where)
    return ChatMessage(role, _content(message.get("content"), f"{where}.content"), reasoning,
                       _tool_calls(message.get("tool_calls"), f"{where}.tool_calls"),
                       _optional_str(message, "tool_call_id", where), _optional_str(message, "name", where))


def _optional_str(message: dict[str, Any], key: str, where: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidChatRequest(f"{where}.{key}={value!r} must be a str", f"{where}.{key}")
    return value


def _content(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidChatRequest(f"{where} must be a str or a list of text parts", where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidChatRequest(f"{where}[{i}]: only {{'type': 'text', 'text': str}} parts are supported, "
                                     f"got {kind!r}", f"{where}[{i}]")
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(calls: object, where: str) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise InvalidChatRequest(f"{where} must be a list", where)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise InvalidChatRequest(f"{where}[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                                     "'arguments': str}}}", f"{where}[{i}]")
        out.append(ToolCall(name, arguments))
    return tuple(out)


def parse_tool_list(tools: object) -> tuple[dict[str, Any], ...]:
    """The OpenAI `tools` of a chat request, checked: None or a list of at most MAX_TOOLS
    `{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}` objects
    with distinct names of 1 to 64 letters, digits, '_' or '-'.

    Raises:
        InvalidChatRequest: naming the bad field (e.g. "tools[1].function.name").
    """
    if tools is None:
        return ()
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidChatRequest(f"tools must be a list of at most {MAX_TOOLS} {{'type': 'function', "
                                 "'function': {...}} objects", "tools")
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - _TOOL_FIELDS:
            raise InvalidChatRequest(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                                     "...}}}", where)
        function = tool.get("function")
        if not isinstance(function, dict) or set(function) - _FUNCTION_FIELDS:
            raise InvalidChatRequest(f"{where}.function must be an object with name and optionally description, "
                                     "parameters, strict", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidChatRequest(f"{where}.function.name={name!r} must be 1 to 64 letters, digits, '_' or '-'",
                                     f"{where}.function.name")
        if name in names:
            raise InvalidChatRequest(f"{where}.function.name={name!r} is given twice", f"{where}.function.name")
        names.add(name)
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                what = "a JSON schema object" if kind is dict else f"a {kind.__name__}"
                raise InvalidChatRequest(f"{where}.function.{key} must be {what}", f"{where}.function.{key}")
    return tuple(tools)
