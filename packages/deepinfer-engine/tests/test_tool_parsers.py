"""Tool-call and reasoning parsers on crafted model output: whole, and streamed in every kind of
chunking (the deltas joined must be the whole message)."""

from __future__ import annotations

import json
import random

import pytest

from deepinfer.engine.serve.chat_output import ChoiceStream, OutputParsers
from deepinfer.engine.serve.reasoning import DeepseekV4ReasoningParser
from deepinfer.engine.serve.tool_parser_dsml import DsmlToolParser
from deepinfer.engine.serve.tool_parsers import (
    HermesToolParser,
    NamedCallParser,
    ParsedCall,
    ParsedOutput,
    RequiredCallsParser,
    held_back,
)

D = "｜DSML｜"


def _dsml_call(name: str, *parameters: tuple[str, str, str]) -> str:
    lines = "".join(f'<{D}parameter name="{key}" string="{kind}">{value}</{D}parameter>\n'
                    for key, kind, value in parameters)
    return f'<{D}invoke name="{name}">\n{lines}</{D}invoke>\n'


DSML_TWO_CALLS = (f"Let me check.\n\n<{D}tool_calls>\n"
                  + _dsml_call("weather", ("city", "true", "Paris"), ("days", "false", "2"))
                  + _dsml_call("clock", ("zone", "true", 'Europe/"Paris"'), ("opts", "false", '{"h24": true}'))
                  + f"</{D}tool_calls>")


def test_dsml_calls_become_json_arguments() -> None:
    parsed = DsmlToolParser().parse(DSML_TWO_CALLS, final=True)
    assert parsed == ParsedOutput("Let me check.", (
        ParsedCall("weather", '{"city": "Paris", "days": 2}'),
        ParsedCall("clock", '{"zone": "Europe/\\"Paris\\"", "opts": {"h24": true}}')))
    assert json.loads(parsed.tool_calls[1].arguments) == {"zone": 'Europe/"Paris"', "opts": {"h24": True}}


def test_dsml_without_a_block_is_all_content_and_bad_json_values_become_strings() -> None:
    assert DsmlToolParser().parse("plain answer\n\n", final=True) == ParsedOutput("plain answer\n\n")
    text = f"<{D}tool_calls>\n" + _dsml_call("f", ("x", "false", "not json")) + f"</{D}tool_calls>\n"
    assert DsmlToolParser().parse(text, final=True) == ParsedOutput("", (ParsedCall("f", '{"x": "not json"}'),))


def test_dsml_cut_output_closes_the_open_call_and_keeps_the_rest_as_content() -> None:
    cut = f"A\n\n<{D}tool_calls>\n" + _dsml_call("f", ("x", "false", "1")) + \
        f'<{D}invoke name="g">\n<{D}parameter name="y" string="false">2</{D}parameter>\n<{D}parameter name="z" str'
    assert DsmlToolParser().parse(cut, final=True) == ParsedOutput(
        f'A<{D}parameter name="z" str', (ParsedCall("f", '{"x": 1}'), ParsedCall("g", '{"y": 2}')))
    # while streaming, the open call's arguments are not closed and the unfinished parameter is held
    assert DsmlToolParser().parse(cut, final=False) == ParsedOutput(
        "A", (ParsedCall("f", '{"x": 1}'), ParsedCall("g", '{"y": 2')))


def test_hermes_blocks_text_and_malformed_blocks() -> None:
    text = ('I will call.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>\n'
            '<tool_call>not json</tool_call> done')
    assert HermesToolParser().parse(text, final=True) == ParsedOutput(
        "I will call.\n<tool_call>not json</tool_call> done",
        (ParsedCall("f", '{"x": 1}'), ParsedCall("g", '{"y": 2}')))
    assert HermesToolParser().parse("a <tool_call>{", final=True) == ParsedOutput("a <tool_call>{")
    assert HermesToolParser().parse("a <tool_c", final=False) == ParsedOutput("a ")


def test_required_array_and_named_call() -> None:
    text = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    assert RequiredCallsParser().parse(text, final=True) == ParsedOutput(
        "", (ParsedCall("f", '{"x": 1}'), ParsedCall("g", "{}")))
    cut = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "param'
    assert RequiredCallsParser().parse(cut, final=False) == ParsedOutput("", (ParsedCall("f", '{"x": 1}'),))
    assert RequiredCallsParser().parse(cut, final=True) == ParsedOutput('{"name": "g", "param',
                                                                        (ParsedCall("f", '{"x": 1}'),))
    assert NamedCallParser("f").parse('{"x": ', final=False) == ParsedOutput("", (ParsedCall("f", '{"x": '),))


