"""A hypothesis state machine over random add / abort / step / generate calls with random
parameters. After every action: the scheduler's bookkeeping is intact (no leaked block or slot),
no request is older than a bounded number of steps, and every greedy output is a prefix of (or,
when it ran to its length, equal to) what a fresh engine gives for that prompt alone."""

from __future__ import annotations

import functools

import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer.engine import LLM, LLMEngine, RequestOutput, SamplingParams
from deepinfer.engine.config.engine_args import EngineArgs

PROMPTS = ((1, 2, 3, 4, 5, 6, 7), (9, 8), (3,) * 20, (100, 200, 300, 400))
MAX_TOKENS = 8
# A request ends within this many steps of its arrival: every other live request (at most
# MAX_LIVE) may run its prompt and all its tokens first, twice over with recomputes.
MAX_LIVE = 6
STEP_BOUND = 2 * MAX_LIVE * (max(len(p) for p in PROMPTS) + MAX_TOKENS) + 10


@functools.cache
def reference(prompt: tuple[int, ...]) -> list[int]:
    """Greedy tokens of `prompt` alone on a fresh engine."""
    engine = _fresh_reference_engine()
    rid = engine.add_request(None, list(prompt), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("the reference request never finished")


@functools.cache
def _fresh_reference_engine() -> LLMEngine:
    return LLMEngine(EngineArgs(max_num_seqs=1))


@functools.cache
def llm(stop_preempted: bool) -> LLM:
    # 4 usable blocks of 64 tokens, 4 sequences at once: preemption happens under load.
    return LLM(num_kv_blocks=5, max_num_seqs=4, stop_preempted_request=stop_preempted)


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.0, 0.7]),
    max_tokens=st.integers(1, MAX_TOKENS),
    ignore_eos=st.just(True),
    seed=st.sampled_from([None, 3]),
    logprobs=st.sampled_from([None, 2]),
)


class EngineMachine(RuleBasedStateMachine):
    @initialize(stop_preempted=st.booleans())
    def start(self, stop_preempted: bool) -> None:
        self.llm = llm(stop_preempted)
        self.engine = self.llm.engine
        assert not self.engine.has_unfinished_requests()
        self.live: dict[str, tuple[tuple[int, ...], SamplingParams, int]] = {}   # id -> prompt, params, age
        self.num_added = 0
        original_step = LLMEngine.step
        engine = self.engine

        def recording_step() -> list[RequestOutput]:      # every output is checked, whoever stepped
            outputs = original_step(engine)
            for request_id in list(self.live):
                prompt, params, age = self.live[request_id]
                self.live[request_id] = (prompt, params, age + 1)
            for out in outputs:
                self._check(out)
            return outputs

        engine.step = recording_step

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for _ in range(STEP_BOUND):
            if not self.engine.has_unfinished_requests():
                break
            self.engine.step()
        del self.engine.step
        assert not self.live and not self.engine.has_unfinished_requests()
        self.engine.scheduler.check_integrity()

    def _check(self, out: RequestOutput) -> None:
        if out.request_id not in self.live:
            return
        prompt, params, _ = self.live[out.request_id]
        completion = out.outputs[0]
        assert len(completion.token_ids) <= params.max_tokens
        if params.logprobs is not None:
            assert len(completion.logprobs) == len(completion.token_ids)
        if params.temperature == 0.0:
            expect = reference(prompt)[: params.max_tokens]
            assert completion.token_ids == expect[: len(completion.token_ids)]
            if completion.finish_reason == "length":
                assert completion.token_ids == expect
        if out.finished:
            assert completion.finish_reason in ("length", "abort", "preempted")
            del self.live[out.request_id]

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(prompt=st.sampled_from(PROMPTS), params=params_strategy)
    def add(self, prompt: tuple[int, ...], params: SamplingParams) -> None:
        self.num_added += 1
        request_id = f"r{self.num_added}"
        self.live[request_id] = (prompt, params, 0)
        assert self.engine.add_request(request_id, list(prompt), params) == request_id

    @rule(data=st.data())
    def abort(self, data) -> None:
        ids = sorted(self.live) + ["never-added"]
        self.engine.abort_request(data.draw(st.sampled_from(ids)))

    @rule(count=st.integers(1, 4))
    def step(self, count: int) -> None:
        for _ in range(count):
            self.engine.step()

    @precondition(lambda self: len(self.live) < MAX_LIVE - 1)
    @rule(prompts=st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=2), max_tokens=st.integers(1, 4))
    def generate(self, prompts: list[tuple[int, ...]], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            # The offline LLM recomputes by default, but this LLM was built with the machine's mode.
            assert out.outputs[0].finish_reason in ("length", "preempted")
            assert out.outputs[0].token_ids == reference(prompt)[: len(out.outputs[0].token_ids)]
            if out.outputs[0].finish_reason == "length":
                assert len(out.outputs[0].token_ids) == max_tokens

    @invariant()
    def bookkeeping_is_intact(self) -> None:
        if hasattr(self, "engine"):
            self.engine.scheduler.check_integrity()

    @invariant()
    def no_request_is_stuck(self) -> None:
        for request_id, (_, _, age) in getattr(self, "live", {}).items():
            assert age <= STEP_BOUND, f"{request_id} still running after {age} steps"


EngineMachine.TestCase.settings = settings(
    max_examples=8, stateful_step_count=12, deadline=None, derandomize=True,
    phases=[Phase.explicit, Phase.generate],       # no shrinking: a failure prints its steps at once
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_engine_state_machine = EngineMachine.TestCase
