"""Structured output end to end (xgrammar) on the tiny random model with a trained byte-level BPE.

A random model writes junk, so a constrained output is exactly what its grammar forces: every output
must parse and validate, in batches that mix constrained and free requests.
"""

from __future__ import annotations

import json
import re
import sys
import threading

import pytest
from engine_twin import hf_greedy

from deepinfer.engine import (
    LLM,
    EngineArgs,
    InvalidSamplingParams,
    LLMEngine,
    SamplingParams,
    StructuredOutput,
    StructuredOutputUnavailable,
)
from deepinfer.engine.sampling.grammar_backend import XGrammarBackend
from deepinfer.engine.sampling.grammar_compiler import GrammarCompilePool

EOS = 0
PROMPTS = ["def fibonacci(", "class Stack:", "    return a"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["ok", "color", "n", "name", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe so", 'a "quoted" é']
GRAMMAR = 'root ::= "(" [a-c] [a-c]? [a-c]? ")" | "<" [0-9] ">"'


def _validate(value: object, schema: dict) -> None:
    """Asserts `value` is valid against the subset of JSON Schema that SCHEMA uses."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(schema["properties"])
        for key, item in value.items():
            _validate(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and schema["minItems"] <= len(value) <= schema["maxItems"]
        for item in value:
            _validate(item, schema["items"])
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema["minimum"] <= value <= schema["maximum"]
    elif kind == "string":
        assert isinstance(value, str) and re.search(schema["pattern"], value), value


def _check(kind: str, text: str) -> None:
    if kind == "json":
        _validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([a-c]{1,3}\)|<[0-9]>", text), text


CONSTRAINTS = {
    "json": StructuredOutput(json=SCHEMA),
    "regex": StructuredOutput(regex=REGEX),
    "choice": StructuredOutput(choice=CHOICES),
    "grammar": StructuredOutput(grammar=GRAMMAR),
}


def test_every_constrained_output_parses_in_a_batch_mixed_with_free_requests(tiny_text) -> None:
    hf, model_dir = tiny_text
    llm = LLM(model=str(model_dir), max_num_seqs=64)
    cases, prompts, params = [], [], []
    for p, prompt in enumerate(PROMPTS):
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        cases.append(("free", None))
        for kind, spec in CONSTRAINTS.items():
            for temperature, seed in ((0.0, None), (0.9, 100 + p)):
                prompts.append(prompt)
                params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=120, structured=spec))
                cases.append((kind, temperature))
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = set()
    for (kind, _), prompt, out in zip(cases, prompts, outs):
        completion = out.outputs[0]
        if kind == "free":                                  # masks of other rows leave it untouched
            assert completion.token_ids == hf_greedy(hf, llm.engine.tokenizer.encode(prompt), 12)
            continue
        assert completion.finish_reason == "stop" and completion.token_ids[-1] == EOS, completion
        _check(kind, completion.text)
        texts.add(completion.text)
    assert len(texts) >= 8                                  # outputs really depend on the model
    grammars = llm.engine.grammars
    assert grammars is not None and grammars.num_compiles == len(CONSTRAINTS)   # one compile per key
    assert grammars.num_cache_hits == len(PROMPTS) * 2 * len(CONSTRAINTS) - len(CONSTRAINTS)


class _SlowBackend:
    """Wraps a backend; compiling `slow_key` waits until the test sets `release`."""

    def __init__(self, inner: XGrammarBackend, slow_key: tuple[str, str]) -> None:
        self.inner, self.slow_key = inner, slow_key
        self.release = threading.Event()

    def compile(self, spec: StructuredOutput) -> object:
        if spec.key == self.slow_key:
            assert self.release.wait(60)
        return self.inner.compile(spec)

    def new_state(self, compiled: object):
        return self.inner.new_state(compiled)


def _run_steps(engine: LLMEngine, until, first_step: int, tokens_at: dict[str, list[int]], max_steps: int = 300):
    step = first_step
    while not until():
        assert step < first_step + max_steps, "engine made no progress"
        for out in engine.step():
            tokens_at.setdefault(out.request_id, [])
            tokens_at[out.request_id] += [step] * (len(out.outputs[0].token_ids) - len(tokens_at[out.request_id]))
            if out.finished:
                tokens_at[out.request_id + ":done"] = [step]
        step += 1
    return step


def test_a_slow_compile_does_not_hold_back_other_requests(tiny_text) -> None:
    hf, model_dir = tiny_text
    engine = LLMEngine(EngineArgs(model=str(model_dir)))
    slow = StructuredOutput(regex=REGEX)
    inner = XGrammarBackend(engine.tokenizer, engine.model.cfg.vocab_size, engine.eos_token_ids)
    backend = _SlowBackend(inner, slow.key)
    engine.grammars = GrammarCompilePool(backend)
    prompt = engine.tokenizer.encode("def fibonacci(")
    try:
        engine.add_request("slow", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20,
                                                                                 structured=slow))
        engine.add_request("free", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6))
        engine.add_request("fast", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=20, structured=StructuredOutput(choice=CHOICES)))
        tokens_at: dict[str, list[int]] = {}
        step = _run_steps(engine, lambda: "free:done" in tokens_at and "fast:done" in tokens_at, 0, tokens_at)
        for _ in range(3):                                  # idle steps: the slow one still waits
            assert engine.step() == []
            step += 1
        assert "slow" not in tokens_at and engine.has_unfinished_requests()
        with pytest.raises(KeyError):
            engine.scheduler.get_seq("slow")                # held outside the scheduler
        assert tokens_at["free"][0] == 0                    # prefilled in the very first step
        released_at = step
        backend.release.set()
        _run_steps(engine, lambda: "slow:done" in tokens_at, step, tokens_at)
    finally:
        backend.release.set()
    assert min(tokens_at["slow"]) >= released_at
    assert tokens_at["free:done"][0] < released_at and tokens_at["fast:done"][0] < released_at
    assert not engine.has_unfinished_requests()


def test_bad_constraints_fail_clearly_and_the_rest_complete(tiny_text) -> None:
    _, model_dir = tiny_text
    llm = LLM(model=str(model_dir))
    bad = {
        "json": (StructuredOutput(json={"type": "foo"}), 'invalid structured.json: Unsupported type "foo"'),
        "regex": (StructuredOutput(regex="([a-"), "invalid structured.regex: Regex parsing error"),
        "grammar": (StructuredOutput(grammar="root ::= missing"), 'Rule "missing" is not defined'),
    }
    params = [SamplingParams(temperature=0, max_tokens=20, structured=spec) for spec, _ in bad.values()]
    params.insert(1, SamplingParams(temperature=0, max_tokens=20, structured=StructuredOutput(regex=REGEX)))
    outs = llm.generate(["def fibonacci("] * len(params), params, use_tqdm=False)
    good = outs.pop(1).outputs[0]
    assert good.finish_reason == "stop" and re.fullmatch(REGEX, good.text)
    for out, (_, reason) in zip(outs, bad.values()):
        completion = out.outputs[0]
        assert completion.finish_reason == "ignored" and completion.token_ids == []
        assert completion.ignored_reason.startswith("grammar compile failed: invalid structured.")
        assert reason in completion.ignored_reason
    with pytest.raises(InvalidSamplingParams, match="structured.json is not valid JSON text"):
        SamplingParams(structured=StructuredOutput(json='{"type": "object",'))


def test_a_grammar_dead_end_finishes_that_request_with_an_error(tiny_text) -> None:
    _, model_dir = tiny_text
    llm = LLM(model=str(model_dir))
    stuck = SamplingParams(temperature=0, max_tokens=20, min_tokens=8, structured=StructuredOutput(choice=["yes"]))
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    stuck_out, free_out = (o.outputs[0] for o in llm.generate(["def fibonacci("] * 2, [stuck, free], use_tqdm=False))
    assert stuck_out.finish_reason == "error" and stuck_out.text == "yes"
    assert "grammar dead end" in stuck_out.error_reason and "min_tokens" in stuck_out.error_reason
    assert free_out.finish_reason == "length" and len(free_out.token_ids) == 10


def test_abort_while_compiling(tiny_text) -> None:
    _, model_dir = tiny_text
    engine = LLMEngine(EngineArgs(model=str(model_dir)))
    spec = StructuredOutput(regex="[a-z]{2}")
    backend = _SlowBackend(XGrammarBackend(engine.tokenizer, engine.model.cfg.vocab_size, engine.eos_token_ids),
                           spec.key)
    engine.grammars = GrammarCompilePool(backend)
    try:
        engine.add_request("a", "def", SamplingParams(structured=spec))
        engine.abort_request("a")
        assert engine.has_unfinished_requests()       # until the next step reports the abort
        backend.release.set()                        # the compile was cancelled: its result is dropped
        outputs = engine.step()                      # the abort is reported once, then forgotten
        assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("a", "abort")]
        assert engine.step() == [] and not engine.has_unfinished_requests()
    finally:
        backend.release.set()


def test_structured_output_needs_a_tokenizer_and_xgrammar(tiny, tiny_text, monkeypatch) -> None:
    spec = SamplingParams(structured=StructuredOutput(regex="a"))
    no_tokenizer = LLMEngine(EngineArgs(model=str(tiny[1])))
    with pytest.raises(StructuredOutputUnavailable, match="needs a tokenizer"):
        no_tokenizer.add_request(None, [3, 4], spec)
    engine = LLMEngine(EngineArgs(model=str(tiny_text[1])))
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(StructuredOutputUnavailable, match=r"needs the xgrammar package \(a dependency of "
                                                              r"deepinfer-engine, missing from this environment\)"):
        engine.add_request(None, "def", spec)
    assert not engine.has_unfinished_requests()
