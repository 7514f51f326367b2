"""Greedy generation of the engine equals transformers' greedy generation, under any batching."""

from __future__ import annotations

import pytest
from engine_twin import hf_greedy, random_prompts

from deepinfer.engine import LLM, SamplingParams

LIMITS = {
    "default": {},
    # 7-token prefill budget and 2 prompts per step: every prompt is chunked, often inside a
    # compression window, across many steps; 8-token blocks
    "tight": dict(max_num_batched_tokens=7, max_num_prompts=2, block_size=8, max_num_seqs=3),
}


@pytest.mark.parametrize("limits", sorted(LIMITS))
def test_greedy_batch_matches_transformers(tiny, limits) -> None:
    hf, model_dir = tiny
    prompts = random_prompts([5, 23, 1, 40, 12], seed=1)
    llm = LLM(model=str(model_dir), **LIMITS[limits])
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts               # input order kept
    for prompt, out in zip(prompts, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 18)


def test_preemption_finishes_the_longest_output_and_the_rest_complete(tiny) -> None:
    hf, model_dir = tiny
    prompts = random_prompts([10, 10, 10], seed=2)
    # each request needs ceil(50 / 8) = 7 blocks at the end; 11 usable blocks cannot hold three
    llm = LLM(model=str(model_dir), block_size=8, num_kv_blocks=12, stop_preempted_request=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons.count("preempted") >= 1 and reasons.count("length") >= 1
    for prompt, out in zip(prompts, outs):
        expect = hf_greedy(hf, prompt, 40)
        tokens = out.outputs[0].token_ids
        if out.outputs[0].finish_reason == "length":
            assert tokens == expect
        else:                                          # what it produced before preemption is right
            assert 0 < len(tokens) < 40 and tokens == expect[: len(tokens)]
    engine = llm.engine
    assert engine.scheduler.num_waiting == 0 and not engine.has_unfinished_requests()


def test_offline_llm_recomputes_preempted_requests_to_the_same_output(tiny) -> None:
    hf, model_dir = tiny
    prompts = random_prompts([10, 10, 10], seed=2)
    llm = LLM(model=str(model_dir), block_size=8, num_kv_blocks=12)     # recompute is LLM's default
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    recomputed = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        out = schedule()
        recomputed.extend(out.recomputed_seq_ids)
        return out

    llm.engine.scheduler.schedule = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert recomputed, "the cache is too small for all three: some request must be recomputed"
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 40)
    assert not llm.engine.has_unfinished_requests()
