"""ZOS on and off give the same tokens and finish reasons, and leave nothing behind.

One trace per scenario is replayed through two engines, `zero_overhead_scheduling` off and on:
greedy and seeded sampling, stop strings, EOS, `max_tokens=1`, aborts, structured output and prompts
that arrive mid-decode (at fixed step indices), then preemption under a cache too small for the load,
recomputed and finished. Aborts are keyed by the request's own token count: under ZOS the host sees
tokens one step later, so an abort at a fixed step would cut at a different length by design.

Preemption is timed by the cache's fill: it comes at the same step with ZOS on and off as long as no
request has ended yet (an end is seen one step later under ZOS, so its blocks come back one step
later); the preemption scenarios keep every end after the preemptions.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from deepinfer.engine import LLMEngine, SamplingParams, StructuredOutput
from deepinfer.engine.config.engine_args import EngineArgs
from deepinfer.engine.device.sync_guard import CudaSyncError

PROMPTS = ("def fibonacci(", "import os\n", "class Parser:", "for i in range(", "x = [", "    return self.")


@dataclasses.dataclass(frozen=True)
class Arrival:
    step: int                     # added just before this step() call (0 = at the start)
    request_id: str
    prompt: str
    params: SamplingParams
    abort_after: int | None = None   # abort once the request has this many output tokens


@dataclasses.dataclass(frozen=True)
class Result:
    token_ids: tuple[int, ...]
    finish_reason: str
    text: str


@dataclasses.dataclass
class Replay:
    results: dict[str, Result]
    engine: LLMEngine
    steps_left_in_flight: int = 0     # step() calls that returned with a decode step still in flight
    preempted: int = 0                # preemptions (recomputed or finished)


def replay(zos: bool, arrivals: tuple[Arrival, ...], **engine_args: object) -> Replay:
    engine = _engine(zos, tuple(sorted(engine_args.items())))
    results: dict[str, Result] = {}
    run = Replay(results, engine)
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        run.preempted += len(out.preempted_seq_ids)
        return out

    engine.scheduler.schedule = counting_schedule
    pending = sorted(arrivals, key=lambda a: a.step)
    abort_after = {a.request_id: a.abort_after for a in arrivals if a.abort_after is not None}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            engine.add_request(arrival.request_id, arrival.prompt, arrival.params)
        for out in engine.step():
            completion = out.outputs[0]
            limit = abort_after.get(out.request_id)
            if not out.finished and limit is not None and len(completion.token_ids) >= limit:
                engine.abort_request(out.request_id)
            if out.finished:
                results[out.request_id] = Result(tuple(completion.token_ids), completion.finish_reason,
                                                 completion.text)
        run.steps_left_in_flight += engine.num_in_flight > 0
        step += 1
        assert step < 2000, "the trace never finished"
    del engine.scheduler.schedule
    return run


@functools.cache
def _engine(zos: bool, args: tuple[tuple[str, object], ...]) -> LLMEngine:
    return LLMEngine(EngineArgs(zero_overhead_scheduling=zos, **dict(args)))


def assert_nothing_left(engine: LLMEngine) -> None:
    engine.scheduler.check_integrity()
    assert not engine.scheduler.has_unfinished() and not engine._requests
    assert engine.kv_blocks.num_free == engine.runner.plan.num_kv_blocks - 1      # block 0 is reserved
    assert engine.num_in_flight == 0


def assert_same_with_zos_on_and_off(arrivals: tuple[Arrival, ...], **engine_args: object) -> tuple[Replay, Replay]:
    off = replay(False, arrivals, **engine_args)
    on = replay(True, arrivals, **engine_args)
    assert set(off.results) == {a.request_id for a in arrivals}
    assert on.results == off.results
    assert off.steps_left_in_flight == 0 and on.steps_left_in_flight > 10     # ZOS really overlapped
    assert on.preempted == off.preempted
    assert_nothing_left(off.engine)
    assert_nothing_left(on.engine)
    return off, on


def test_mixed_trace_is_identical_with_zos_on_and_off() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=20, logprobs=2)
    arrivals = (
        Arrival(0, "greedy", PROMPTS[0], greedy),
        Arrival(0, "seeded", PROMPTS[1], seeded),
        Arrival(0, "one", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=1)),
        Arrival(0, "newline", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=40, stop=["\n"])),
        Arrival(0, "eos", PROMPTS[4], SamplingParams(temperature=1.0, seed=3, max_tokens=60)),
        Arrival(1, "aborted", PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=30), abort_after=5),
        Arrival(4, "late", PROMPTS[0], SamplingParams(temperature=0.7, seed=5, max_tokens=12, min_tokens=6)),
        Arrival(7, "later", PROMPTS[2], dataclasses.replace(greedy, max_tokens=9)),
        Arrival(7, "seeded-twin", PROMPTS[1], seeded),
        Arrival(9, "choice", PROMPTS[3], SamplingParams(
            temperature=0.0, max_tokens=10, structured=StructuredOutput(choice=("alpha", "beta", "gamma")))),
        Arrival(12, "aborted-late", PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=30), abort_after=2),
    )
    off, _ = assert_same_with_zos_on_and_off(arrivals, max_num_seqs=8)
    results = off.results
    assert off.preempted == 0
    assert results["seeded"] == results["seeded-twin"]       # a seeded request does not depend on its batch
    assert results["one"].finish_reason == "length" and len(results["one"].token_ids) == 1
    assert results["newline"].finish_reason == "stop" and "\n" not in results["newline"].text
    assert results["aborted"].finish_reason == "abort" and len(results["aborted"].token_ids) == 5
    assert results["choice"].text in ("alpha", "beta", "gamma")
    assert len(results["late"].token_ids) >= 6


@pytest.mark.parametrize("stop_preempted", [False, True], ids=["recompute", "finish"])
def test_preemption_is_identical_with_zos_on_and_off(stop_preempted: bool) -> None:
    # 3 usable blocks of 64 tokens for 4 sequences that each grow past one block: the cache runs out
    # mid-decode, before any request ends.
    arrivals = tuple(
        Arrival(0, f"r{i}", PROMPTS[i] * 6, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=70,
                                                            ignore_eos=True))
        for i in range(4)
    )
    engine_args = {"num_kv_blocks": 4, "block_size": 64, "max_num_seqs": 4, "stop_preempted_request": stop_preempted}
    off, _ = assert_same_with_zos_on_and_off(arrivals, **engine_args)
    assert off.preempted > 0
    reasons = sorted(r.finish_reason for r in off.results.values())
    if stop_preempted:
        assert "preempted" in reasons
    else:
        assert reasons == ["length"] * 4 and all(len(r.token_ids) == 70 for r in off.results.values())


def test_the_sync_guard_catches_a_synchronising_call_in_the_launch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(EngineArgs(zero_overhead_scheduling=True, max_num_seqs=2))
    prepare = engine.runner.prepare

    def prepare_and_read_back(out):
        step = prepare(out)
        if step is not None and step.rows is not None:
            step.batch.token_ids.tolist()      # a device read: waits for the GPU on CUDA
        return step

    monkeypatch.setattr(engine.runner, "prepare", prepare_and_read_back)
    engine.add_request("r", "def f(", SamplingParams(temperature=0.0, max_tokens=6))
    outs = [out for _ in range(8) for out in engine.step()]
    final = [out for out in outs if out.finished]
    assert final and final[0].outputs[0].finish_reason == "error"
    assert CudaSyncError.__name__ in final[0].outputs[0].error_reason


def test_the_sync_guard_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_DISABLE_SYNC_GUARD", "1")
    engine = LLMEngine(EngineArgs(zero_overhead_scheduling=True, max_num_seqs=2))
    assert not engine.sampling.sync_guard
    calls = []
    sampler = engine.sampling.sampler
    original = type(sampler).__call__

    def sampler_with_read(self, logits, batch):
        calls.append(logits.sum().item())      # allowed: the guard is off
        return original(self, logits, batch)

    monkeypatch.setattr(type(sampler), "__call__", sampler_with_read)
    engine.add_request("r", "def f(", SamplingParams(temperature=0.0, max_tokens=4))
    final = [out for _ in range(8) for out in engine.step() if out.finished]
    # 4 tokens, then the step that ZOS launched before it saw the 4th (its token is dropped).
    assert final[0].outputs[0].finish_reason == "length" and len(final[0].outputs[0].token_ids) == 4
    assert len(calls) == 5


def test_zos_is_on_by_default_except_for_prompt_engines() -> None:
    from deepinfer.sched import EngineType

    assert EngineArgs().zos and EngineArgs(engine_type=EngineType.COMPLETION).zos
    assert not EngineArgs(engine_type=EngineType.PROMPT).zos
    assert not EngineArgs(zero_overhead_scheduling=False).zos


# ---------------------------------------------------------------- speculative decode steps under ZOS
# The embedded model ships a trained DSpark head (about 2 tokens per verify step), so accepted runs,
# and ends inside them, come naturally. Greedy rows and seeded temperature-only rows draft; top-p rows,
# grammars and penalties feed one token. (A seeded row with min_tokens still pending does not draft,
# judged from the tokens on the host, which lag under ZOS: its draws could then differ, so the trace
# gives min_tokens to a greedy row.)

SPEC = {"num_speculative_tokens": 5, "varlen_verify": False, "max_num_seqs": 8}


def test_speculative_trace_is_identical_with_zos_on_and_off() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=24, logprobs=2)
    arrivals = (
        Arrival(0, "greedy", PROMPTS[0], greedy),
        Arrival(0, "seeded", PROMPTS[1], seeded),
        Arrival(0, "one", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=1)),
        Arrival(0, "newline", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=40, stop=["\n"])),
        Arrival(0, "eos", PROMPTS[4], SamplingParams(temperature=1.0, seed=3, max_tokens=60)),
        Arrival(1, "aborted", PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=30), abort_after=7),
        Arrival(3, "top-p", PROMPTS[0], SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=12)),
        Arrival(4, "min-tokens", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=14, min_tokens=9)),
        Arrival(5, "penalised", PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.8)),
        Arrival(7, "seeded-twin", PROMPTS[1], seeded),
        Arrival(9, "choice", PROMPTS[3], SamplingParams(
            temperature=0.0, max_tokens=10, structured=StructuredOutput(choice=("alpha", "beta", "gamma")))),
        Arrival(12, "aborted-late", PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=30), abort_after=3),
    )
    off, on = assert_same_with_zos_on_and_off(arrivals, **SPEC)
    results = off.results
    assert results["seeded"] == results["seeded-twin"]
    assert results["one"].finish_reason == "length" and len(results["one"].token_ids) == 1
    assert results["newline"].finish_reason == "stop" and "\n" not in results["newline"].text
    assert results["aborted"].finish_reason == "abort" and len(results["aborted"].token_ids) >= 7
    assert results["choice"].text in ("alpha", "beta", "gamma")
    assert len(results["min-tokens"].token_ids) >= 9
    for run in (off, on):        # drafts were accepted: runs of several tokens per verify step
        stats = run.engine.stats()
        assert stats.spec_accepted_tokens > 0 and stats.mean_accepted_length > 1.3
    plain = replay(False, arrivals, max_num_seqs=8)
    greedy_ids = [a.request_id for a in arrivals if a.params.temperature == 0.0 and a.abort_after is None]
    assert {i: plain.results[i] for i in greedy_ids} == {i: results[i] for i in greedy_ids}


def test_speculative_preemption_and_recompute_under_zos() -> None:
    """A cache too small for 4 growing sequences: ZOS reserves the in-flight step's k + 1 positions on
    top, so preemption comes at other steps than with ZOS off; recomputed, the greedy rows' tokens are
    the same. (A seeded row's token right after its recompute comes from the plain sampler, not from
    the verification's draws, so its tokens depend on when it was preempted, with ZOS on or off.)"""
    arrivals = tuple(
        Arrival(0, f"r{i}", PROMPTS[i] * 6, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=70,
                                                            ignore_eos=True))
        for i in range(4)
    )
    engine_args = {**SPEC, "num_kv_blocks": 4, "block_size": 64, "max_num_seqs": 4, "stop_preempted_request": False}
    off = replay(False, arrivals, **engine_args)
    on = replay(True, arrivals, **engine_args)
    assert on.preempted > 0 and on.steps_left_in_flight > 10
    assert on.results["r1"] == off.results["r1"] and on.results["r3"] == off.results["r3"]      # the greedy rows
    assert all(r.finish_reason == "length" and len(r.token_ids) == 70 for run in (on, off)
               for r in run.results.values())
    assert_nothing_left(off.engine)
    assert_nothing_left(on.engine)


