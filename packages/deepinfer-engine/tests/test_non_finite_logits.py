"""Rows with non-finite logits fail their request ("non-finite logits"); the other rows are unaffected."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.core.model_runner import StepBatch
from deepinfer.engine.sampling.sampler import Sampler
from deepinfer.engine.sampling.sampling_batch import RequestRng
from deepinfer.engine.sampling.sampling_stage import NON_FINITE_LOGITS, RowParams, SamplingStage, StepRows

VOCAB_SIZE = 12


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), "all -inf"])
def test_sampling_fails_only_the_row_with_non_finite_logits(poison: float | str) -> None:
    logits = torch.zeros(3, VOCAB_SIZE)
    logits[:, 7] = 5.0
    if poison == "all -inf":
        logits[1] = -torch.inf
    else:
        logits[1, 3] = poison
    stage = SamplingStage(Sampler(seed=0), eos_token_ids=[0], vocab_size=VOCAB_SIZE)
    params = {"greedy": SamplingParams(temperature=0.0, logprobs=1), "bad": SamplingParams(logprobs=1),
              "seeded": SamplingParams(top_k=1, seed=4)}

    rngs = {seq_id: RequestRng.for_params(p) for seq_id, p in params.items()}

    seq_ids = ("greedy", "bad", "seeded")
    rows = StepRows.from_rows([RowParams(params[seq_id], rngs[seq_id], 0) for seq_id in seq_ids])
    sampled = stage.collect(stage.launch(seq_ids, logits, rows, guarded=True))
    tokens = sampled.tokens()
    assert [(t.seq_id, t.error) for t in tokens] == [("greedy", None), ("bad", NON_FINITE_LOGITS),
                                                     ("seeded", None)]
    assert tokens[0].token_id == 7 and tokens[2].token_id == 7
    assert tokens[0].logprobs is not None and tokens[1].logprobs is None


def test_sampling_reads_the_step_back_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Token ids and the finite flags come to the host together: one `.tolist()` per step (plus those
    # of the logprobs, only when a row asked for them).
    logits = torch.zeros(2, VOCAB_SIZE)
    logits[0, 1] = float("nan")
    stage = SamplingStage(Sampler(seed=0), eos_token_ids=[0], vocab_size=VOCAB_SIZE)
    calls = []
    tolist = torch.Tensor.tolist

    def counting_tolist(tensor: torch.Tensor) -> object:
        calls.append(tuple(tensor.shape))
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)

    rows = StepRows([SamplingParams()] * 2, [None] * 2, [0] * 2)
    sampled = stage.collect(stage.launch(("a", "b"), logits, rows))
    tokens = sampled.tokens()
    assert calls == [(2, 2)]
    assert [t.error for t in tokens] == [NON_FINITE_LOGITS, None]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=4)      # the embedded tiny model, CPU, float32


def test_engine_finishes_a_request_with_non_finite_logits_as_error(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    prompts = {"a": "def fibonacci(", "bad": "import os\n", "c": "class Stack:"}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run() -> dict:
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, params)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
        return finished

    clean = run()
    forward = engine.runner.forward
    num_bad_rows = 0

    def poisoned_forward(step: StepBatch) -> torch.Tensor:
        nonlocal num_bad_rows
        logits = forward(step)
        if "bad" in step.sample_seq_ids:
            num_bad_rows += 1
            if num_bad_rows == 2:            # the request's second token: after a good one
                logits = logits.clone()
                logits[step.sample_seq_ids.index("bad"), 11] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "forward", poisoned_forward)
    poisoned = run()
    bad = poisoned["bad"]
    assert (bad.finish_reason, bad.error_reason) == ("error", NON_FINITE_LOGITS)
    assert bad.token_ids == clean["bad"].token_ids[:1]
    for request_id in ("a", "c"):
        assert poisoned[request_id].finish_reason == "length"
        assert poisoned[request_id].token_ids == clean[request_id].token_ids
        assert len(poisoned[request_id].token_ids) == 4
