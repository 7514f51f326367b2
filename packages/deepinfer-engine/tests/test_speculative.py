"""Speculative decoding through the engine (`EngineArgs.num_speculative_tokens`, spec_step.py).

The model is the embedded tiny model plus a randomly initialised one-stage DSpark head (`mtp.0.*`),
written next to it into a temporary folder: its drafts are almost never right, so the tests that
need accepted runs replace the head's proposals by an oracle that knows the plain greedy
continuation (wrong at one draft in four), as `deepinfer-spec`'s loop test does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from kept_once import KeptOnce
from safetensors.torch import load_file, save_file

from deepinfer.engine import LLM, EngineArgs, InvalidEngineArgs, LLMEngine, SamplingParams, StructuredOutput
from deepinfer.engine.config.env import EngineEnv
from deepinfer.model import DraftProposal, DSparkDraft, embedded_model_dir, load_model
from deepinfer.sched import EngineType

PROMPTS = ["def fibonacci(", "import os\n", "class Parser:", "for i in range(", "x = [1, 2,"]
FAST = {"device": "cpu", "kv_cache_memory_mb": 16, "max_num_seqs": 8, "max_model_len": 256}


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's folder plus random `mtp.0.*` draft weights."""
    src, dst = embedded_model_dir(), tmp_path_factory.mktemp("dspark")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    draft = DSparkDraft(load_model(src, dtype=torch.float32, device="cpu"), 1)
    draft.init_weights(7, std=0.05)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update({key: value.to(torch.bfloat16).contiguous() for key, value in draft.state_dict().items()})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def no_draft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's folder without its draft head (mtp.safetensors and the index left out)."""
    src, dst = embedded_model_dir(), tmp_path_factory.mktemp("no_dspark")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def plain(draft_model: Path) -> LLM:
    return LLM(model=str(draft_model), **FAST)


@pytest.fixture(scope="module")
def speculative(draft_model: Path) -> LLM:
    return LLM(model=str(draft_model), num_speculative_tokens=5, varlen_verify=False, **FAST)


@pytest.fixture(scope="module")
def reference(plain: LLM) -> dict[str, list[int]]:
    """Plain greedy: prompt + 48 output tokens per prompt."""
    outs = plain.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)
    return {p: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)}


