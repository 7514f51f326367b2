"""Engine behaviour end to end: sampling, text, stop conditions, logprobs, bad input, abort, CLI."""

from __future__ import annotations

import pytest
from engine_twin import hf_greedy, random_prompts

from deepinfer.engine import LLM, InvalidEngineArgs, InvalidSamplingParams, LLMEngine, SamplingParams
from deepinfer.engine.cli import main as cli_main
from deepinfer.engine.config.engine_args import EngineArgs


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny) -> None:
    _, model_dir = tiny
    llm = LLM(model=str(model_dir))
    target = random_prompts([9], seed=3)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate(_ids([target]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts([4, 30, 13], seed=4)
    mixed = llm.generate(_ids(others[:2] + [target] + others[2:]),
                         [SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)] * 2 + [seeded]
                         + [SamplingParams(temperature=0.5, max_tokens=15, seed=9, ignore_eos=True)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    again = LLM(model=str(model_dir), seed=77).generate(_ids([target]), seeded, use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone
    other_seed = llm.generate(_ids([target]), SamplingParams(temperature=0.9, max_tokens=12, seed=99,
                                                               ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_text_prompts_stop_strings_and_eos(tiny_text) -> None:
    hf, model_dir = tiny_text
    llm = LLM(model=str(model_dir))
    engine = llm.engine
    prompt = "def fibonacci("
    ids = engine.tokenizer.encode(prompt)
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    expect = hf_greedy(hf, ids, 24)
    assert greedy.prompt == prompt and greedy.prompt_token_ids == ids
    assert greedy.outputs[0].token_ids == expect
    assert greedy.outputs[0].text == engine.tokenizer.decode(expect)
    # a stop string taken from the middle of the greedy text cuts the output right before it
    text = greedy.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=stop, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == text[: text.index(stop)]
    # a stop token id ends the output and is kept in token_ids
    token = expect[5]
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[token],
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == expect[: expect.index(token) + 1] and by_id.stop_reason == token


def test_logprobs_are_of_the_raw_distribution(tiny) -> None:
    _, model_dir = tiny
    out = LLM(model=str(model_dir)).generate(
        _ids(random_prompts([6], seed=5)), SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 3                    # greedy pick is also the top-1
        assert entry[token] == max(entry.values()) and all(v <= 0 for v in entry.values())


def test_bad_requests_are_ignored_or_rejected_and_the_rest_complete(tiny) -> None:
    hf, model_dir = tiny
    llm = LLM(model=str(model_dir), max_model_len=32)
    good = random_prompts([7], seed=6)[0]
    outs = llm.generate(_ids([[], good, list(range(2, 40))]), SamplingParams(temperature=0, max_tokens=5,
                                                                             ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "ignored" and outs[0].outputs[0].ignored_reason == "empty prompt"
    assert outs[2].outputs[0].finish_reason == "ignored" and "max_model_len" in outs[2].outputs[0].ignored_reason
    assert outs[1].outputs[0].token_ids == hf_greedy(hf, good, 5)
    with pytest.raises(InvalidSamplingParams, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidSamplingParams, match=r"top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidSamplingParams, match=r"top_p=0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"ids must be in \[0, 96\)"):
        llm.generate(_ids([[5, 96]]), use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    # the engine still serves after the rejected calls
    again = llm.generate(_ids([good]), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_unknown_model_folder_and_bad_engine_args(tmp_path) -> None:
    with pytest.raises(InvalidEngineArgs, match="is not a folder"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(InvalidEngineArgs, match="dtype='int8'"):
        EngineArgs(model=str(tmp_path), dtype="int8")
    with pytest.raises(InvalidEngineArgs, match=r"max_num_seqs=0 must be an integer in \[1"):
        EngineArgs(max_num_seqs=0)


def test_abort_finishes_a_running_request(tiny) -> None:
    _, model_dir = tiny
    engine = LLMEngine(EngineArgs(model=str(model_dir)))
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    a = engine.add_request("a", random_prompts([8], seed=7)[0], params)
    b = engine.add_request("b", random_prompts([8], seed=8)[0], params)
    for _ in range(3):
        engine.step()
    engine.abort_request(a)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished[b].finish_reason == "length" and len(finished[b].token_ids) == 50
    assert finished[a].finish_reason == "abort" and 0 < len(finished[a].token_ids) < 50
    assert engine.scheduler.num_running == 0
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("b", [3, 4], params)
        engine.add_request("b", [3, 4], params)


def test_cli_generate_prints_text(tiny_text, capsys) -> None:
    _, model_dir = tiny_text
    assert cli_main(["generate", "def fibonacci(", "--model", str(model_dir), "--max-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def fibonacci(") and "finish_reason=" in out.err
    assert cli_main(["generate", "x", "--model", str(model_dir / "missing")]) == 1
    assert cli_main(["generate", "x", "--model", str(model_dir), "--gpu-memory-utilization", "1.5"]) == 2
    assert "gpu_memory_utilization=1.5 must be in (0, 1)" in capsys.readouterr().err


class _RecordingPromptEngine(LLMEngine):
    """A PROMPT engine whose disaggregation hooks record what they were given."""

    def __init__(self, *args, **kwargs) -> None:
        self.calls: list[tuple[str, object]] = []
        super().__init__(*args, **kwargs)

    def pe_prepare_save_kvcache(self, seq_ids) -> None:
        self.calls.append(("prepare", tuple(seq_ids)))

    def pe_do_save_kvcache(self, seq_ids) -> None:
        self.calls.append(("save", tuple(seq_ids)))

    def send_processed_prompts(self, out) -> None:
        self.calls.append(("send", out.kind.value))


def test_prompt_engine_hands_requests_over_after_prefill(tiny) -> None:
    from deepinfer.engine import EngineType

    hf, model_dir = tiny
    engine = _RecordingPromptEngine(EngineArgs(model=str(model_dir), engine_type=EngineType.PROMPT))
    prompts = random_prompts([6, 11], seed=9)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = {o.request_id: o.outputs[0] for o in engine.step()}
    assert {k: (v.finish_reason, v.token_ids) for k, v in outs.items()} == {
        f"r{i}": ("prefilled", hf_greedy(hf, p, 1)) for i, p in enumerate(prompts)}
    assert engine.calls == [("prepare", ("r0", "r1")), ("save", ("r0", "r1")), ("send", "prefill")]
    assert not engine.has_unfinished_requests() and engine.scheduler.num_running == 0


def test_completion_engine_takes_no_fresh_requests(tiny) -> None:
    from deepinfer.engine import EngineType

    engine = LLMEngine(EngineArgs(model=str(tiny[1]), engine_type=EngineType.COMPLETION))
    with pytest.raises(ValueError, match="COMPLETION engine takes requests only with a prefill peer"):
        engine.add_request(None, [3, 4, 5])      # no KVTransfer that prefills: docs/design.md §15


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_quantised_experts_engine_serves_and_rejects_incompatible_models(tmp_path, expert_dtype) -> None:
    """`expert_dtype`: the routed experts load quantised and greedy decoding agrees with the same
    engine in float on most tokens (quantisation may flip a near tie, not whole outputs); a model
    whose sizes the FP8 block does not divide is refused naming both sizes."""
    import json

    from engine_twin import hf_model, write_model_dir

    from deepinfer.model import ConfigError

    hf, raw = hf_model(seed=12, moe_intermediate_size=64)
    raw = {**raw, "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    folder = write_model_dir(tmp_path / "q", hf, raw)
    prompts = _ids(random_prompts([7, 12], seed=4))
    params = SamplingParams(temperature=0.0, max_tokens=12)
    quantised = LLM(model=str(folder), expert_dtype=expert_dtype)
    assert quantised.engine.model.layers[0].ffn.experts.w13.dtype.itemsize == 1
    got = [o.outputs[0].token_ids for o in quantised.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in LLM(model=str(folder)).generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert all(len(g) == 12 for g in got) and same >= 6
    with pytest.raises(InvalidEngineArgs, match="expert_dtype='int4' must be None, 'fp8' or 'fp4'"):
        EngineArgs(expert_dtype="int4")
    if expert_dtype == "fp8":
        (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "quantization_config"}))
        with pytest.raises(ConfigError, match="moe_intermediate_size=64 and hidden_size=64 divisible by the FP8 "
                                              "block 128"):
            LLM(model=str(folder), expert_dtype="fp8")
