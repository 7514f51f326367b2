"""The host side of one engine step (issue #17): outputs are per-step snapshots that share only the
prompt list, text kept from the deltas equals the stop-string checker's, running outputs built
without checks equal checked ones, the worker's per-step row parameters and results, and the decode
batch built from the scheduler's arrays."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from deepinfer.engine import LLMEngine, SamplingParams
from deepinfer.engine.config.engine_args import EngineArgs
from deepinfer.engine.core.outputs import CompletionOutput, RequestOutput, running_output
from deepinfer.engine.core.request import Request
from deepinfer.engine.llm_engine import resolve_model_dir
from deepinfer.engine.sampling.sampling_batch import InvalidSamplingBatch, RequestRng, build_sampling_batch
from deepinfer.engine.sampling.sampling_stage import NON_FINITE_LOGITS, RowParams, SampledStep, SampledToken, StepRows
from deepinfer.engine.text.tokenizer import load_tokenizer
from deepinfer.model import ForwardBatch


@functools.cache
def _engine() -> LLMEngine:
    return LLMEngine(EngineArgs(max_num_seqs=4))


def test_outputs_are_snapshots_sharing_one_prompt_list() -> None:
    engine = _engine()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rid = engine.add_request(None, "def fibonacci(", params)
    other = engine.add_request(None, {"prompt_token_ids": [5, 6, 7]}, params)
    seen: dict[str, list[RequestOutput]] = {rid: [], other: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    outs = seen[rid]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5, 6]     # later steps changed none
    assert all(o.prompt_token_ids is outs[0].prompt_token_ids for o in outs)
    assert outs[0].prompt_token_ids == engine.tokenizer.encode("def fibonacci(")
    assert seen[other][0].prompt_token_ids == [5, 6, 7]
    assert seen[other][0].prompt_token_ids is not seen[rid][0].prompt_token_ids
    final = outs[-1].outputs[0]
    assert [o.finished for o in outs] == [False] * 5 + [True] and final.finish_reason == "length"
    for earlier in outs[:-1]:
        assert final.token_ids[: len(earlier.outputs[0].token_ids)] == earlier.outputs[0].token_ids
        assert final.text.startswith(earlier.outputs[0].text)
        assert earlier.outputs[0].token_ids is not final.token_ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_text_without_stop_strings_equals_the_checkers_text(seed: int) -> None:
    # Without stop strings the request keeps the text itself; with one that never matches, the
    # checker releases it: both texts agree after every token and at the end.
    tokenizer = load_tokenizer(resolve_model_dir(None))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4096, 40).tolist()

    def request(stop: list[str]) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=len(tokens), ignore_eos=True, stop=stop)
        return Request("r", None, [1, 2], params, tokenizer, eos_token_ids=(0,), max_model_len=4096, device="cpu")

    plain, checked = request([]), request(["\x00\x01 never"])
    for token in tokens:
        plain.add_token(token, None)
        checked.add_token(token, None)
        assert plain.to_output().outputs[0].text == checked.to_output().outputs[0].text
    assert plain.finished and checked.finished
    assert plain.to_output() == checked.to_output()


def test_running_output_equals_the_checked_construction() -> None:
    logprobs = [{3: -0.5}, {4: -1.0}]
    fast = running_output("r", "p", [1, 2], "ab", [3, 4], logprobs)
    checked = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "ab", [3, 4], None, logprobs)], False)
    assert fast == checked and not fast.finished and fast.outputs[0].finish_reason is None


def test_step_rows_from_rows_and_sampled_step_tokens() -> None:
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(seed=3)
    rng = RequestRng.for_params(seeded)
    rows = StepRows.from_rows([RowParams(greedy, None, 2), RowParams(seeded, rng, 0)])
    assert (list(rows.params), list(rows.rngs), list(rows.num_output_tokens)) == ([greedy, seeded], [None, rng], [2, 0])
    assert rows.grammars is None
    step = SampledStep(("a", "b"), [5, 6], [{5: -0.1}, None], {1: NON_FINITE_LOGITS})
    assert step.tokens() == [SampledToken("a", 5, {5: -0.1}), SampledToken("b", 6, None, NON_FINITE_LOGITS)]


def test_sampling_batch_names_the_first_row_whose_rng_does_not_match() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams(seed=2)]
    with pytest.raises(InvalidSamplingBatch, match=r"rngs\[1\]"):
        build_sampling_batch(params, rngs=[None, None, None], num_output_tokens=[0, 0, 0], eos_token_ids=[0],
                             vocab_size=16)


def test_decode_step_is_built_from_the_scheduler_arrays() -> None:
    engine = _engine()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for prompt in ([1, 2, 3], [4] * 70):
        engine.add_request(None, prompt, params)
    seen = []
    prepare = engine.runner.prepare

    def spy(out):
        step = prepare(out)
        if step is not None and out.decode is not None:
            d = out.decode
            expected = ForwardBatch.build([[t] for t in d.last_token_ids.tolist()], (d.seq_lens - 1).tolist(),
                                          [row.tolist() for row in d.block_tables], d.state_slots.tolist())
            assert torch.equal(step.batch.block_tables, expected.block_tables)
            assert torch.equal(step.batch.token_ids, expected.token_ids)
            assert torch.equal(step.batch.positions, expected.positions)
            assert step.batch.start_positions == expected.start_positions and step.logits_rows is None
            seen.append(d.num_seqs)
        return step

    engine.runner.prepare = spy
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del engine.runner.prepare
    assert seen and max(seen) == 2


def test_a_reused_sampling_batch_samples_as_a_fresh_one() -> None:
    """The steady decode step reuses the previous step's SamplingBatch (same rows, nothing banned or
    constrained): the seeded rows' draw positions still move with their output counts, so every step
    samples exactly as a batch built from scratch; a row still below min_tokens gets a new batch."""
    from deepinfer.engine.sampling.sampler import Sampler
    from deepinfer.engine.sampling.sampling_stage import SamplingStage

    vocab = 64
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=5)
    unseeded = SamplingParams(temperature=0.7, top_p=0.9)
    params = [greedy, seeded, unseeded, seeded]
    rngs = [None, RequestRng(5), None, RequestRng(6)]
    reusing = SamplingStage(Sampler(seed=1), (0,), vocab)
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(0))
    first = None
    for step in range(4):
        counts = [3 + step, 7 + step, 1 + step, 2 + step]
        flight = reusing.launch(("a", "b", "c", "d"), logits, StepRows(params, rngs, counts))
        assert flight.batch.draw_positions == (7 + step, 1 + step, 2 + step)
        first = first or flight.batch
        assert flight.batch.greedy_rows is first.greedy_rows      # reused, not rebuilt
        fresh = build_sampling_batch(params, rngs=[None, RequestRng(5), None, RequestRng(6)], num_output_tokens=counts,
                                     eos_token_ids=(0,), vocab_size=vocab)
        want = Sampler(seed=1)(logits, fresh).token_ids
        assert flight.token_ids[[0, 1, 3]].tolist() == want[[0, 1, 3]].tolist()   # row 2 draws from a shared stream
    banned = [SamplingParams(temperature=0.0, min_tokens=10)] * 4
    flight = reusing.launch(("a", "b", "c", "d"), logits, StepRows(banned, [None] * 4, [3, 4, 5, 6]))
    assert flight.batch.banned_rows.tolist() == [0, 1, 2, 3]
