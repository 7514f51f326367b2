"""n parallel samples (prefilled once, forked copy-on-write) and the sampling controls in the engine:
greedy samples identical, seeded ones distinct and reproducible, aborts free everything, penalties and
bans change the tokens as specified, ZOS on and off agree."""

from __future__ import annotations

import functools

import pytest

from deepinfer.engine import LLMEngine, SamplingParams
from deepinfer.engine.config.engine_args import EngineArgs
from deepinfer.engine.sampling.sampling_params import InvalidSamplingParams

PROMPT = "def fibonacci("


@functools.cache
def engine(zos: bool = False, **args: object) -> LLMEngine:
    return LLMEngine(EngineArgs(max_num_seqs=8, zero_overhead_scheduling=zos, **args))


def run(eng: LLMEngine, requests: dict[str, tuple[str, SamplingParams]],
        counts: dict | None = None) -> tuple[dict, int]:
    """Final outputs by request id, and the prompt tokens prefilled (`counts` gets "recomputed" too)."""
    schedule = eng.scheduler.schedule
    prefilled = 0
    counts = {} if counts is None else counts

    def counting_schedule():
        nonlocal prefilled
        out = schedule()
        prefilled += sum(len(chunk.token_ids) for chunk in out.prefill)
        counts["recomputed"] = counts.get("recomputed", 0) + len(out.recomputed_seq_ids)
        return out

    eng.scheduler.schedule = counting_schedule
    try:
        for request_id, (prompt, params) in requests.items():
            eng.add_request(request_id, prompt, params)
        finals = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                assert len(out.outputs) == requests[out.request_id][1].n
                assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
                if out.finished:
                    finals[out.request_id] = out
    finally:
        del eng.scheduler.schedule
    assert_nothing_left(eng)
    return finals, prefilled


def assert_nothing_left(eng: LLMEngine) -> None:
    eng.scheduler.check_integrity()
    assert not eng.scheduler.has_unfinished() and not eng._requests and not eng._seqs
    assert eng.kv_blocks.num_free == eng.runner.plan.num_kv_blocks - 1      # block 0 is reserved
    assert eng.sampling.history.num_used == 0


def tokens(out) -> list[tuple[int, ...]]:
    return [tuple(c.token_ids) for c in out.outputs]


def test_n_samples_prefill_once_greedy_identical_seeded_distinct_and_reproducible() -> None:
    eng = engine()
    prompt_len = len(eng.tokenizer.encode(PROMPT))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, n=3)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=3)
    finals, prefilled = run(eng, {"g": (PROMPT, greedy)})
    assert prefilled == prompt_len                         # one prefill for three samples
    single, _ = run(eng, {"one": (PROMPT, SamplingParams(temperature=0.0, max_tokens=12))})
    assert tokens(finals["g"]) == tokens(single["one"]) * 3
    first, prefilled = run(eng, {"s": (PROMPT, seeded), "t": (PROMPT, seeded)})
    assert prefilled == 2 * prompt_len
    assert len(set(tokens(first["s"]))) == 3               # distinct samples ...
    assert tokens(first["s"]) == tokens(first["t"])        # ... reproducible, whatever the batch
    again, _ = run(eng, {"s2": (PROMPT, seeded)})
    assert tokens(again["s2"]) == tokens(first["s"])
    # sample i draws from seed + i: sample 1 of seed 5 is sample 0 of seed 6
    shifted, _ = run(eng, {"six": (PROMPT, SamplingParams(temperature=1.0, seed=6, max_tokens=12))})
    assert tokens(shifted["six"])[0] == tokens(first["s"])[1]
    assert all(c.finish_reason == "length" for c in first["s"].outputs) and first["s"].finished


