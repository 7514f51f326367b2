"""Prefix caching in the engine (issue #32): greedy tokens with it on equal those with it off, token for
token (multi-turn chats, a shared system prompt, n > 1, chunked prefill, ZOS on and off); a later turn
reports num_cached_tokens >= the previous prompt rounded down to the block and prefills only the rest;
and a request served from the cache gets exactly the logits of one prefilled from scratch in the same
chunks (tiny random V4 with and without fake-quantised KV, tiny V4.1 with its packed KV)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from engine_tiny_v4 import CONFIG as V4_CONFIG
from engine_tiny_v41 import CONFIG as V41_CONFIG
from test_speculative_tiny import CONFIG as DRAFT_CONFIG

from deepinfer.engine import EngineArgs, LLMEngine, SamplingParams, llm_engine
from deepinfer.model import DSparkDraft
from deepinfer.sched import StepKind

# kv_quant needs head_dim - rope a multiple of 64 and a power-of-two index head >= 32
V4_QUANT_CONFIG = {**V4_CONFIG, "head_dim": 72, "index_head_dim": 32}
TINY = {"device": "cpu", "load_format": "dummy", "max_num_seqs": 4, "kv_cache_memory_mb": 8, "max_model_len": 256,
        "block_size": 16}


def _folder(tmp_path: Path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _counting(engine: LLMEngine) -> dict[str, int]:
    """Prefill tokens the engine computes, by request id (every chunk of every PREFILL step)."""
    counts: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def counted():
        out = schedule()
        if out.kind is StepKind.PREFILL:
            for chunk in out.prefill:
                counts[chunk.seq_id] = counts.get(chunk.seq_id, 0) + chunk.num_tokens
        return out

    engine.scheduler.schedule = counted
    return counts


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _chats(engine: LLMEngine, num_chats: int, num_turns: int, vocab: int, params: SamplingParams,
           system_len: int = 40, turn_len: int = 9) -> list[list]:
    """num_chats conversations sharing a system prompt, their turns sent together turn by turn; each
    turn's prompt is the previous prompt + the reply (sample 0's) + a new user message."""
    rng = np.random.default_rng(7)
    system = rng.integers(3, vocab, system_len).tolist()
    histories = [list(system) for _ in range(num_chats)]
    turns = []
    for turn in range(num_turns):
        prompts = {f"c{c}t{turn}": histories[c] + rng.integers(3, vocab, turn_len).tolist() for c in range(num_chats)}
        outs = _run(engine, prompts, params)
        turns.append([outs[request_id] for request_id in prompts])
        histories = [prompt + outs[request_id].outputs[0].token_ids for request_id, prompt in prompts.items()]
    return turns


def _tokens(turns: list[list]) -> list:
    return [[[c.token_ids for c in out.outputs] for out in outs] for outs in turns]


def test_embedded_model_multi_turn_chats_same_tokens_and_only_the_rest_prefilled() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    runs = {}
    for on in (True, False):
        engine = LLMEngine(EngineArgs(device="cpu", max_num_seqs=4, kv_cache_memory_mb=16, max_model_len=256,
                                      enable_prefix_caching=on))
        counts = _counting(engine)
        runs[on] = (_chats(engine, 2, 3, 4000, greedy, system_len=70, turn_len=12), counts, engine)
    (on, counts, engine), (off, _, _) = runs[True], runs[False]
    assert _tokens(on) == _tokens(off)
    assert engine.runner.plan.block_size == 64
    for turn in range(1, 3):
        for chat, out in enumerate(on[turn]):
            previous = len(on[turn - 1][chat].prompt_token_ids)
            assert out.num_cached_tokens >= previous // 64 * 64 > 0
            assert counts[out.request_id] == len(out.prompt_token_ids) - out.num_cached_tokens
    assert all(out.num_cached_tokens == 0 for out in off[1])
    assert engine.scheduler.prefix_cache_stats.hits == sum(o.num_cached_tokens for outs in on for o in outs)
    system = on[0][0].prompt_token_ids[:70]                # a new chat with the shared system prompt
    assert _run(engine, {"new": system + [5] * 12}, greedy)["new"].num_cached_tokens == 64
    engine.scheduler.check_integrity()
    assert engine.reset_prefix_cache() and engine.scheduler.prefix_cache_stats.num_cached_blocks == 0


@pytest.mark.parametrize("zos", [True, False])
def test_tiny_v4_n_samples_chunked_prefill_and_zos_same_tokens(tmp_path: Path, zos: bool) -> None:
    model = _folder(tmp_path, V4_CONFIG)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)
    turns, plans = {}, {}
    for on in (True, False):
        engine = LLMEngine(EngineArgs(model=model, **TINY, max_num_batched_tokens=24, zero_overhead_scheduling=zos,
                                      enable_prefix_caching=on))
        turns[on] = _chats(engine, 2, 3, 94, params)
        engine.scheduler.check_integrity()
        assert engine.kv_blocks.num_free == engine.runner.plan.num_kv_blocks - 1
        plans[on] = engine.runner.plan
    assert _tokens(turns[True]) == _tokens(turns[False])
    # the snapshots (2 × max_num_seqs, each a third of a state slot) come out of the same 8 MiB as the KV blocks
    slot_bytes = plans[False].state_bytes // plans[False].num_state_slots
    assert plans[True].num_snapshot_slots == 8 and plans[True].state_bytes == plans[False].state_bytes
    assert plans[True].snapshot_pool_bytes == 9 * plans[True].snapshot_bytes
    assert 3 * plans[True].snapshot_bytes == slot_bytes
    assert plans[True].num_kv_blocks < plans[False].num_kv_blocks
    assert plans[True].paged_bytes + plans[True].state_bytes + plans[True].snapshot_pool_bytes <= 8 * 2**20
    assert all(out.num_cached_tokens >= 48 for out in turns[True][2])    # turn 2's prompts are >= 58 tokens


def test_speculative_decoding_same_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load = llm_engine.load_model

    def load_with_head(*args, **kwargs):      # the dummy model plus a random two-stage draft head
        model = load(*args, **kwargs)
        draft = DSparkDraft(model, 2)
        draft.init_weights(3, std=0.05)
        model.draft_weights = {key: value.detach().clone() for key, value in draft.state_dict().items()}
        return model

    monkeypatch.setattr(llm_engine, "load_model", load_with_head)
    model = _folder(tmp_path, DRAFT_CONFIG)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    turns = {}
    for on in (True, False):
        engine = LLMEngine(EngineArgs(model=model, **TINY, num_speculative_tokens=3, enable_prefix_caching=on))
        turns[on] = _chats(engine, 2, 2, 94, greedy)
        engine.scheduler.check_integrity()
    assert _tokens(turns[True]) == _tokens(turns[False])
    assert all(out.num_cached_tokens >= 48 for out in turns[True][1])


@pytest.mark.parametrize(("config", "kv_quant"), [(V4_CONFIG, False), (V4_QUANT_CONFIG, True), (V41_CONFIG, False)],
                         ids=["v4", "v4-fake-quant-kv", "v41-packed-kv"])
def test_a_cached_prefix_gives_the_logits_of_a_prefill_from_scratch(tmp_path: Path, config: dict,
                                                                    kv_quant: bool) -> None:
    """Prefill one block per step: the cached request and the scratch one then compute the same chunks,
    so their logits (the logprobs of every sampled token) are bitwise equal."""
    model = _folder(tmp_path, config)
    args = EngineArgs(model=model, **TINY, kv_quant=kv_quant, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    rng = np.random.default_rng(3)
    first = rng.integers(3, 90, 37).tolist()
    second = first + rng.integers(3, 90, 21).tolist()
    warm = LLMEngine(args)
    _run(warm, {"first": first}, params)
    cached = _run(warm, {"second": second}, params)["second"]
    assert cached.num_cached_tokens == 32
    scratch = _run(LLMEngine(args), {"second": second}, params)["second"]
    assert scratch.num_cached_tokens == 0
    assert cached.outputs[0].token_ids == scratch.outputs[0].token_ids
    assert cached.outputs[0].logprobs == scratch.outputs[0].logprobs


def test_prompt_logprobs_requests_prefill_every_token(tmp_path: Path) -> None:
    engine = LLMEngine(EngineArgs(model=_folder(tmp_path, V4_CONFIG), **TINY))
    prompt = np.random.default_rng(5).integers(3, 90, 40).tolist()
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    _run(engine, {"a": prompt}, plain)
    assert _run(engine, {"b": prompt}, plain)["b"].num_cached_tokens == 32
    wanting = _run(engine, {"c": prompt}, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))["c"]
    assert wanting.num_cached_tokens == 0 and len(wanting.prompt_logprobs) == 40
    assert engine.reset_prefix_cache()
    assert _run(engine, {"d": prompt}, plain)["d"].num_cached_tokens == 0


def test_args_refuse_snapshots_without_caching() -> None:
    from deepinfer.engine import InvalidEngineArgs
    with pytest.raises(InvalidEngineArgs, match="prefix_cache_snapshots=4 needs enable_prefix_caching=True"):
        EngineArgs(enable_prefix_caching=False, prefix_cache_snapshots=4)