def test_the_sync_guard_covers_the_speculative_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(EngineArgs(zero_overhead_scheduling=True, num_speculative_tokens=5, max_num_seqs=2))
    assert engine.zos and engine.spec is not None
    ensure_rows = engine.runner.ensure_rows

    def ensure_rows_and_read_back(num_rows: int) -> None:
        ensure_rows(num_rows)
        engine.runner.row_tokens.tolist()           # a device read: waits for the GPU on CUDA

    monkeypatch.setattr(engine.runner, "ensure_rows", ensure_rows_and_read_back)
    engine.add_request("r", "def f(", SamplingParams(temperature=0.0, max_tokens=6))
    final = [out for _ in range(8) for out in engine.step() if out.finished]
    assert final and final[0].outputs[0].finish_reason == "error"
    assert CudaSyncError.__name__ in final[0].outputs[0].error_reason


def test_varlen_verify_under_zos_splits_on_the_device_and_keeps_greedy_tokens(
        monkeypatch: pytest.MonkeyPatch, drafting_pays: None) -> None:
    """Under ZOS the varlen policy's total stays the host's choice and is split again on the device by
    the confidences of the step in flight (`query_lens_by_confidence`); greedy tokens do not depend on
    the split."""
    from deepinfer.engine.speculative import spec_step

    splits: list[tuple[int, torch.Tensor]] = []
    split = spec_step.query_lens_by_confidence

    def recording_split(confidence, total_q):
        lens = split(confidence, total_q)
        splits.append((total_q, lens))         # read after the launch (the sync guard forbids it inside)
        return lens

    monkeypatch.setattr(spec_step, "query_lens_by_confidence", recording_split)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    arrivals = tuple(Arrival(i // 2, f"r{i}", PROMPTS[i], greedy) for i in range(len(PROMPTS)))
    args = {**SPEC, "varlen_verify": True}
    off, on = assert_same_with_zos_on_and_off(arrivals, **args)
    assert splits and all(total == int(lens.sum()) for total, lens in splits)
    assert on.results == replay(False, arrivals, max_num_seqs=8).results