def test_n_samples_finish_separately_and_abort_together() -> None:
    eng = engine()
    eng.add_request("a", PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=40, n=3, ignore_eos=True))
    eng.add_request("b", PROMPT, SamplingParams(temperature=1.0, seed=2, max_tokens=40, n=4, min_tokens=2,
                                                 stop_token_ids=list(range(0, 4000, 4))))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a.2", PROMPT, SamplingParams(max_tokens=2))      # a sample's id
    eng.add_request("c.1", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"samples' ids \['c.1'\] are in use"):
        eng.add_request("c", PROMPT, SamplingParams(max_tokens=2, n=2))
    seen: dict[str, list] = {"a": [], "b": [], "c.1": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
            if out.request_id == "a" and len(out.outputs[2].token_ids) == 5:
                eng.abort_request("a")
    last_a, last_b = seen["a"][-1], seen["b"][-1]
    assert last_a.finished and [c.finish_reason for c in last_a.outputs] == ["abort"] * 3
    assert all(len(c.token_ids) == 5 for c in last_a.outputs)
    # b's samples stop at different lengths (a stop token); the request ends with the last of them
    lengths = [len(c.token_ids) for c in last_b.outputs]
    assert len(set(lengths)) > 1 and all(c.finish_reason in ("stop", "length") for c in last_b.outputs)
    running = [out for out in seen["b"] if not out.finished]
    assert any(any(c.finished for c in out.outputs) for out in running)   # one sample done, others go on
    assert_nothing_left(eng)


def test_penalties_and_bias_pick_the_penalised_argmax() -> None:
    eng = engine()
    base = SamplingParams(temperature=0.0, max_tokens=20, logprobs=20, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=20, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=0.5, logit_bias={314: -0.7})
    finals, _ = run(eng, {"plain": (PROMPT, base), "penalised": (PROMPT, params)})
    plain, penalised = finals["plain"].outputs[0], finals["penalised"].outputs[0]
    assert plain.token_ids != penalised.token_ids
    assert len(set(plain.token_ids)) < len(set(penalised.token_ids))        # repeats less
    for step, (token, candidates) in enumerate(zip(penalised.token_ids, penalised.logprobs)):
        before = penalised.token_ids[:step]
        # logprob = logit - a constant: the same argmax
        scores = {t: lp - 1.5 * before.count(t) - 0.5 * (t in before) + (-0.7 if t == 314 else 0.0)
                  for t, lp in candidates.items()}
        best = max(scores, key=lambda t: (scores[t], -t))
        assert token == best, f"step {step}"


def test_allowed_token_ids_and_bad_words_are_never_sampled() -> None:
    eng = engine()
    allowed = SamplingParams(temperature=1.5, seed=3, max_tokens=30, allowed_token_ids=[83, 270, 314, 1589],
                             ignore_eos=True)
    finals, _ = run(eng, {"plain": (PROMPT, SamplingParams(temperature=0.0, max_tokens=24)),
                          "allowed": (PROMPT, allowed)})
    assert set(finals["allowed"].outputs[0].token_ids) <= {83, 270, 314, 1589}
    assert len(set(finals["allowed"].outputs[0].token_ids)) > 1
    plain = finals["plain"].outputs[0].token_ids
    # a word of two tokens the greedy output holds, and a single-token word
    pair = next(plain[i:i + 2] for i in range(len(plain) - 1)
                if eng.tokenizer.encode(eng.tokenizer.decode(plain[i:i + 2]), add_special_tokens=False)
                == plain[i:i + 2])
    word = eng.tokenizer.decode(pair)
    single = eng.tokenizer.decode([plain[0]])
    params = SamplingParams(temperature=0.0, max_tokens=24, bad_words=[word, single])
    banned = eng._tokenize_bad_words(params)
    assert tuple(pair) in banned and (plain[0],) in banned
    finals, _ = run(eng, {"clean": (PROMPT, params)})
    clean = finals["clean"].outputs[0].token_ids
    for ids in banned:
        assert not any(tuple(clean[i:i + len(ids)]) == ids for i in range(len(clean))), ids
    assert clean != plain


def test_sampling_fields_are_checked_against_the_vocabulary() -> None:
    eng = engine()
    vocab = eng.model.cfg.vocab_size
    with pytest.raises(InvalidSamplingParams, match=rf"logit_bias holds token ids \[{vocab}\]"):
        eng.add_request("x", PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(InvalidSamplingParams, match="allowed_token_ids holds token ids"):
        eng.add_request("x", PROMPT, SamplingParams(allowed_token_ids=[0, vocab + 5]))
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("preempt", [False, True], ids=["plain", "recompute"])
def test_zos_on_and_off_agree_with_samples_penalties_and_bad_words(preempt: bool) -> None:
    args = {"num_kv_blocks": 5, "block_size": 64, "stop_preempted_request": False} if preempt else {}
    prompt = PROMPT * 6 if preempt else PROMPT
    requests = {
        "n": (prompt, SamplingParams(temperature=0.9, seed=4, max_tokens=70, n=3, ignore_eos=True,
                                     repetition_penalty=1.3, bad_words=["fibonacci"])),
        "pen": (prompt, SamplingParams(temperature=0.0, max_tokens=70, frequency_penalty=0.8, presence_penalty=0.4,
                                       ignore_eos=True)),
    }
    results = []
    for zos in (False, True):
        counts: dict[str, int] = {}
        finals, _ = run(engine(zos, **args), requests, counts)
        results.append(({k: tokens(v) for k, v in finals.items()}, counts["recomputed"]))
    assert results[0] == results[1]
    assert (results[0][1] > 0) == preempt
    assert all(len(t) == 70 for sample in results[0][0].values() for t in sample)


def test_skip_special_tokens_reaches_the_detokenizer() -> None:
    eng = engine()
    eos = eng.eos_token_ids[0]
    forced = {"ignore_eos": True, "temperature": 0.0, "max_tokens": 3, "logit_bias": {eos: 100.0}}
    finals, _ = run(eng, {"kept": (PROMPT, SamplingParams(**forced, skip_special_tokens=False, n=2)),
                          "skipped": (PROMPT, SamplingParams(**forced))})
    special = eng.tokenizer.decode([eos], skip_special_tokens=False)
    assert special and [c.text for c in finals["kept"].outputs] == [special * 3] * 2
    assert finals["skipped"].outputs[0].text == "" and finals["skipped"].outputs[0].token_ids == [eos] * 3


def test_n_samples_each_follow_the_grammar() -> None:
    pytest.importorskip("xgrammar")
    from deepinfer.engine import StructuredOutput

    params = SamplingParams(temperature=1.0, seed=1, max_tokens=10, n=3,
                            structured=StructuredOutput(choice=("alpha", "beta", "gamma")))
    finals, _ = run(engine(), {"c": ("x = ", params)})
    texts = [c.text for c in finals["c"].outputs]
    assert set(texts) <= {"alpha", "beta", "gamma"} and len(set(texts)) > 1
