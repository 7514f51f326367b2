"""The steady decode step (decode_rows.py, issue #17): post-processing a step of the same rows as the
last one in bulk gives exactly the outputs of the per-row path, with ZOS on and off, through length
and stop-id ends, min_tokens, EOS, seeded sampling, aborts at fixed steps and per-step output kinds
mixed with FINAL_ONLY ones."""

from __future__ import annotations

import functools

import pytest

from deepinfer.engine import LLMEngine, OutputKind, SamplingParams
from deepinfer.engine.config.engine_args import EngineArgs

PROMPTS = ("def fibonacci(", "import os\n", "class Parser:", "for i in range(", "x = [", "    return self.")


@functools.cache
def _engine(zos: bool) -> LLMEngine:
    return LLMEngine(EngineArgs(max_num_seqs=8, seed=0, zero_overhead_scheduling=zos))


def _trace(stop_id: int) -> list[tuple[str, str, SamplingParams, OutputKind, int | None]]:
    """(request id, prompt, params, output kind, abort before this step) per request."""
    greedy = dict(temperature=0.0)
    seeded = dict(temperature=0.8, top_p=0.9)
    cases = [
        (dict(greedy, max_tokens=9, ignore_eos=True), OutputKind.FINAL_ONLY, None),
        (dict(greedy, max_tokens=30, stop_token_ids=[stop_id]), OutputKind.FINAL_ONLY, None),
        (dict(greedy, max_tokens=30, stop_token_ids=[stop_id], min_tokens=12), OutputKind.FINAL_ONLY, None),
        (dict(seeded, seed=7, max_tokens=14), OutputKind.FINAL_ONLY, None),
        (dict(greedy, max_tokens=20, ignore_eos=True), OutputKind.CUMULATIVE, None),
        (dict(seeded, seed=3, max_tokens=25, ignore_eos=True), OutputKind.FINAL_ONLY, 11),
        (dict(greedy, max_tokens=1), OutputKind.FINAL_ONLY, None),
        (dict(greedy, max_tokens=17, ignore_eos=True), OutputKind.DELTA, None),
    ]
    return [(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(**kw), kind, abort)
            for i, (kw, kind, abort) in enumerate(cases)]


def _run(zos: bool, steady: bool, stop_id: int) -> tuple[dict[str, tuple], int]:
    engine = _engine(zos)
    plain = engine.plain_step
    step_rows, bulk = plain.step_rows, plain._post_process_steady
    calls = [0]

    def no_steady(*args, **kwargs):
        rows = step_rows(*args, **kwargs)
        plain.steady = None              # every step takes the per-row path
        return rows

    def counting(*args, **kwargs):
        calls[0] += 1
        return bulk(*args, **kwargs)

    if not steady:
        plain.step_rows = no_steady
    plain._post_process_steady = counting
    results: dict[str, tuple] = {}
    texts: dict[str, str] = {}
    try:
        trace = _trace(stop_id)
        for request_id, prompt, params, kind, _ in trace:
            engine.add_request(request_id, prompt, params, output_kind=kind)
        aborts = {abort: request_id for request_id, _, _, _, abort in trace if abort is not None}
        kinds = {request_id: kind for request_id, _, _, kind, _ in trace}
        step = 0
        while engine.has_unfinished_requests():
            if step in aborts:
                engine.abort_request(aborts[step])
            for out in engine.step():
                completion = out.outputs[0]
                if kinds[out.request_id] is OutputKind.DELTA:      # the text so far, from the deltas
                    texts[out.request_id] = texts.get(out.request_id, "") + completion.text
                else:
                    texts[out.request_id] = completion.text
                if out.finished:
                    results[out.request_id] = (tuple(completion.token_ids), completion.finish_reason,
                                               completion.stop_reason, texts[out.request_id])
            step += 1
    finally:
        del plain._post_process_steady
        if not steady:
            del plain.step_rows
    assert engine.num_in_flight == 0 and not engine.scheduler.has_unfinished()
    return results, calls[0]


@pytest.mark.parametrize("zos", [True, False])
def test_steady_decode_steps_give_the_per_row_outputs(zos: bool) -> None:
    # a stop id the greedy model does produce for request r1's prompt, after a few tokens
    probe = _engine(zos)
    probe.add_request("probe", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                      output_kind=OutputKind.FINAL_ONLY)
    tokens = []
    while probe.has_unfinished_requests():
        tokens += [t for out in probe.step() for t in out.outputs[0].token_ids]
    stop_id = tokens[6]
    per_row, none_bulk = _run(zos, steady=False, stop_id=stop_id)
    bulk, bulk_steps = _run(zos, steady=True, stop_id=stop_id)
    assert none_bulk == 0 and bulk_steps > 5
    assert bulk == per_row
    assert per_row["r1"][1] == "stop" and per_row["r1"][2] == stop_id and len(per_row["r1"][0]) <= 7
    assert len(per_row["r2"][0]) >= 12                     # min_tokens held the stop id back
    assert per_row["r0"][1] == "length" and len(per_row["r0"][0]) == 9
    assert per_row["r5"][1] == "abort" and len(per_row["r6"][0]) == 1
