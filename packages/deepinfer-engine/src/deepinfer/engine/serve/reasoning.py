"""Reasoning parsers: a model's output text -> (its thinking, the rest), whole or while it streams.

    REASONING_PARSERS["deepseek_v4"](thinking=True).split("plan</think>answer", final=True)
    -> ("plan", "answer")

DeepSeek-V4 in thinking mode is prompted up to `<think>` (chat_template_kwargs {"thinking": true},
or "enable_thinking"), so its output is `{reasoning}</think>{answer}`; an output that never closes
the thinking (cut by max_tokens) is all reasoning. In chat mode (the default) the prompt already
closed it: the output is all answer and the reasoning is None. A leading `<think>` the model writes
itself is dropped.

`split(text, final=False)` reads a prefix of the output and returns only what it settles (a possible
beginning of `</think>` is held back); a longer prefix only extends both parts, as for the tool
parsers (`tool_parsers`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..text.chat_deepseek_v4 import THINK_END, THINK_START
from .tool_parsers import held_back


class ReasoningParser(Protocol):
    def split(self, text: str, *, final: bool) -> tuple[str | None, str]:
        """(reasoning or None when the request does not think, the rest of `text`)."""


def thinking_requested(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the request turned thinking on: chat_template_kwargs "thinking" or "enable_thinking" true."""
    options = chat_template_kwargs or {}
    return options.get("thinking") is True or options.get("enable_thinking") is True


class DeepseekV4ReasoningParser:
    """`{reasoning}</think>{answer}` when `thinking`, else all answer (see the module docstring)."""

    def __init__(self, *, thinking: bool) -> None:
        self.thinking = thinking

    def split(self, text: str, *, final: bool) -> tuple[str | None, str]:
        if not self.thinking:
            return None, text
        if not final and THINK_START.startswith(text):
            return "", ""                       # may still become the opening tag
        body = text.removeprefix(THINK_START)
        end = body.find(THINK_END)
        if end < 0:
            keep = len(body) if final else len(body) - held_back(body, (THINK_END,))
            return body[:keep], ""
        return body[:end], body[end + len(THINK_END):]


REASONING_PARSERS: dict[str, Callable[..., ReasoningParser]] = {"deepseek_v4": DeepseekV4ReasoningParser}
