"""The tool fields of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`), checked.

    {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}],
     "tool_choice": "auto"}

`tool_choice` is "none" (the tools are shown to the model, its output is not parsed for calls),
"auto" (the default with tools: the server's `--tool-call-parser` finds calls in the output; needs
`--enable-auto-tool-choice`), "required" (at least one call) or `{"type": "function", "function":
{"name": ...}}` (exactly that call). The last two are forced through structured output, so the
output is valid whatever the model: a named choice constrains it to a JSON object valid against the
function's `parameters`, "required" to a JSON array of `{"name", "parameters"}` objects (one item
when parallel_tool_calls is false).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..sampling.sampling_params import StructuredOutput
from ..text.chat_messages import InvalidChatRequest, parse_tool_list
from .errors import bad_request

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolsRequest:
    """A request's checked tools and choice.

    Attributes:
        tools: the OpenAI tool objects as given (`{"type": "function", "function": {...}}`).
        choice: "none", "auto", "required" or "named".
        name: the function of a named choice, else None.
        parallel_tool_calls: False = at most one call.
    """

    tools: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel_tool_calls: bool = True

    @property
    def forced(self) -> bool:
        """Whether the output is constrained to calls ("required" or a named choice)."""
        return self.choice in ("required", "named")

    def parameters(self, name: str) -> dict[str, Any]:
        """The JSON schema of function `name`'s parameters (an empty object schema when it has none)."""
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or _EMPTY_PARAMETERS

    def constraint(self) -> StructuredOutput | None:
        """The structured output that forces the calls, or None when the choice is not forced."""
        if self.choice == "named":
            assert self.name is not None
            return StructuredOutput(json=self.parameters(self.name))
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                    "parameters": self.parameters(t["function"]["name"])},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutput(json=schema)


def parse_tools(body: Mapping[str, Any]) -> ToolsRequest | None:
    """The tool fields of a chat body; None when it gives no tools (and no choice that needs them).

    Raises:
        APIError: 400 naming the field: a malformed tool, a duplicate name, an unknown tool_choice or
            function name, a choice that needs tools without tools, parallel_tool_calls not a bool.
    """
    tools = _tools(body.get("tools"))
    choice, name = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls={parallel!r} must be true or false", "parallel_tool_calls")
    if not tools:
        return None
    return ToolsRequest(tools, choice, name, parallel is not False)


def _tools(tools: object) -> tuple[dict[str, Any], ...]:
    try:
        return parse_tool_list(tools)
    except InvalidChatRequest as error:
        raise bad_request(str(error), error.field) from None


def _choice(choice: object, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise bad_request("tool_choice='required' needs tools", "tool_choice")
        return str(choice), None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(f"tool_choice={choice!r} must be 'none', 'auto', 'required' or {{'type': 'function', "
                          "'function': {'name': ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return "named", name
