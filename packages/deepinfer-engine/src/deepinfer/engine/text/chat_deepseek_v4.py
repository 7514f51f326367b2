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
- Tools (the request's `tools`) are declared in a "## Tools" section, DeepSeek's own text with one
  JSON function schema a line, after the first message's text when it is a system message, else as
  a system message of its own before the conversation. With tools, as DeepSeek's encoder does, no
  reasoning is dropped: in thinking mode every assistant turn keeps its reasoning and every user
  turn is followed by `<think>`.

`latest_reminder`, `reasoning_effort` and the internal task tokens are not rendered yet: `render`
refuses them rather than drop them silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
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
_THINKING_OPTIONS = ("thinking", "enable_thinking")

TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside \
{THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


@dataclass(frozen=True, slots=True)
class _Turn:
    """A message after tool results were merged into user turns."""

    role: str
    text: str
    reasoning: str = ""
    tool_calls: tuple[tuple[str, str], ...] = ()      # (name, arguments as JSON text)


class DeepseekV4ChatTemplate:
    """Renders messages in DeepSeek-V4's format.

    `render` keyword options (chat_template_kwargs): `thinking` (bool, default False; vLLM's
    `enable_thinking` is the same): end the prompt with `<think>` so that the model reasons first.
    """

    name = "deepseek_v4"

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
               options: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text of `messages` (BOS included: tokenize it without adding special tokens).

        Raises:
            InvalidChatRequest: an unknown option, role or message field for this format.
        """
        thinking = _thinking_option(options or {})
        turns = _merge_tool_results(messages)
        keep_reasoning = bool(tools)
        if tools:
            turns = _declare_tools(turns, tools)
        if thinking and not keep_reasoning:    # developer turns before the last user turn are dropped
            last_user = _last_user_turn(turns)
            turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= last_user]
        last_user = _last_user_turn(turns)
        parts = [BOS]
        for index, turn in enumerate(turns):
            parts.append(_render_turn(turn, thinking=thinking and (keep_reasoning or index > last_user)))
            parts.append(_assistant_opening(turns, index, add_generation_prompt,
                                            thinking=thinking and (keep_reasoning or index == last_user)))
        return "".join(parts)


def _last_user_turn(turns: Sequence[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _assistant_opening(turns: Sequence[_Turn], index: int, add_generation_prompt: bool, *, thinking: bool) -> str:
    """The assistant header after user / developer turn `index` when an assistant turn (or, with
    add_generation_prompt, the model's answer) follows it: opening its reasoning when `thinking`."""
    following = turns[index + 1].role if index + 1 < len(turns) else None
    ends_prompt = following is None and add_generation_prompt
    if turns[index].role in ("user", "developer") and (following == "assistant" or ends_prompt):
        return ASSISTANT + (THINK_START if thinking else THINK_END)
    return ""


def _thinking_option(options: Mapping[str, Any]) -> bool:
    unknown = sorted(set(options) - set(_THINKING_OPTIONS))
    if unknown:
        raise InvalidChatRequest(f"chat_template_kwargs: {unknown[0]!r} is not an option of the deepseek_v4 chat "
                                 "format (known: 'thinking', 'enable_thinking')", "chat_template_kwargs")
    for key in _THINKING_OPTIONS:
        if not isinstance(options.get(key, False), bool):
            raise InvalidChatRequest(f"chat_template_kwargs.{key}={options[key]!r} must be a bool",
                                     "chat_template_kwargs")
    return any(options.get(key, False) for key in _THINKING_OPTIONS)


def _declare_tools(turns: list[_Turn], tools: Sequence[Mapping[str, Any]]) -> list[_Turn]:
    """The tools section joins the first turn when it is a system turn, else comes first as one."""
    schemas = "\n".join(json.dumps(tool.get("function"), ensure_ascii=False) for tool in tools)
    section = "\n\n" + TOOLS_SECTION.format(schemas=schemas)
    if turns and turns[0].role == "system":
        return [replace(turns[0], text=turns[0].text + section), *turns[1:]]
    return [_Turn("system", section), *turns]


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
