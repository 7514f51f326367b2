"""The DSpark draft head (spec §2.8): context capture into the draft rings, the block forward with
bidirectional attention, the Markov walk, the confidence head, rollback by overwrite, official names."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.kernels import kernels_for
from deepinfer.kernels.reference import dequant_fp8_block, dequant_mxfp4, quant_fp8_block, quant_mxfp4
from deepinfer.model import (
    ConfigError,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    DSparkDraft,
    ForwardBatch,
    ModelCache,
    WeightError,
    load_model,
)

RAW = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 16,
    "qk_rope_head_dim": 4, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "sliding_window": 8,
    "compress_ratios": [0, 4, 0], "index_n_heads": 2, "index_head_dim": 8, "index_topk": 64,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
    "num_hash_layers": 1, "hc_mult": 2, "hc_sinkhorn_iters": 3, "max_position_embeddings": 256,
    "dspark_block_size": 3, "dspark_noise_token_id": 63, "dspark_target_layer_ids": [1, 2], "dspark_markov_rank": 8,
}
K, W, BACKTRACK = 3, 8, 4          # block size, window, spare ring rows (>= K + 1)
PROMPT = [5, 9, 2, 17, 33, 8, 41, 12, 7, 30, 22]


def _models(seed: int = 0, num_stages: int = 2) -> tuple[DeepseekV4ForCausalLM, DSparkDraft]:
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(RAW))
    model.init_weights(seed)
    draft = DSparkDraft(model, num_stages)
    draft.init_weights(seed + 1)
    with torch.no_grad():                # make the inert-by-default parameters matter
        for name, p in draft.named_parameters():
            if name.endswith(("_base", "attn_sink")):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    model.attach_draft(draft)
    return model.eval(), draft.eval()


def _cache(model: DeepseekV4ForCausalLM) -> ModelCache:
    return ModelCache.allocate(model.cache_spec(8, BACKTRACK), num_blocks=16, num_slots=3)


def _run(model, cache, tokens: list[int], start: int, slot: int = 1) -> torch.Tensor:
    table = list(range(1, 9)) if slot == 1 else list(range(9, 16))
    with torch.no_grad():
        return model(ForwardBatch.build([tokens], [start], [table], [slot], logits="all"), cache)


def _propose(draft, cache, anchor: int, position: int, slot: int = 1):
    return draft.propose(torch.tensor([anchor]), torch.tensor([position]), torch.tensor([slot]), cache)


def test_cache_spec_declares_checked_rings() -> None:
    model, draft = _models()
    states = {s.name: s for s in model.cache_spec(8, BACKTRACK).states}
    assert states["mtp.0.window"].shape == (W + BACKTRACK, 16) and not states["mtp.1.window"].stored
    with pytest.raises(ValueError, match="max_backtracking=3 must be >= dspark_block_size \\+ 1 = 4"):
        model.cache_spec(8, K)
    model.attach_draft(None)
    assert "mtp.0.window" not in {s.name for s in model.cache_spec(8, BACKTRACK).states}


def test_capture_writes_projected_target_features_and_costs_nothing_when_off() -> None:
    model, draft = _models()
    cache = _cache(model)
    outputs = {}
    hooks = [model.layers[i].register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out))
             for i in (1, 2)]
    logits = _run(model, cache, PROMPT, 0)
    for h in hooks:
        h.remove()
    feats = torch.cat([outputs[1].mean(1), outputs[2].mean(1)], dim=-1)           # hc-mean of the outputs
    stage0, ops = draft.mtp[0], kernels_for("cpu")
    main_x = ops.rms_norm(feats @ stage0.main_proj.weight.t(), stage0.main_norm.weight, model.cfg.rms_norm_eps)
    pos = torch.arange(len(PROMPT))
    ring_len = W + BACKTRACK
    for i, stage in enumerate(draft.mtp):
        keys = stage.attn.keys(main_x, pos, ops, model.main_inv_freq, False)
        ring = cache.state[f"mtp.{i}.window"][1]
        kept = pos[-ring_len:]                                  # a chunk longer than the ring keeps its tail
        torch.testing.assert_close(ring[kept % ring_len], keys[kept], rtol=0, atol=0)
    # detached: same logits, and the draft rings are not touched
    model.attach_draft(None)
    plain = ModelCache.allocate(model.cache_spec(8, BACKTRACK), num_blocks=16, num_slots=3)
    torch.testing.assert_close(_run(model, plain, PROMPT, 0), logits, rtol=0, atol=0)


def test_chunked_prefill_and_decode_fill_the_rings_alike() -> None:
    model, _ = _models()
    one, pieces = _cache(model), _cache(model)
    _run(model, one, PROMPT, 0)
    _run(model, pieces, PROMPT[:4], 0)
    _run(model, pieces, PROMPT[4:9], 4)
    for t, tok in enumerate(PROMPT[9:], start=9):
        _run(model, pieces, [tok], t)
    for i in range(2):
        torch.testing.assert_close(pieces.state[f"mtp.{i}.window"], one.state[f"mtp.{i}.window"], rtol=1e-5, atol=1e-6)


def test_block_forward_shapes_and_bidirectional_window_mask() -> None:
    model, draft = _models()
    cache = _cache(model)
    _run(model, cache, PROMPT, 0)
    a = len(PROMPT)
    prop = _propose(draft, cache, 4, a)
    assert prop.token_ids.shape == (1, K) and prop.logits.shape == (1, K, 64) and prop.confidence.shape == (1, K)
    assert prop.token_ids.dtype == torch.int64 and ((prop.confidence > 0) & (prop.confidence < 1)).all()
    # the anchor's query sees the later noise keys: another noise token changes its logits
    other = dataclasses.replace(model.cfg, dspark_noise_token_id=11)
    draft.cfg = other
    changed = _propose(draft, cache, 4, a)
    draft.cfg = model.cfg
    assert not torch.allclose(changed.logits[:, 0], prop.logits[:, 0])
    # window: position a − W is seen, a − W − 1 is not (its ring row is poisoned with NaN)
    ring_len = W + BACKTRACK
    for i in range(2):
        cache.state[f"mtp.{i}.window"][1, (a - W - 1) % ring_len] = float("nan")
    same = _propose(draft, cache, 4, a)
    torch.testing.assert_close(same.logits, prop.logits, rtol=0, atol=0)
    cache.state["mtp.0.window"][1, (a - W) % ring_len] += 1.0
    assert not torch.allclose(_propose(draft, cache, 4, a).logits, prop.logits)


def test_block_size_can_be_overridden() -> None:
    model, draft = _models()
    small = DSparkDraft(model, 2, block_size=2)
    small.load_state_dict(draft.state_dict())
    model.attach_draft(small)
    cache = _cache(model)
    _run(model, cache, PROMPT, 0)
    assert _propose(small, cache, 4, len(PROMPT)).token_ids.shape == (1, 2)
    with pytest.raises(ConfigError, match="block_size=0"):
        DSparkDraft(model, 2, block_size=0)


def test_markov_walk_and_confidence_follow_the_previous_token() -> None:
    model, draft = _models()
    cache = _cache(model)
    _run(model, cache, PROMPT, 0)
    a = len(PROMPT)
    last = draft.mtp[-1]
    saved = last.markov_head.markov_w2.weight.detach().clone()
    with torch.no_grad():
        last.markov_head.markov_w2.weight.zero_()
        base = _propose(draft, cache, 4, a).logits                      # U_j alone (the block is the same)
        last.markov_head.markov_w2.weight.copy_(saved)
        proj = last.confidence_head.proj.weight
        proj[:, :32] = 0.0                                              # confidence from e_j only
    prop = _propose(draft, cache, 4, a)
    prev = torch.cat((torch.tensor([4]), prop.token_ids[0, :-1]))        # out_0 = anchor, then the drafts
    e = last.markov_head.markov_w1.weight[prev]
    torch.testing.assert_close(prop.logits[0], base[0] + e @ saved.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(prop.token_ids[0], prop.logits[0].argmax(-1))
    torch.testing.assert_close(prop.confidence[0], torch.sigmoid(e.float() @ proj[0, 32:].float()), rtol=1e-5,
                               atol=1e-6)


def test_rejected_positions_are_overwritten_never_read() -> None:
    """prefill → draft → verify [anchor, 3 drafts] with only one accepted → next draft equals the draft
    after a clean prefill of the committed tokens, though the rings held rejected rows (poisoned)."""
    model, draft = _models()
    dirty, clean = _cache(model), _cache(model)
    a = len(PROMPT)
    _run(model, dirty, PROMPT, 0)
    _propose(draft, dirty, 4, a)                             # block keys land at a … a + K − 1
    _run(model, dirty, [4, 50, 51, 52], a)                   # verify; say only 50 is accepted, 9 is the bonus
    ring_len = W + BACKTRACK
    for i in range(2):                                       # rows of rejected positions: never read
        for pos in (a + 2, a + 3):
            dirty.state[f"mtp.{i}.window"][1, pos % ring_len] = float("nan")
    after = _propose(draft, dirty, 9, a + 2)
    _run(model, clean, PROMPT + [4, 50], 0)
    expected = _propose(draft, clean, 9, a + 2)
    assert torch.isfinite(after.logits).all()
    assert torch.equal(after.token_ids, expected.token_ids)
    torch.testing.assert_close(after.logits, expected.logits, rtol=1e-4, atol=1e-5)


def test_batched_proposals_match_single_ones() -> None:
    model, draft = _models()
    cache = _cache(model)
    _run(model, cache, PROMPT, 0, slot=1)
    _run(model, cache, PROMPT[:6], 0, slot=2)
    both = draft.propose(torch.tensor([4, 7]), torch.tensor([len(PROMPT), 6]), torch.tensor([1, 2]), cache)
    single = _propose(draft, cache, 7, 6, slot=2)
    torch.testing.assert_close(both.logits[1:], single.logits, rtol=1e-5, atol=1e-5)


def _official_draft_tensors(draft: DSparkDraft) -> dict[str, torch.Tensor]:
    """The draft's weights under checkpoint names: per-expert w1 / w3 / w2."""
    out = {}
    inter = draft.cfg.moe_intermediate_size
    for key, t in draft.state_dict().items():
        if key.endswith(".experts.w13"):
            for e in range(t.shape[0]):
                out[key.replace("w13", f"{e}.w1.weight")] = t[e, :inter].clone()
                out[key.replace("w13", f"{e}.w3.weight")] = t[e, inter:].clone()
        elif key.endswith(".experts.w2"):
            for e in range(t.shape[0]):
                out[key.replace("w2", f"{e}.w2.weight")] = t[e].clone()
        else:
            out[key] = t.clone()
    return out