def _oracle(llm: LLM, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the draft head's proposals by the reference continuation of the sequence whose token
    at the anchor's position is the anchor; draft 3 is wrong when the position is a multiple of 3."""
    draft = llm.engine.spec.draft
    propose = draft.propose
    k = draft.block_size

    def oracle(anchor_ids, anchor_positions, state_slots, cache, **kw) -> DraftProposal:
        prop = propose(anchor_ids, anchor_positions, state_slots, cache, **kw)
        tokens = prop.token_ids.clone()
        for row, (anchor, pos) in enumerate(zip(anchor_ids.tolist(), anchor_positions.tolist())):
            for seq in reference.values():
                if pos + k < len(seq) and seq[pos] == anchor:
                    tokens[row] = torch.tensor(seq[pos + 1:pos + 1 + k])
                    if pos % 3 == 0 and k > 3:
                        tokens[row, 3] = (tokens[row, 3] + 1) % draft.cfg.vocab_size
                    break
        return DraftProposal(tokens, prop.logits, prop.confidence)

    monkeypatch.setattr(draft, "propose", oracle)


def _results(outs) -> list[tuple[tuple[int, ...], str, object, str]]:
    return [(tuple(o.outputs[0].token_ids), str(o.outputs[0].finish_reason), o.outputs[0].stop_reason,
             o.outputs[0].text) for o in outs]


def test_greedy_speculation_gives_the_plain_greedy_tokens(plain: LLM, speculative: LLM) -> None:
    """A random draft head (drafts rejected): the same tokens, one per verify step plus nothing."""
    params = SamplingParams(max_tokens=20, temperature=0)
    before = speculative.engine.stats()
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = speculative.generate(PROMPTS, params, use_tqdm=False)
    assert _results(got) == _results(want)
    stats = speculative.engine.stats()
    assert stats.spec_verify_steps - before.spec_verify_steps == 19       # the first token comes from prefill
    assert stats.spec_draft_tokens - before.spec_draft_tokens == 19 * len(PROMPTS) * 5
    assert plain.engine.stats().spec_verify_steps == 0


def test_accepted_runs_are_cut_exactly_by_eos_stops_and_max_tokens(plain: LLM, speculative: LLM,
                                                                   reference: dict[str, list[int]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _oracle(speculative, reference, monkeypatch)
    outputs = {p: seq[len(plain.engine.tokenizer.encode(p)):] for p, seq in reference.items()}
    first = outputs[PROMPTS[0]]
    text = plain.generate([PROMPTS[1]], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0]
    stop_str = text.outputs[0].text[9:13]
    cases = [
        (PROMPTS[0], SamplingParams(max_tokens=9, temperature=0)),                 # max_tokens inside a run
        (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[first[7]])),
        (PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, stop=[stop_str])),
        (PROMPTS[2], SamplingParams(max_tokens=40, temperature=0, logprobs=2)),
        (PROMPTS[3], SamplingParams(max_tokens=30, temperature=0, presence_penalty=0.5)),   # no drafts
        (PROMPTS[4], SamplingParams(max_tokens=1, temperature=0)),
        (PROMPTS[4], SamplingParams(max_tokens=10, temperature=0,                  # grammar: no drafts
                                    structured=StructuredOutput(choice=("alpha", "beta", "gamma")))),
    ]
    before = speculative.engine.stats()
    want = plain.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    got = speculative.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    assert _results(got) == _results(want)
    assert [r[1] for r in _results(got)] == ["length", "stop", "stop", "length", "length", "length",
                                                 "stop"]
    for g, w in zip(got[3].outputs[0].logprobs, want[3].outputs[0].logprobs):
        assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in g)
    stats = speculative.engine.stats()
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    assert accepted > 40 and stats.mean_accepted_length > 1.5
    eos = outputs[PROMPTS[2]][11]              # an EOS inside an accepted run
    for llm in (plain, speculative):
        monkeypatch.setattr(llm.engine, "eos_token_ids", (eos,))
    params = SamplingParams(max_tokens=40, temperature=0)
    want, got = (llm.generate([PROMPTS[2]], params, use_tqdm=False) for llm in (plain, speculative))
    assert _results(got) == _results(want) and want[0].outputs[0].finish_reason == "stop"


def test_structured_output_rows_draft_and_verify_through_their_grammar(plain: LLM, speculative: LLM,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar row drafts like any other: each of its k + 1 positions is verified against the target
    masked by the grammar after the drafts before it (the matcher advances over them, then rolls
    back). Oracle drafts of the constrained greedy continuation are accepted, its wrong ones (a
    draft the grammar forbids) cut the run; tokens equal plain constrained greedy decoding."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
              "required": ["name", "size"]}
    cases = [(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput(json=schema))),
             (PROMPTS[2], SamplingParams(max_tokens=20, temperature=0, structured=StructuredOutput(
                 choice=("the quick brown fox jumps", "over the lazy dog again")))),
             (PROMPTS[3], SamplingParams(max_tokens=16, temperature=0,
                                         structured=StructuredOutput(regex="[0-9]{3,8}")))]
    want = plain.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    _oracle(speculative, {p: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for p, o in
                          zip([c[0] for c in cases], want)}, monkeypatch)
    before = speculative.engine.stats()
    got = speculative.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    assert _results(got) == _results(want)
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    stats = speculative.engine.stats()
    assert stats.spec_verify_rows > before.spec_verify_rows
    assert stats.spec_accepted_tokens - before.spec_accepted_tokens > 10


