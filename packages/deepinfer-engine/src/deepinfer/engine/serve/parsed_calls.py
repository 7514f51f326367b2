"""What every tool-call parser returns (`ParsedOutput` of `ParsedCall`s), the `ToolParser` interface,
and `held_back`, which keeps a possible marker beginning out of streamed content. The parsers
(`tool_parsers`, `tool_parser_dsml`) and their users import these from here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text (while streaming, a prefix of it)."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """An output split into its text for the user and its tool calls, in order."""

    content: str
    tool_calls: tuple[ParsedCall, ...] = ()


class ToolParser(Protocol):
    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        """Split `text` (the whole output when `final`, else a prefix of it; see `tool_parsers`)."""


def held_back(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `markers` (0 if none)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
