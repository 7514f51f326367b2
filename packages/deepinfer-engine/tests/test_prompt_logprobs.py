"""prompt_logprobs (chunked prefill included) equal the raw log_softmax of a reference forward, and
logprob entries carry rank and decoded token (vLLM's `Logprob` shape) without changing `logprobs`."""

from __future__ import annotations

import functools

import pytest

from deepinfer.engine import LLMEngine, Logprob, SamplingParams
from deepinfer.engine.config.engine_args import EngineArgs

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@functools.cache
def engine(max_num_batched_tokens: int) -> LLMEngine:
    return LLMEngine(EngineArgs(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens))


def finals(eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (ids, params) in requests.items():
        eng.add_request(request_id, {"prompt_token_ids": ids}, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_prompt_logprobs_match_a_reference_forward_of_every_prefix() -> None:
    chunked = engine(16)                                 # the prompt spans several prefill chunks
    prompt = chunked.tokenizer.encode(TEXT)
    assert len(prompt) > 40
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, n=2)
    out = finals(chunked, {"p": (prompt, params)})["p"]
    got = out.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    # reference: the prefix up to position i, forced to sample prompt[i + 1] (its raw logprob comes back)
    reference = engine(2048)
    forced = {f"r{i}": (prompt[:i], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3,
                                                   allowed_token_ids=[prompt[i]], logprob_entries=True))
              for i in range(1, len(prompt))}
    ref = finals(reference, forced)
    for i in range(1, len(prompt)):
        entry = got[i]
        want = ref[f"r{i}"].outputs[0]
        assert want.token_ids == [prompt[i]]
        assert set(entry) == set(want.logprobs[0])       # the prompt token and the 3 most likely
        for token, logprob in want.logprobs[0].items():
            assert entry[token].logprob == pytest.approx(logprob, abs=2e-4), (i, token)
        assert entry[prompt[i]].rank == want.logprob_entries[0][prompt[i]].rank
        assert entry[prompt[i]].decoded_token == chunked.tokenizer.decode([prompt[i]], skip_special_tokens=False)
        assert max(entry.values(), key=lambda lp: lp.logprob).rank == 1


def test_logprob_entries_are_opt_in_and_agree_with_the_plain_logprobs() -> None:
    eng = engine(2048)
    prompt = eng.tokenizer.encode("import os\n")
    plain = SamplingParams(temperature=0.8, seed=2, max_tokens=6, logprobs=2)
    done = finals(eng, {"plain": (prompt, plain),
                        "rich": (prompt, SamplingParams(temperature=0.8, seed=2, max_tokens=6, logprobs=2,
                                                        logprob_entries=True))})
    a, b = done["plain"].outputs[0], done["rich"].outputs[0]
    assert a.logprob_entries is None and done["plain"].prompt_logprobs is None
    assert a.token_ids == b.token_ids
    # two rows of one batch: equal up to the CPU matmul's row-dependent rounding (no batch-invariant mode)
    for plain_lp, rich_lp in zip(a.logprobs, b.logprobs, strict=True):
        assert list(plain_lp) == list(rich_lp)
        assert list(plain_lp.values()) == pytest.approx(list(rich_lp.values()), abs=1e-5)
    for token, logprobs, entries in zip(b.token_ids, b.logprobs, b.logprob_entries):
        assert list(entries) == list(logprobs)
        assert all(isinstance(e, Logprob) and e.logprob == logprobs[t] for t, e in entries.items())
        top = sorted(logprobs.values(), reverse=True)
        assert entries[token].rank >= 1 and (entries[token].rank == 1) == (logprobs[token] == top[0])
        assert entries[token].decoded_token == eng.tokenizer.decode([token], skip_special_tokens=False)
    with pytest.raises(ValueError, match="logprob_entries=True needs logprobs"):
        SamplingParams(logprob_entries=True)