def test_loads_official_mtp_names_from_a_checkpoint(tmp_path) -> None:
    model, draft = _models(seed=3, num_stages=3)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    mtp = _official_draft_tensors(draft)
    want = draft.state_dict()
    # FP8 and MXFP4 as the release stores them; the draft gets their dequantised values
    fp8, scale = quant_fp8_block(mtp["mtp.0.main_proj.weight"].float(), 128)
    mtp["mtp.0.main_proj.weight"], mtp["mtp.0.main_proj.scale"] = fp8, scale
    want["mtp.0.main_proj.weight"] = dequant_fp8_block(fp8, scale, 128).to(want["mtp.0.main_proj.weight"].dtype)
    packed, e8m0 = quant_mxfp4(mtp["mtp.1.ffn.experts.2.w1.weight"].float())
    mtp["mtp.1.ffn.experts.2.w1.weight"], mtp["mtp.1.ffn.experts.2.w1.scale"] = packed, e8m0
    want["mtp.1.ffn.experts.w13"][2, :16] = dequant_mxfp4(packed, e8m0)
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(RAW))
    loaded = load_model(tmp_path)
    stored = loaded.draft_weights                       # kept as stored
    assert stored["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn and "mtp.0.main_proj.scale" in stored
    assert torch.equal(stored["mtp.1.ffn.experts.2.w1.weight"], packed)
    restored = DSparkDraft.from_model(loaded)
    assert restored.num_stages == 3
    got = restored.state_dict()
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    with pytest.raises(WeightError, match="missing draft weight"):
        DSparkDraft(model, 3).load_weights({k: v for k, v in mtp.items() if "confidence" not in k})
    with pytest.raises(WeightError, match="without its scale"):
        DSparkDraft(model, 3).load_weights({k: v for k, v in mtp.items() if k != "mtp.0.main_proj.scale"})
    with pytest.raises(WeightError, match="unexpected draft weight 'mtp.0.bogus.weight'"):
        DSparkDraft(model, 3).load_weights({"mtp.0.bogus.weight": torch.zeros(1)})


def test_stacked_fp8_experts_are_dequantised_and_a_wrong_block_is_named() -> None:
    model, draft = _models()
    tensors = dict(draft.state_dict())
    pairs = [quant_fp8_block(w.float(), 128) for w in tensors["mtp.0.ffn.experts.w13"]]
    tensors["mtp.0.ffn.experts.w13"] = torch.stack([q for q, _ in pairs])
    tensors["mtp.0.ffn.experts.w13_scale"] = torch.stack([s for _, s in pairs])
    fresh = DSparkDraft(model, 2)
    fresh.load_weights(tensors)
    for e, (q, s) in enumerate(pairs):
        assert torch.equal(fresh.state_dict()["mtp.0.ffn.experts.w13"][e], dequant_fp8_block(q, s, 128))
    tensors["mtp.0.ffn.experts.w13_scale"] = tensors["mtp.0.ffn.experts.w13_scale"].repeat(1, 2, 1)
    with pytest.raises(WeightError, match="'mtp.0.ffn.experts.w13': fp8 scale shape"):
        DSparkDraft(model, 2).load_weights(tensors)
