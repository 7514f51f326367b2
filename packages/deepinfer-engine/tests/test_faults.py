"""Fault injection: an exception at each stage of a step fails exactly that step's requests (reason
"error", naming the exception), frees what they held, and the engine goes on serving with the
same outputs as before the fault."""

from __future__ import annotations

import threading

import pytest

from deepinfer.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from deepinfer.sched import StepKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = ((1, 2, 3, 4, 5), (7, 8, 9), (11, 12, 13, 14))


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineArgs(num_kv_blocks=16, max_num_seqs=4))


@pytest.fixture(scope="module")
def reference(engine: LLMEngine) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of each prompt run alone on the clean engine."""
    return {tuple(p): run(engine, [p])[0].outputs[0].token_ids for p in PROMPTS}


def run(engine: LLMEngine, prompts, params: SamplingParams = GREEDY, max_steps: int = 100):
    ids = [engine.add_request(None, list(p), params) for p in prompts]
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if len(done) == len(ids):
            return [done[i] for i in ids]
    raise AssertionError(f"requests still running after {max_steps} steps")


def assert_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and not engine._requests
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    engine.scheduler.check_integrity()          # every KV block and state slot is free again


def fail_once(monkeypatch, owner, name: str, when=lambda *args: True) -> list[int]:
    """Make `owner.name` raise InjectedFault on its first call for which `when(*args)` holds."""
    original = getattr(owner, name)
    fired: list[int] = []

    def faulty(*args, **kwargs):
        if not fired and when(*args):
            fired.append(1)
            raise InjectedFault(f"injected into {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)
    return fired


def is_decode(out) -> bool:
    return out.kind is StepKind.DECODE


STAGES = {
    # stage: (object getter, attribute, condition on the call's arguments)
    "scheduling": (lambda e: e.scheduler, "schedule", lambda: True),
    "input preparation, prefill": (lambda e: e.runner, "prepare", lambda out: out.kind is StepKind.PREFILL),
    "input preparation, decode": (lambda e: e.runner, "prepare", is_decode),
    "forward": (lambda e: e.runner, "forward", lambda step: True),
    "sampling": (lambda e: e.sampling, "sampler", lambda logits, batch: True),
    "post-processing, prefill": (lambda e: e.scheduler, "append_tokens", lambda *a: True),
    "post-processing, decode": (lambda e: e.scheduler, "append_decode_tokens", lambda *a: True),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_fault_fails_its_step_frees_everything_and_the_engine_serves_on(engine, reference, monkeypatch,
                                                                          stage) -> None:
    owner_of, name, when = STAGES[stage]
    owner = owner_of(engine)
    if name == "sampler":                     # an object, not a method: wrap its __call__
        sampler = owner.sampler
        fired = fail_once(monkeypatch, type(sampler), "__call__", lambda self, *a: self is sampler)
    else:
        fired = fail_once(monkeypatch, owner, name, when)
    outs = run(engine, PROMPTS)
    monkeypatch.undo()
    assert fired, f"the {stage} fault never fired"
    failed = [o for o in outs if o.outputs[0].finish_reason == "error"]
    assert failed, "a fault must fail the requests of its step"
    for out in failed:
        assert "InjectedFault" in out.outputs[0].error_reason
    for prompt, out in zip(PROMPTS, outs):      # the others ran to the end, unaffected
        if out.outputs[0].finish_reason != "error":
            assert out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == reference[tuple(prompt)]
    assert_clean(engine)
    after = run(engine, PROMPTS)                # the engine serves on, with the same outputs
    assert [o.outputs[0].token_ids for o in after] == [reference[tuple(p)] for p in PROMPTS]
    assert_clean(engine)


def test_a_fault_in_one_request_s_detokenization_fails_only_its_step(engine, reference, monkeypatch) -> None:
    """A fault while post-processing one request (its stop-string check) fails the step it is in."""
    from deepinfer.engine.core.request import Request
    fired = fail_once(monkeypatch, Request, "add_token", lambda self, *a: self.prompt_token_ids == list(PROMPTS[1]))
    outs = run(engine, PROMPTS)
    monkeypatch.undo()
    assert fired and outs[1].outputs[0].finish_reason == "error"
    assert_clean(engine)


def test_refused_add_request_leaves_nothing_behind(engine) -> None:
    for bad_id in ("_x", "", "x" * 1000):
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request(bad_id, [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("ok", [1, 10**9], GREEDY)
    with pytest.raises(TypeError, match="params"):
        engine.add_request("ok", [1, 2], {"max_tokens": 3})
    assert_clean(engine)
    assert engine.add_request("ok", [1, 2], GREEDY) == "ok"      # the refused ids are free
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(engine)


def test_a_request_that_can_never_fit_finishes_in_both_preemption_modes() -> None:
    for stop in (True, False):
        engine = LLMEngine(EngineArgs(num_kv_blocks=2, block_size=64, max_num_seqs=2, stop_preempted_request=stop))
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        (out,) = run(engine, [[5] * 60], params, max_steps=80)
        assert out.outputs[0].finish_reason == "preempted"
        assert 0 < len(out.outputs[0].token_ids) < 200
        engine.abort_request(out.request_id)          # a finished id: ignored, no KeyError
        assert_clean(engine)


def test_engine_calls_from_several_threads_are_serialised(engine, reference) -> None:
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            engine.add_request(f"thread-{index}", list(PROMPTS[index % len(PROMPTS)]), GREEDY)
            while index not in results:
                for out in engine.step():
                    if out.finished and out.request_id.startswith("thread-"):
                        results[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and sorted(results) == list(range(6))
    for index, tokens in results.items():
        assert tokens == reference[tuple(PROMPTS[index % len(PROMPTS)])]
    assert_clean(engine)


@pytest.fixture(scope="module")
def llm(engine: LLMEngine) -> LLM:
    return LLM(num_kv_blocks=16, max_num_seqs=4)


def test_the_offline_llm_recomputes_by_default(llm) -> None:
    assert llm.engine.args.stop_preempted_request is False
    assert LLM(num_kv_blocks=16, stop_preempted_request=True).engine.args.stop_preempted_request is True


def test_generate_checks_every_prompt_before_queueing_any(llm) -> None:
    with pytest.raises(ValueError, match=r"prompts\[1\].*prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 10**9]}], GREEDY, use_tqdm=False)
    assert_clean(llm.engine)


def test_generate_interrupted_leaves_no_request_behind(llm, reference, monkeypatch) -> None:
    calls = []
    step = llm.engine.step

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm.engine)
    outs = llm.generate([{"prompt_token_ids": list(PROMPTS[0])}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference[PROMPTS[0]]      # nothing of the old call in it


def test_generate_from_several_threads_runs_the_calls_one_at_a_time(llm, reference) -> None:
    results: dict[int, list] = {}

    def client(index: int) -> None:
        prompt = PROMPTS[index % len(PROMPTS)]
        results[index] = llm.generate([{"prompt_token_ids": list(prompt)}], GREEDY, use_tqdm=False)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for index, outs in results.items():
        assert outs[0].outputs[0].token_ids == reference[PROMPTS[index % len(PROMPTS)]]
    assert sorted(results) == [0, 1, 2, 3]
    assert_clean(llm.engine)


def test_the_offline_llm_recomputes_while_llm_engine_finishes_preempted_requests_with_a_warning(caplog) -> None:
    assert EngineArgs().stop_preempted_request is True
    engine = LLMEngine(EngineArgs(num_kv_blocks=2, block_size=64, max_num_seqs=2))
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with caplog.at_level("WARNING", logger="deepinfer.engine.llm_engine"):
        (out,) = run(engine, [[5] * 60], params, max_steps=80)
    assert out.outputs[0].finish_reason == "preempted"
    assert any("finished as 'preempted'" in r.getMessage() for r in caplog.records)
