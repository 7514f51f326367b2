"""DeepSeek-V4's tool calls (DSML) in a model's output -> OpenAI tool calls.

The model answers, then writes one block (the chat template, `chat_deepseek_v4`, renders past calls
the same way):

    {content}\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

-> content "{content}", one call get_weather with arguments '{"city": "Paris", "days": 2}'. A
parameter with string="true" is a JSON string of its text as written; string="false" is JSON text
(or, if it does not parse, a string too).

While streaming, a call appears when its invoke tag is complete, its arguments grow by one
parameter at a time and close with "}" at `</｜DSML｜invoke>`. In the whole output, a call left open
(the output was cut) is closed after its last complete parameter, and text of the block that does
not follow the format, from where it stops following it, goes to the content as written; text after
the block is content too (whitespace alone is dropped).
"""

from __future__ import annotations

import json
import re

from ..text.chat_deepseek_v4 import DSML
from .parsed_calls import ParsedCall, ParsedOutput, held_back

START = f"<{DSML}tool_calls>"
END = f"</{DSML}tool_calls>"
INVOKE_END = f"</{DSML}invoke>"
SEPARATOR = "\n\n"                   # between the content and the block
_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">')
_PARAMETER = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL)
_SPACE = re.compile(r"\s*")


class DsmlToolParser:
    """Parses DeepSeek-V4's DSML tool-call block (see the module docstring)."""

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        start = text.find(START)
        if start < 0:
            keep = len(text) if final else len(text) - held_back(text, (SEPARATOR + START, START))
            return ParsedOutput(text[:keep])
        content = text[:start].removesuffix(SEPARATOR)
        calls: list[ParsedCall] = []
        open_call: tuple[str, list[str]] | None = None      # name, "key": value items so far
        pos = start + len(START)
        closed = False
        while True:
            pos = _skip_space(text, pos)
            if open_call is None:
                if text.startswith(END, pos):
                    pos, closed = pos + len(END), True
                    break
                invoke = _INVOKE.match(text, pos)
                if invoke is None:
                    break
                open_call, pos = (invoke.group(1), []), invoke.end()
                continue
            if text.startswith(INVOKE_END, pos):
                calls.append(_call(*open_call, closed=True))
                open_call, pos = None, pos + len(INVOKE_END)
                continue
            parameter = _PARAMETER.match(text, pos)
            if parameter is None:
                break
            open_call[1].append(_item(*parameter.groups()))
            pos = parameter.end()
        if open_call is not None:
            calls.append(_call(*open_call, closed=final))
        rest = text[pos:]
        if closed:
            content += rest if rest.strip() else ""
        elif final:
            content += rest
        return ParsedOutput(content, tuple(calls))


def _item(name: str, is_string: str, value: str) -> str:
    if is_string == "false":
        try:
            json.loads(value)
        except json.JSONDecodeError:
            is_string = "true"
    text = json.dumps(value, ensure_ascii=False) if is_string == "true" else value
    return f"{json.dumps(name, ensure_ascii=False)}: {text}"


def _call(name: str, items: list[str], *, closed: bool) -> ParsedCall:
    return ParsedCall(name, "{" + ", ".join(items) + ("}" if closed else ""))


def _skip_space(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace (`len(text)` if none)."""
    match = _SPACE.match(text, pos)
    return match.end() if match else pos
