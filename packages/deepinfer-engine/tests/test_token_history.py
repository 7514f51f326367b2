"""The token history is kept once (issue #17): each request's `token_ids` (prompt + outputs) is the
very list its scheduler sequence reads, through fork (n > 1), preemption with recompute, aborts and
ZOS's one-step lag, with no token appended twice or lost (`kept_once.KeptOnce` checks after every
scheduler call that reads or counts the tokens). Speculative steps: test_speculative.py."""

from __future__ import annotations

import functools

import pytest
from kept_once import KeptOnce

from deepinfer.engine import LLMEngine, OutputKind, SamplingParams
from deepinfer.engine.config.engine_args import EngineArgs

PROMPT = "def fibonacci("


@functools.cache
def engine(zos: bool, **args: object) -> LLMEngine:
    return LLMEngine(EngineArgs(max_num_seqs=8, zero_overhead_scheduling=zos, **args))


def run(eng: LLMEngine, requests: dict[str, tuple[str, SamplingParams]], abort_after: dict[str, int]
        ) -> tuple[dict[str, list[tuple[int, ...]]], KeptOnce]:
    """Each request's final token ids per sample; a request in `abort_after` is aborted once its
    sample 0 has that many tokens (reported each step); the others report only at the end (FINAL_ONLY:
    their decode tokens take the bulk path, `SteadyRows.take_tokens`)."""
    watch = KeptOnce(eng)
    try:
        for request_id, (prompt, params) in requests.items():
            kind = OutputKind.CUMULATIVE if request_id in abort_after else OutputKind.FINAL_ONLY
            eng.add_request(request_id, prompt, params, output_kind=kind)
        finals = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = [tuple(c.token_ids) for c in out.outputs]
                elif len(out.outputs[0].token_ids) >= abort_after.get(out.request_id, 1 << 30):
                    eng.abort_request(out.request_id)
            watch.check()
    finally:
        watch.close()
    eng.scheduler.check_integrity()
    assert not eng.scheduler.has_unfinished() and not eng._requests and not eng._seqs
    assert eng.kv_blocks.num_free == eng.runner.plan.num_kv_blocks - 1      # block 0 is reserved
    return finals, watch


def test_a_request_and_its_scheduler_sequence_share_one_list() -> None:
    eng = engine(True)
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=4, temperature=0.0))
    req = eng._seqs["a"]
    seq = eng.scheduler._st.seqs["a"]
    assert seq.token_ids is req.token_ids and req.token_ids == req.prompt_token_ids
    assert req.prompt_token_ids is not req.token_ids          # the views are copies, not a second history
    eng.step()
    eng.step()
    assert seq.token_ids is req.token_ids and len(req.token_ids) == req.num_prompt_tokens + req.num_output_tokens
    eng.abort_request("a")
    eng.step()
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("zos", [False, True], ids=["zos-off", "zos-on"])
def test_forked_samples_and_aborts_keep_one_list_each(zos: bool) -> None:
    requests = {
        "n3": (PROMPT, SamplingParams(temperature=0.9, seed=4, max_tokens=12, n=3, ignore_eos=True)),
        "n2": (PROMPT, SamplingParams(temperature=0.0, max_tokens=30, n=2, ignore_eos=True)),
        "one": (PROMPT, SamplingParams(temperature=0.0, max_tokens=9, stop=["\n"])),
    }
    finals, watch = run(engine(zos), requests, abort_after={"n2": 4})
    assert watch.calls["fork_seq"] == 2 and watch.num_bulk_appends > 0
    assert [len(t) for t in finals["n3"]] == [12, 12, 12] and len(set(finals["n3"])) > 1
    assert all(4 <= len(t) <= 6 for t in finals["n2"])      # aborted (ZOS sees the count a step late)
    reference, _ = run(engine(False), requests, abort_after={"n2": 4})
    assert finals["n3"] == reference["n3"] and finals["one"] == reference["one"]


@pytest.mark.parametrize("zos", [False, True], ids=["zos-off", "zos-on"])
def test_a_recompute_after_preemption_prefills_the_request_list(zos: bool) -> None:
    # 4 usable blocks of 64 tokens for 4 sequences (one of them forked) that each grow past one block
    requests = {f"r{i}": (PROMPT * 6, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=70,
                                                      ignore_eos=True, n=2 if i == 0 else 1))
                for i in range(3)}
    args = {"num_kv_blocks": 5, "block_size": 64, "stop_preempted_request": False}
    finals, watch = run(engine(zos, **args), requests, abort_after={})
    assert watch.num_recomputed > 0 and watch.num_bulk_appends > 0
    assert all(len(t) == 70 for sample in finals.values() for t in sample)
    reference, unpreempted = run(engine(zos), requests, abort_after={})
    assert unpreempted.num_recomputed == 0 and finals == reference
