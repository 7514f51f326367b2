"""The Python API against hostile use (issue #36): a step() called from inside a step is refused and
leaves the outer step's outputs intact; text that is not Unicode is a ValueError naming the prompt;
a model name too long for the file system is a clear InvalidEngineArgs; a stream consumer that never
reads holds one joined delta."""

from __future__ import annotations

import asyncio
import re

import pytest

from deepinfer.engine import LLM, EngineArgs, LLMEngine, RequestOutput, SamplingParams
from deepinfer.engine.config.engine_args import InvalidEngineArgs
from deepinfer.engine.core.outputs import CompletionOutput, running_output
from deepinfer.engine.frontends.async_front import MAX_PENDING_DELTAS, DeltaStream
from deepinfer.engine.sampling.sampling_params import InvalidSamplingParams, StructuredOutput

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(seed=0)


def test_a_re_entrant_step_is_refused_and_corrupts_nothing(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    want = [o.outputs[0].token_ids for o in llm.generate(["def f(", "class A:"], GREEDY, use_tqdm=False)]
    refusals: list[str] = []
    pump = engine._pump_grammars

    def re_entering() -> None:          # runs inside every step (pre_sampler_sync), as a callback would
        try:
            engine.step()
        except RuntimeError as error:
            refusals.append(str(error))
        pump()

    monkeypatch.setattr(engine, "_pump_grammars", re_entering)
    got = [o.outputs[0].token_ids for o in llm.generate(["def f(", "class A:"], GREEDY, use_tqdm=False)]
    assert got == want and refusals
    assert all("step() was called from inside a step of the same engine" in r for r in refusals)
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(["def f("], GREEDY, use_tqdm=False)] == want[:1]


def test_text_that_is_not_unicode_is_a_value_error_naming_where(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt: holds a lone surrogate '\\ud800' at index 0"):
        llm.generate(["a", "\ud800"], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()          # checked before any prompt was queued
    for field, params in (("stop[1]", {"stop": ["ok", "b\udc00"]}), ("bad_words[0]", {"bad_words": ["\ud800"]}),
                          ("structured.choice[0]", {"structured": {"choice": ["\udc00"]}})):
        with pytest.raises(InvalidSamplingParams, match=re.escape(field) + " holds a lone surrogate"):
            if "structured" in params:
                StructuredOutput(**params["structured"])
            else:
                SamplingParams(**params)


def test_a_model_name_too_long_for_the_file_system_is_a_clear_error() -> None:
    with pytest.raises(InvalidEngineArgs, match=r"model='a+'\.\.\. \(5000 characters\) cannot be a folder: File name "
                                                r"too long"):
        LLMEngine(EngineArgs(model="a" * 5000))


def test_a_consumer_that_never_reads_holds_one_joined_delta_not_one_per_step() -> None:
    loop = asyncio.new_event_loop()
    stream = DeltaStream(loop)
    for i in range(1000):
        stream.put(running_output("r", "p", [1], "ab", [i, i], None))
        assert len(stream._pending) <= MAX_PENDING_DELTAS + 1
    stream.put(RequestOutput("r", "p", [1], [CompletionOutput(0, "z", [7], "length")], True))
    out = stream.take(delta=True)
    assert out.finished and out.outputs[0].text == "ab" * 1000 + "z"
    assert out.outputs[0].token_ids == [t for i in range(1000) for t in (i, i)] + [7]
    loop.close()
