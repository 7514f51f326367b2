"""Prefill/decode disaggregation inside one process (issue #33, item 1): a PROMPT engine prefills and
hands each request over (`LocalKVTransfer`), a COMPLETION engine decodes it; greedy and seeded outputs
equal one NORMAL engine's (tokens; logprobs to float rounding), on the embedded model and the tiny random V4.1 model,
and neither engine keeps a block or a slot afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_tiny_v41 import CONFIG as V41_CONFIG

from deepinfer.engine import EngineArgs, LLMEngine, SamplingParams
from deepinfer.engine.disagg import LocalKVTransfer
from deepinfer.sched import EngineType

TINY = {"device": "cpu", "load_format": "dummy", "max_num_seqs": 4, "kv_cache_memory_mb": 8, "max_model_len": 256,
        "block_size": 16}
EMBEDDED = {"device": "cpu", "max_num_seqs": 4, "kv_cache_memory_mb": 16, "max_model_len": 256}
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=5, ignore_eos=True),
}


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _pair(kwargs: dict) -> tuple[LocalKVTransfer, LLMEngine]:
    pair = LocalKVTransfer(EngineArgs(**kwargs, engine_type=EngineType.PROMPT))
    return pair, LLMEngine(EngineArgs(**kwargs, engine_type=EngineType.COMPLETION), kv_transfer=pair)


def _prompts(vocab: int, lengths: tuple[int, ...]) -> dict[str, list[int]]:
    return {f"r{i}": [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(n)] for i, n in enumerate(lengths)}


def _assert_nothing_held(*engines: LLMEngine) -> None:
    for engine in engines:
        engine.scheduler.check_integrity()
        assert engine.kv_blocks.num_free == engine.runner.plan.num_kv_blocks - 1
        assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def embedded_pair() -> tuple[LocalKVTransfer, LLMEngine]:
    return _pair(EMBEDDED)


@pytest.mark.parametrize("model", ["embedded", "tiny_v41"])
def test_pair_outputs_equal_one_normal_engine(tmp_path: Path, model: str, embedded_pair) -> None:
    if model == "embedded":
        kwargs, vocab, lengths = EMBEDDED, 4000, (70, 9)
        pair, decode = embedded_pair
    else:
        (tmp_path / "config.json").write_text(json.dumps(V41_CONFIG))
        kwargs, vocab, lengths = {**TINY, "model": str(tmp_path)}, 94, (40, 5)
        pair, decode = _pair(kwargs)
    prompts = _prompts(vocab, lengths)
    normal = LLMEngine(EngineArgs(**kwargs))
    transfers_before = pair.stats().num_transfers
    for name, params in PARAMS.items():
        want = _run(normal, prompts, params)
        got = _run(decode, prompts, params)
        for request_id in prompts:
            w, g = want[request_id].outputs[0], got[request_id].outputs[0]
            assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), (name, request_id)
            if w.logprobs is not None:       # the first token's are the PROMPT engine's: the same bits
                assert g.logprobs[0] == w.logprobs[0]
                assert all(got_lp.keys() == want_lp.keys() and got_lp == pytest.approx(want_lp, abs=1e-4)
                           for got_lp, want_lp in zip(g.logprobs, w.logprobs))   # rows batched otherwise
    stats = pair.stats()
    assert stats.num_transfers - transfers_before == 2 * len(prompts) and stats.num_bytes > 0
    _assert_nothing_held(pair.prompt_engine, decode)


def test_a_request_ending_at_its_first_token_moves_no_kv(embedded_pair) -> None:
    pair, decode = embedded_pair
    before = pair.stats()
    out = _run(decode, {"one": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=1))["one"].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (1, "length")
    after = pair.stats()
    assert (after.num_transfers - before.num_transfers, after.num_bytes) == (1, before.num_bytes)
    _assert_nothing_held(pair.prompt_engine, decode)


def test_an_abort_while_prefilling_frees_both_sides(embedded_pair) -> None:
    pair, decode = embedded_pair
    decode.add_request("a", {"prompt_token_ids": list(range(3, 200))}, SamplingParams(max_tokens=50))
    assert pair.prompt_engine.has_unfinished_requests()       # ordered at add_request
    decode.abort_request("a")
    outs = decode.step()
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"]
    assert not pair.prompt_engine.has_unfinished_requests()
    _assert_nothing_held(pair.prompt_engine, decode)


def test_completion_engine_refusals(embedded_pair) -> None:
    alone = LLMEngine(EngineArgs(**EMBEDDED, engine_type=EngineType.COMPLETION))
    with pytest.raises(ValueError, match="only with a prefill peer"):
        alone.add_request("x", [1, 2, 3])
    _, decode = embedded_pair
    with pytest.raises(ValueError, match="prompt_logprobs is not supported yet"):
        decode.add_request("x", [1, 2, 3], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="n=2 needs a NORMAL engine"):
        decode.add_request("x", [1, 2, 3], SamplingParams(n=2))


def test_mismatched_models_are_refused_naming_both(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(V41_CONFIG))
    pair = LocalKVTransfer(EngineArgs(**TINY, model=str(tmp_path), engine_type=EngineType.PROMPT))
    with pytest.raises(ValueError, match=rf"serves {tmp_path}.*this decode engine the embedded model"):
        LLMEngine(EngineArgs(**EMBEDDED, engine_type=EngineType.COMPLETION), kv_transfer=pair)


def test_arrivals_without_room_wait_for_it_in_order(embedded_pair) -> None:
    """Six requests on a COMPLETION engine of max_num_seqs=4: the last ones arrive with no room, keep
    their first token, wait, and are admitted as rows free up."""
    pair, decode = embedded_pair
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(6):
        decode.add_request(f"w{i}", {"prompt_token_ids": [5 + i, 9, 14, 3 + 2 * i]}, params)
    most_waiting, done = 0, {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            done[out.request_id] = out if out.finished else done.get(out.request_id)
        most_waiting = max(most_waiting, len(decode._pd.arrived))
    assert most_waiting >= 1
    assert all(len(out.outputs[0].token_ids) == 4 for out in done.values()) and len(done) == 6
    _assert_nothing_held(pair.prompt_engine, decode)


def test_a_fault_on_the_prefill_side_fails_the_request_clearly(embedded_pair, monkeypatch) -> None:
    pair, decode = embedded_pair

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(pair.prompt_engine.runner, "forward_all", broken)
    out = _run(decode, {"f": [4, 5, 6]}, SamplingParams(max_tokens=3))["f"].outputs[0]
    assert out.finish_reason == "error"
    assert out.error_reason == "prefill failed: the prefill engine ended it: engine fault: RuntimeError: device lost"
    monkeypatch.undo()
    _assert_nothing_held(pair.prompt_engine, decode)
    assert _run(decode, {"g": [4, 5, 6]}, SamplingParams(max_tokens=3))["g"].outputs[0].finish_reason == "length"
