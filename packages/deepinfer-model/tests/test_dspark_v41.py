"""The DSpark draft head on a tiny V4.1 target (spec §2.9.8): features of the streams entering the
target layers, MXFP8 ring rows, single-pass mHC stages with their own MoE, V4.1 Markov names."""

from __future__ import annotations

import pytest
import torch
from test_dspark import _official_draft_tensors
from v41_helpers import tiny_model

from deepinfer.kernels import kernels_for
from deepinfer.model import DSparkDraft, ForwardBatch, ModelCache

K, BACKTRACK = 3, 4
PROMPT = [5, 9, 2, 17, 33, 8, 41, 12, 7, 30, 22, 3]
DSPARK = {"dspark_block_size": K, "dspark_noise_token_id": 95, "dspark_markov_rank": 8,
          "dspark_n_routed_experts": 3, "dspark_num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def models():
    model = tiny_model(seed=2, **DSPARK)
    draft = DSparkDraft(model, 2)
    draft.init_weights(5, std=0.1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith(("_base", "attn_sink")):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    model.attach_draft(draft)
    return model, draft.eval()


def _cache(model) -> ModelCache:
    return ModelCache.allocate(model.cache_spec(8, BACKTRACK), num_blocks=8, num_slots=2)


def _run(model, cache, tokens: list[int], start: int) -> None:
    with torch.no_grad():
        model(ForwardBatch.build([tokens], [start], [list(range(1, 8))], [1], logits="all"), cache)


def test_v41_names_rings_and_shapes(models) -> None:
    model, draft = models
    keys = set(draft.state_dict())
    assert {"mtp.1.markov_head.embed.weight", "mtp.1.markov_head.head.weight", "mtp.1.norm.weight",
            "mtp.1.confidence_head.proj.weight", "mtp.0.main_proj.weight"} <= keys
    assert not any("hc_head" in k or "markov_w" in k for k in keys)
    assert draft.state_dict()["mtp.0.ffn.experts.w13"].shape[0] == 3          # the draft's own experts
    ring = {s.name: s for s in model.cache_spec(8, BACKTRACK).states}["mtp.0.window"]
    assert ring.dtype == torch.uint8 and ring.shape == (8 + BACKTRACK, 64 + 2)   # MXFP8: 64 bytes + 2 scales
    cache = _cache(model)
    _run(model, cache, PROMPT, 0)
    prop = draft.propose(torch.tensor([4]), torch.tensor([len(PROMPT)]), torch.tensor([1]), cache)
    assert prop.token_ids.shape == (1, K) and prop.logits.shape == (1, K, 96)
    assert torch.isfinite(prop.logits).all() and ((prop.confidence > 0) & (prop.confidence < 1)).all()


def test_v41_capture_uses_the_streams_entering_the_target_layers(models) -> None:
    model, draft = models
    cache = _cache(model)
    inputs = {}
    hooks = [model.layers[i].register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
             for i in (9, 10, 11)]
    _run(model, cache, PROMPT, 0)
    for h in hooks:
        h.remove()
    ops, stage0, eps = kernels_for("cpu"), draft.mtp[0], model.cfg.rms_norm_eps
    feats = torch.cat([inputs[i].mean(1) for i in (9, 10, 11)], dim=-1)
    main_x = ops.rms_norm(feats @ stage0.main_proj.weight.t(), stage0.main_norm.weight, eps)
    pos = torch.arange(len(PROMPT))
    ring_len = 8 + BACKTRACK
    for i, stage in enumerate(draft.mtp):
        want = stage.attn.keys(main_x, pos, ops, model.main_inv_freq, False)[-ring_len:]
        got = draft.codec.decode(cache.state[f"mtp.{i}.window"][1][pos[-ring_len:] % ring_len], want.dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_v41_rejected_positions_are_overwritten_never_read(models) -> None:
    model, draft = models
    dirty, clean = _cache(model), _cache(model)
    a = len(PROMPT)
    _run(model, dirty, PROMPT, 0)
    draft.propose(torch.tensor([4]), torch.tensor([a]), torch.tensor([1]), dirty)
    _run(model, dirty, [4, 50, 51, 52], a)
    ring_len = 8 + BACKTRACK
    for i in range(2):
        for pos in (a + 2, a + 3):
            dirty.state[f"mtp.{i}.window"][1, pos % ring_len] = 0xFF           # garbage bytes (NaN scales)
    after = draft.propose(torch.tensor([9]), torch.tensor([a + 2]), torch.tensor([1]), dirty)
    _run(model, clean, PROMPT + [4, 50], 0)
    expected = draft.propose(torch.tensor([9]), torch.tensor([a + 2]), torch.tensor([1]), clean)
    assert torch.isfinite(after.logits).all() and torch.equal(after.token_ids, expected.token_ids)
    torch.testing.assert_close(after.logits, expected.logits, rtol=1e-4, atol=1e-4)


def test_v41_official_names_round_trip(models) -> None:
    model, draft = models
    fresh = DSparkDraft(model, 2)
    fresh.load_weights(_official_draft_tensors(draft))
    for key, value in draft.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0, msg=key)
