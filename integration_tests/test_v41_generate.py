"""LLM(model=DIR) on tiny DeepSeek-V4.1 folders (official FP8 / MXFP4 names and transformers' names):
the engine builds the V4.1 model through deepinfer.model's public API and its greedy tokens are the
model's own (prefill then one token per decode step, or speculative steps verified by V4.1's
multi-token decode); the embedded default stays V4."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "packages" / "deepinfer-model" / "tests"))

from v41_checkpoint import folder_model, official_tensors, transformers_tensors, write_folder
from v41_helpers import run_chunks

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.speculative.spec_dummy import DummySpecSteps
from deepinfer.model import DeepseekV4Config, DeepseekV41ForCausalLM, embedded_model_dir
from deepinfer.spec import AcceptanceCalibration, ForwardRuntimeEstimator, SamplerRuntimeEstimator

PROMPTS = [[5, 9, 3, 40, 41, 7, 7, 12, 60], [61, 62, 3, 4, 90, 15, 16, 17, 9, 5, 3, 22, 23, 24]]


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        logits = run_chunks(model, [tokens], [[len(tokens)]])[0]
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("spelling", ["official", "transformers"])
def test_llm_generates_from_a_tiny_v41_folder(tmp_path, spelling) -> None:
    model, raw = folder_model(seed=4)
    if spelling == "official":
        tensors = official_tensors(model, quantised=True)
    else:
        tensors = transformers_tensors(model)
    folder = write_folder(tmp_path / spelling, model, raw, tensors, composite=spelling == "official")
    llm = LLM(model=str(folder), seed=0)
    assert isinstance(llm.engine.model, DeepseekV41ForCausalLM)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=6, temperature=0.0),
                        use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == _greedy(model, prompt, 6)


def test_the_embedded_default_stays_v4() -> None:
    assert type(DeepseekV4Config.from_model_dir(embedded_model_dir())) is DeepseekV4Config
    assert type(LLM(seed=0).engine.model).__name__ == "DeepseekV4ForCausalLM"


def test_engine_options_of_v41_reach_the_model(tmp_path) -> None:
    """engram_on_host and yoco_prefill_truncation_mode are applied to a V4.1 model (tokens
    unchanged with the tables on the host; compact CED gives the same greedy tokens as none), and
    refused for a V4 one."""
    from deepinfer.engine import InvalidEngineArgs

    model, raw = folder_model(seed=4)
    folder = write_folder(tmp_path / "v41", model, raw, transformers_tensors(model), composite=False)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = [o.outputs[0].token_ids for o in LLM(model=str(folder), seed=0).generate(prompts, params, use_tqdm=False)]
    on_host = LLM(model=str(folder), seed=0, engram_on_host=True)
    assert on_host.engine.model.engram_on_host
    assert [o.outputs[0].token_ids for o in on_host.generate(prompts, params, use_tqdm=False)] == plain
    truncated = LLM(model=str(folder), seed=0, yoco_prefill_truncation_mode="compact", yoco_prefill_keep_tokens=4)
    assert truncated.engine.model.truncation.mode == "compact" and truncated.engine.model.truncation.keep_tokens == 4
    assert [o.outputs[0].token_ids for o in truncated.generate(prompts, params, use_tqdm=False)] == plain
    with pytest.raises(InvalidEngineArgs, match="yoco_prefill_truncation_mode='mask' needs a DeepSeek-V4.1 model"):
        LLM(seed=0, yoco_prefill_truncation_mode="mask")
    with pytest.raises(InvalidEngineArgs, match="engram_on_host=True needs a model with Engram layers"):
        LLM(seed=0, engram_on_host=True)


DSPARK = {"dspark_block_size": 2, "dspark_noise_token_id": 95, "dspark_markov_rank": 8,
          "dspark_n_routed_experts": 3, "dspark_num_experts_per_tok": 2}
K = 2                # drafts per step
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def dspark_folder(tmp_path_factory):
    """(model, folder, greedy continuations of PROMPTS) of a tiny V4.1 checkpoint with a random DSpark
    head (its mtp.* tensors next to the backbone's)."""
    from v41_checkpoint import token_map_of, tokenizer
    from v41_configs import tiny_text
    from v41_helpers import tiny_model

    from deepinfer.model import DSparkDraft

    token_map = token_map_of(tokenizer(), 96)
    raw = tiny_text(engram_compressed_vocab_size=int(token_map.max()) + 1, **DSPARK)
    model = tiny_model(4, engram_compressed_vocab_size=raw["engram_compressed_vocab_size"], **DSPARK)
    model.bind_token_map(token_map)
    draft = DSparkDraft(model, 2)
    draft.init_weights(5, std=0.1)
    tensors = {**official_tensors(model, quantised=False), **{k: v.contiguous() for k, v in draft.state_dict().items()}}
    folder = write_folder(tmp_path_factory.mktemp("dspark"), model, raw, tensors, composite=False)
    return model, folder, [_greedy(model, p, MAX_TOKENS + K) for p in PROMPTS]


def _oracle(propose, continuations: list[list[int]]):
    """A draft proposer that knows the greedy continuations: a row whose anchor (id at its position)
    lies on one of them gets its next K tokens as drafts, the last one wrong at every third position
    (so steps accept all, some or none of their drafts); other rows keep the head's drafts. The head
    still runs (its rings, its confidences)."""
    sequences = [p + c for p, c in zip(PROMPTS, continuations)]

    def oracle(anchor_ids, anchor_positions, *args, **kwargs):
        prop = propose(anchor_ids, anchor_positions, *args, **kwargs)
        drafts = prop.token_ids.clone()
        for i, (token, position) in enumerate(zip(anchor_ids.tolist(), anchor_positions.tolist())):
            for seq in sequences:
                if position + K < len(seq) and seq[position] == token:
                    drafts[i] = torch.tensor(seq[position + 1:position + 1 + K])
                    if position % 3 == 0:
                        drafts[i, -1] = (drafts[i, -1] + 1) % 95
                    break
        return dataclasses.replace(prop, token_ids=drafts)

    return oracle


@pytest.mark.parametrize(("zos", "varlen"), [(False, False), (True, False), (True, True)],
                         ids=["zos-off", "zos-on", "zos-on-varlen"])
def test_speculative_decoding_on_a_v41_folder_keeps_greedy_output(dspark_folder, zos, varlen, monkeypatch) -> None:
    """A V4.1 checkpoint with a DSpark head: speculative steps verify through V4.1's multi-token decode
    (`ForwardBatch.multi_decode`), under ZOS (positions shifted on the device) and with the varlen
    policy (under ZOS its split comes from the device), and greedy output stays the plain greedy one,
    with the random head's drafts (almost all rejected) and with drafts that are mostly right."""
    model, folder, greedy = dspark_folder
    if varlen:          # curves under which drafting pays on any machine, kept (not fed the CPU's steps)
        flat = {"verify_forward": lambda tokens: 10.0 + 0.01 * tokens, "draft_walk": lambda rows: 0.1 * rows,
                "verification": lambda rows: 0.1}
        monkeypatch.setattr(DummySpecSteps, "timed", lambda self, work: flat[work.__name__])
        monkeypatch.setenv("DEEPINFER_VARLEN_PROFILE_CACHE", "off")
        for estimator in (ForwardRuntimeEstimator, SamplerRuntimeEstimator, AcceptanceCalibration):
            monkeypatch.setattr(estimator, "observe", lambda self, count, measured: None)
    llm = LLM(model=str(folder), seed=0, num_speculative_tokens=K, device="cpu", max_num_seqs=4,
              zero_overhead_scheduling=zos, varlen_verify=varlen)
    engine = llm.engine
    assert engine.zos is zos and (engine.spec.varlen is not None) is varlen
    runner = engine.runner
    verify_forward, seen = runner.verify_forward, []

    def recording(d, tokens, shift=None, query_lens=None, graph_size=None):
        seen.append((shift is not None, query_lens is not None))
        return verify_forward(d, tokens, shift, query_lens, graph_size)

    runner.verify_forward = recording
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for oracle in (False, True):
        if oracle:
            engine.spec.draft.propose = _oracle(engine.spec.draft.propose, greedy)
        before = engine.stats()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [g[:MAX_TOKENS] for g in greedy]
        stats = engine.stats()
        assert stats.spec_verify_steps > before.spec_verify_steps
        if oracle:
            accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
            drafted = stats.spec_draft_tokens - before.spec_draft_tokens
            assert 0 < accepted < drafted
    assert any(s for s, _ in seen) is zos and any(q for _, q in seen) is (zos and varlen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("zos", [False, True], ids=["zos-off", "zos-on"])
def test_speculative_v41_on_cuda_replays_verify_graphs(dspark_folder, zos) -> None:
    """On a GPU: V4.1's verify forwards replay the CUDA graphs keyed by total query tokens (no eager
    fallback), with and without ZOS, and greedy output with mostly-right drafts equals the same
    device's plain greedy decoding."""
    _, folder, greedy = dspark_folder
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    # A fixed cache for each engine: at the default gpu_memory_utilization=0.9 the first engine's
    # cache (0.9 of the card, alive until collected) left the second none on an 80 GB H100.
    common = dict(model=str(folder), seed=0, device="cuda", dtype="float32", max_num_seqs=4, kv_cache_memory_mb=256)
    plain = [list(o.outputs[0].token_ids) for o in LLM(**common).generate(prompts, params, use_tqdm=False)]
    # every draft verified: where the varlen policy finds the eager draft walk too slow to pay, rows
    # would decode plainly and these graphs would run no draft
    llm = LLM(**common, num_speculative_tokens=K, zero_overhead_scheduling=zos, varlen_verify=False)
    engine = llm.engine
    assert engine.runner.graphs is not None and engine.runner.graphs.max_query_len == K + 1
    replays = engine.runner.verify_replays_graph
    used = []
    engine.runner.verify_replays_graph = lambda *a, **kw: used.append(replays(*a, **kw)) or used[-1]
    engine.spec.draft.propose = _oracle(engine.spec.draft.propose, greedy)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == plain
    assert used and all(used)
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
