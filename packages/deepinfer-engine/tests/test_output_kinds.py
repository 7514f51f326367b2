"""OutputKind: cumulative, delta and final-only outputs of the same requests agree."""

from __future__ import annotations

import functools

import pytest

from deepinfer.engine import LLMEngine, OutputKind, SamplingParams
from deepinfer.engine.config.engine_args import EngineArgs

PARAMS = (SamplingParams(temperature=0.0, max_tokens=30),
          SamplingParams(temperature=0.8, seed=7, max_tokens=25, logprobs=1),
          SamplingParams(temperature=0.0, max_tokens=40, stop=["\n\n", "return"]),
          SamplingParams(temperature=0.0, max_tokens=1))
PROMPTS = ("def fibonacci(", "import sys\n", "class Stack:", "x = ")


@functools.cache
def engine() -> LLMEngine:
    return LLMEngine(EngineArgs(max_num_seqs=4))


def run(kind: OutputKind) -> dict[str, list]:
    """Every output step() returned, per request."""
    eng = engine()
    for index, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        eng.add_request(f"{kind.value}-{index}", prompt, params, output_kind=kind)
    seen: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.setdefault(out.request_id.split("-")[1], []).append(out)
    return seen


def test_cumulative_delta_and_final_only_agree() -> None:
    cumulative, delta, final = (run(kind) for kind in OutputKind)
    assert sorted(cumulative) == sorted(delta) == sorted(final) == ["0", "1", "2", "3"]
    for key in cumulative:
        last = cumulative[key][-1].outputs[0]
        assert len(final[key]) == 1 and final[key][0].finished                 # one output, at the end
        done = final[key][0].outputs[0]
        assert (done.text, done.token_ids, done.finish_reason, done.logprobs) == \
            (last.text, last.token_ids, last.finish_reason, last.logprobs)
        pieces = [out.outputs[0] for out in delta[key]]
        assert delta[key][-1].finished and not any(out.finished for out in delta[key][:-1])
        assert "".join(p.text for p in pieces) == last.text
        assert [t for p in pieces for t in p.token_ids] == last.token_ids
        if last.logprobs is not None:
            assert [lp for p in pieces for lp in p.logprobs] == last.logprobs
        assert pieces[-1].finish_reason == last.finish_reason
        assert len(delta[key]) == len(cumulative[key])                         # one per changed step
    assert cumulative["2"][-1].outputs[0].finish_reason in ("stop", "length")


def test_output_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="output_kind='delta' must be an OutputKind"):
        engine().add_request("bad", "x", SamplingParams(max_tokens=1), output_kind="delta")
    assert not engine().has_unfinished_requests()