def test_deepseek_v4_reasoning_split() -> None:
    thinking = DeepseekV4ReasoningParser(thinking=True)
    assert thinking.split("plan</think>answer", final=True) == ("plan", "answer")
    assert thinking.split("<think>plan</think>", final=True) == ("plan", "")
    assert thinking.split("cut short</thi", final=True) == ("cut short</thi", "")
    assert thinking.split("cut short</thi", final=False) == ("cut short", "")
    assert thinking.split("<thi", final=False) == ("", "")
    assert DeepseekV4ReasoningParser(thinking=False).split("a</think>b", final=True) == (None, "a</think>b")


def test_held_back_is_the_longest_marker_beginning() -> None:
    assert held_back("abc\n\n<｜DS", ("\n\n<｜DSML｜tool_calls>", "<｜DSML｜tool_calls>")) == 6
    assert held_back("abc<", ("<tool_call>",)) == 1
    assert held_back("abc", ("<tool_call>",)) == 0
    assert held_back("<tool_call>", ("<tool_call>",)) == 0     # a whole marker is not held


def _joined(parsers: OutputParsers, chunks: list[str]) -> dict[str, object]:
    """Stream `chunks` through a ChoiceStream; the deltas joined into one message."""
    stream = ChoiceStream(parsers)
    reasoning, content, calls = "", "", []
    for number, chunk in enumerate(chunks):
        delta = stream.delta(chunk, final=number == len(chunks) - 1)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            if entry["index"] == len(calls):
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                calls.append(dict(entry["function"]))
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    assert stream.has_tool_calls == bool(calls)
    return {"reasoning": reasoning, "content": content, "calls": calls}


def _whole(parsers: OutputParsers, text: str) -> dict[str, object]:
    message = parsers.message(text)
    return {"reasoning": message.get("reasoning_content") or "", "content": message["content"] or "",
            "calls": [call["function"] for call in message.get("tool_calls", [])]}


def _chunkings(text: str, seed: int) -> list[list[str]]:
    """One character at a time, the whole text at once, and random cuts."""
    rng = random.Random(seed)
    out = [list(text), [text]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out + [[*list(text), ""]]          # the end arriving in an empty delta


CASES = {
    "dsml": (OutputParsers(None, DsmlToolParser()), DSML_TWO_CALLS),
    "dsml cut": (OutputParsers(None, DsmlToolParser()), DSML_TWO_CALLS[:-40]),
    "dsml with text after": (OutputParsers(None, DsmlToolParser()), DSML_TWO_CALLS + "\n\nbye"),
    "no block, newlines": (OutputParsers(None, DsmlToolParser()), "a\n\n\nb\n\n<｜DS"),
    "thinking then dsml": (OutputParsers(DeepseekV4ReasoningParser(thinking=True), DsmlToolParser()),
                           "<think>I need weather.</think>" + DSML_TWO_CALLS),
    "thinking cut": (OutputParsers(DeepseekV4ReasoningParser(thinking=True), DsmlToolParser()), "hmm </thin"),
    "hermes": (OutputParsers(None, HermesToolParser()),
               'x <tool_call>{"name": "f", "arguments": {"a": [1, 2]}}</tool_call>\n \n<tool_call>bad</tool_call>'
               ' <tool_call>{"name": "g", "arguments": {}}</tool_call>\n'),
    "required": (OutputParsers(None, RequiredCallsParser()),
                 '[{"name": "f", "parameters": {"s": "]}"}}, {"name": "g", "parameters": {}}]'),
    "named": (OutputParsers(DeepseekV4ReasoningParser(thinking=False), NamedCallParser("f")), '{"a": 1, "b": "x"}'),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_deltas_join_into_the_whole_message(case: str) -> None:
    parsers, text = CASES[case]
    whole = _whole(parsers, text)
    for chunks in _chunkings(text, seed=len(case)):
        assert _joined(parsers, chunks) == whole, chunks


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    parsers = OutputParsers(None, DsmlToolParser(), parallel_tool_calls=False)
    message = parsers.message(DSML_TWO_CALLS)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["weather"]
    assert _joined(parsers, list(DSML_TWO_CALLS))["calls"] == [c["function"] for c in message["tool_calls"]]
    assert "reasoning_content" not in message and message["content"] == "Let me check."
