"""DeepSeek-V4's chat format, written natively (the release ships a Python encoder, not a jinja template).

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜><｜User｜>...

- A system message is its text, as is; user and developer messages open with `<｜User｜>`.
- A user (or developer) message followed by an assistant message or ending the conversation is
  followed by `<｜Assistant｜>` and a thinking marker: `</think>` (chat mode: answer directly), or
  `<think>` in thinking mode for the last user turn (the model then reasons, closes with `</think>`
  and answers).
- An assistant message is `{reasoning}</think>` (thinking mode, turns after the last user message
  only: older reasoning is dropped), its text, its tool calls as a DSML block, then EOS.
- Tool results (role "tool") join the user turn that follows the assistant's calls, each as
  `<tool_result>{content}</tool_result>`, blocks of one turn separated by a blank line.
- In thinking mode, developer messages before the last user turn are dropped with the old reasoning.

Tool declarations (`tools`), `latest_reminder` and the internal task tokens are not rendered yet:
`render` refuses them rather than drop them silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .chat_messages import ChatMessage, InvalidChatRequest

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

_ROLES = ("system", "user", "developer", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class _Turn:
    """A message after tool results were merged into user turns."""

    role: str
    text: str
    reasoning: str = ""
    tool_calls: tuple[tuple[str, str], ...] = ()      # (name, arguments as JSON text)


class DeepseekV4ChatTemplate:
    """Renders messages in DeepSeek-V4's format.

    `render` keyword options (chat_template_kwargs): `thinking` (bool, default False): end the
    prompt with `<think>` so that the model reasons first.
    """

    name = "deepseek_v4"

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
               options: Mapping[str, Any] | None = None) -> str:
        """The prompt text of `messages` (BOS included: tokenize it without adding special tokens).

        Raises:
            InvalidChatRequest: an unknown option, role or message field for this format.
        """
        thinking = _thinking_option(options or {})
        turns = _merge_tool_results(messages)
        last_user = max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)
        if thinking:
            turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= last_user]
            last_user = max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)
        parts = [BOS]
        for index, turn in enumerate(turns):
            parts.append(_render_turn(turn, thinking=thinking and index > last_user))
            following = turns[index + 1].role if index + 1 < len(turns) else None
            ends_prompt = following is None and add_generation_prompt
            if turn.role in ("user", "developer") and (following == "assistant" or ends_prompt):
                parts.append(ASSISTANT + (THINK_START if thinking and index == last_user else THINK_END))
        return "".join(parts)


def _thinking_option(options: Mapping[str, Any]) -> bool:
    unknown = sorted(set(options) - {"thinking"})
    if unknown:
        raise InvalidChatRequest(f"chat_template_kwargs: {unknown[0]!r} is not an option of the deepseek_v4 chat "
                                 "format (known: 'thinking')", "chat_template_kwargs")
    thinking = options.get("thinking", False)
    if not isinstance(thinking, bool):
        raise InvalidChatRequest(f"chat_template_kwargs.thinking={thinking!r} must be a bool", "chat_template_kwargs")
    return thinking


def _merge_tool_results(messages: Sequence[ChatMessage]) -> list[_Turn]:
    """Tool results and user messages that follow a user turn join it (blank-line separated)."""
    turns: list[_Turn] = []
    for index, message in enumerate(messages):
        if message.role not in _ROLES:
            raise InvalidChatRequest(f"messages[{index}].role={message.role!r} is not supported by the deepseek_v4 "
                                     f"chat format (one of {', '.join(_ROLES)})", f"messages[{index}].role")
        text = f"<tool_result>{message.content}</tool_result>" if message.role == "tool" else message.content
        if message.role in ("user", "tool") and turns and turns[-1].role == "user":
            turns[-1] = _Turn("user", f"{turns[-1].text}\n\n{text}")
        elif message.role == "tool":
            turns.append(_Turn("user", text))
        else:
            calls = tuple((call.name, call.arguments) for call in message.tool_calls)
            turns.append(_Turn(message.role, text, message.reasoning_content or "", calls))
    return turns


def _render_turn(turn: _Turn, *, thinking: bool) -> str:
    if turn.role == "system":
        return turn.text
    if turn.role in ("user", "developer"):
        return USER + turn.text
    reasoning = f"{turn.reasoning}{THINK_END}" if thinking else ""
    calls = ""
    if turn.tool_calls:
        invokes = "\n".join(f'<{DSML}invoke name="{name}">\n{_dsml_parameters(arguments)}\n</{DSML}invoke>'
                            for name, arguments in turn.tool_calls)
        calls = f"\n\n<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>"
    return f"{reasoning}{turn.text}{calls}{EOS}"


def _dsml_parameters(arguments: str) -> str:
    """One DSML parameter per top-level key of the JSON arguments; str values as they are
    (string="true"), others as JSON (string="false"). Arguments that are not a JSON object become
    one parameter named "arguments"."""
    try:
        values = json.loads(arguments)
    except json.JSONDecodeError:
        values = None
    if not isinstance(values, dict):
        values = {"arguments": arguments}
    lines = []
    for key, value in values.items():
        is_str = isinstance(value, str)
        text = value if is_str else json.dumps(value, ensure_ascii=False)
        lines.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">{text}</{DSML}parameter>')
    return "\n".join(lines)