def test_accepted_runs_reach_the_request_list_once(speculative: LLM, reference: dict[str, list[int]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`_commit` appends each kept token of a run to the request's list (the scheduler's history, the
    same list: `KeptOnce`) once, then hands the scheduler the counts; forked samples too."""
    _oracle(speculative, reference, monkeypatch)
    params = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0, n=2),
              SamplingParams(max_tokens=7, temperature=0)]
    watch = KeptOnce(speculative.engine)
    try:
        outs = speculative.generate(PROMPTS[:3], params, use_tqdm=False)
    finally:
        watch.close()
    assert watch.max_kept > 1 and watch.calls["fork_seq"] == 1
    for prompt, out in zip(PROMPTS, outs):
        for sample in out.outputs:
            tokens = list(out.prompt_token_ids) + list(sample.token_ids)
            assert tokens == reference[prompt][:len(tokens)]


def test_preemption_and_recompute_under_a_small_cache_keep_the_greedy_tokens(
        draft_model: Path, reference: dict[str, list[int]]) -> None:
    """5 usable blocks of 16 tokens for 5 sequences that each grow past one: preempted, recomputed
    (LLM's default), and still the plain greedy tokens; every block comes back."""
    llm = LLM(model=str(draft_model), **{**FAST, "kv_cache_memory_mb": None},
              num_kv_blocks=6, block_size=16, num_speculative_tokens=3, varlen_verify=False)
    engine = llm.engine
    free, schedule, preempted = engine.kv_blocks.num_free, engine.scheduler.schedule, []

    def counting_schedule():
        out = schedule()
        preempted.extend(out.preempted_seq_ids)
        return out

    engine.scheduler.schedule = counting_schedule
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    assert preempted
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.prompt_token_ids) + list(out.outputs[0].token_ids) == reference[prompt][:-16]
    assert engine.kv_blocks.num_free == free and not engine.has_unfinished_requests()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(speculative: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=5)
    alone = speculative.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    again = speculative.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = speculative.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2]],
        [SamplingParams(max_tokens=9, temperature=0.7, top_k=5), params, SamplingParams(max_tokens=12)],
        use_tqdm=False)
    assert alone == again == mixed[1].outputs[0].token_ids
    other = speculative.generate([PROMPTS[1]], SamplingParams(max_tokens=16, temperature=0.9, seed=6),
                                 use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_varlen_verify_and_the_draft_count_flags(draft_model: Path, plain: LLM, monkeypatch,
                                                 flat_varlen_curves: None) -> None:
    llm = LLM(model=str(draft_model), num_speculative_tokens=2, **{**FAST, "max_num_seqs": 2})   # varlen: default
    assert llm.engine.spec.k == 2 and llm.engine.spec.varlen is not None and llm.engine.zos
    params = SamplingParams(max_tokens=12, temperature=0)
    assert _results(llm.generate(PROMPTS[:3], params, use_tqdm=False)) == \
        _results(plain.generate(PROMPTS[:3], params, use_tqdm=False))
    assert llm.engine.stats().spec_verify_steps > 0
    # the policy's estimators learn from the real steps (ZOS on): every verify step was timed
    varlen = llm.engine.spec.varlen
    assert len(varlen.forward._steps) >= llm.engine.stats().spec_verify_steps > 0
    assert varlen.sampler.estimate_ms(2) > 0


def test_bad_flags_are_refused_naming_the_field(draft_model: Path, no_draft_model: Path) -> None:
    with pytest.raises(InvalidEngineArgs, match="num_speculative_tokens=5 needs the checkpoint's DSpark draft head, "
                                                "but it has no mtp.* tensors") as err:
        LLMEngine(EngineArgs(model=str(no_draft_model), num_speculative_tokens=5, **FAST))
    assert err.value.field == "num_speculative_tokens"
    assert EngineArgs().num_speculative_tokens == 0 and EngineArgs().varlen_verify     # off; varlen once on
    with pytest.raises(InvalidEngineArgs, match="varlen_verify='yes'") as err:
        EngineArgs(num_speculative_tokens=5, varlen_verify="yes")
    assert err.value.field == "varlen_verify"
    # DP + EP ranks take verify rows (tests/test_parallel_speculative.py)
    assert EngineArgs(num_speculative_tokens=5, data_parallel_size=2, expert_parallel=True).num_speculative_tokens == 5
    for bad in ({"engine_type": EngineType.PROMPT},):
        with pytest.raises(InvalidEngineArgs, match="num_speculative_tokens=5") as err:
            EngineArgs(num_speculative_tokens=5, **bad)
        assert err.value.field == "num_speculative_tokens"
    for value in (-1, 65, 2.0, None):
        with pytest.raises(InvalidEngineArgs, match="must be an integer in") as err:
            EngineArgs(num_speculative_tokens=value)
        assert err.value.field == "num_speculative_tokens"
    with pytest.raises(InvalidEngineArgs, match=r"DEEPINFER_MAX_BACKTRACKING_TOKENS=6 must be >= "
                                                r"num_speculative_tokens \+ 1 = 7") as err:
        LLMEngine(EngineArgs(model=str(draft_model), num_speculative_tokens=6, **FAST), env=EngineEnv())
    assert err.value.field == "num_speculative_tokens"
