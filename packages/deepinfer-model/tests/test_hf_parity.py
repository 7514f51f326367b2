"""Logits of our model vs transformers' DeepseekV4ForCausalLM on tiny random configs (float32)."""

from __future__ import annotations

import pytest
import torch
from hf_twin import Runner, hf_logits, hf_model, twin

ATOL = 2e-5   # observed ≤ 3e-7; float32 reductions in a different order

CONFIGS = {
    # sliding / CSA / HCA / sliding, 1 hash layer, hc_mult 2, saturated index top-k
    "base": {},
    # YaRN compress rope, hc_mult 3, 2 hash layers, top-3 of many compressed rows (selection active;
    # ≥16 index heads so ReLU ties are negligible, reference/deepseek-v4-spec.md §6.3)
    "selective": dict(
        num_hidden_layers=6, hc_mult=3, num_hash_layers=2, index_n_heads=16, index_topk=3, sliding_window=6,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1},
    ),
    # CSA ratio 4 and HCA ratio 4 side by side, window larger than a block, no hash layers, hc_mult 4
    "wide": dict(
        num_hidden_layers=3, hc_mult=4, num_hash_layers=0, sliding_window=20, index_topk=5, index_n_heads=16,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 4},
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request):
    hf, raw = hf_model(seed=len(request.param), **CONFIGS[request.param])
    return hf, twin(hf, raw)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model, ids: list[int], steps: list[int]) -> torch.Tensor:
    runner = Runner(model)
    outs, pos = [], 0
    for n in steps:
        outs.append(runner.step({1: ids[pos:pos + n]})[0])
        pos += n
    assert pos == len(ids)
    return torch.cat(outs)


def test_one_shot_prefill(models) -> None:
    hf, ours = models
    ids = _prompt(53, 1)
    torch.testing.assert_close(_run(ours, ids, [53]), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_cut_inside_compression_windows(models) -> None:
    hf, ours = models
    ids = _prompt(53, 2)
    # cuts at 5, 11, 13, 30, 47: inside ratio-4 and ratio-8 windows, across window and block edges
    torch.testing.assert_close(_run(ours, ids, [5, 6, 2, 17, 17, 6]), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_prefill_then_token_by_token_decode(models) -> None:
    hf, ours = models
    ids = _prompt(45, 3)
    torch.testing.assert_close(_run(ours, ids, [19] + [1] * 26), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_prefill_then_multi_token_decode_steps(models) -> None:
    hf, ours = models
    ids = _prompt(45, 4)
    torch.testing.assert_close(_run(ours, ids, [9, 3, 2, 5, 4, 1, 6, 5, 3, 7]), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_several_sequences_packed_at_different_positions(models) -> None:
    hf, ours = models
    a, b, c = _prompt(30, 5), _prompt(26, 6), _prompt(9, 7)
    runner = Runner(ours)
    s1 = runner.step({1: a[:11], 3: b[:7]})
    s2 = runner.step({3: b[7:20], 1: a[11:12], 5: c})
    s3 = runner.step({1: a[12:30], 3: b[20:26]})
    torch.testing.assert_close(torch.cat([s1[0], s2[1], s3[0]]), hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([s1[1], s2[0], s3[1]]), hf_logits(hf, b), atol=ATOL, rtol=0)
    torch.testing.assert_close(s2[2], hf_logits(hf, c), atol=ATOL, rtol=0)


def test_last_token_logits_only(models) -> None:
    hf, ours = models
    ids = _prompt(21, 8)
    last = Runner(ours).step({2: ids}, logits="last")[0]
    torch.testing.assert_close(last, hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


def test_prefill_in_small_query_blocks(models, monkeypatch) -> None:
    from deepinfer.model.layers import attention

    hf, ours = models
    monkeypatch.setattr(attention, "PREFILL_QUERY_BLOCK", 7)       # 53 queries in 8 blocks
    ids = _prompt(53, 7)
    torch.testing.assert_close(_run(ours, ids, [53]), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_stacked_projections_follow_reloaded_weights() -> None:
    """The stacked projection weights are views shared with the checkpoint parameters, and are
    rebuilt when `load_state_dict(assign=True)` replaces those parameters."""
    from deepinfer.model.names import to_official

    hf, raw = hf_model(seed=3)
    ours = twin(hf, raw)
    ids = _prompt(19, 3)
    torch.testing.assert_close(_run(ours, ids, [19]), hf_logits(hf, ids), atol=ATOL, rtol=0)
    attn = ours.layers[1].attn
    stacked = attn.__dict__["_x_weight"]
    assert attn.wq_a.weight.data_ptr() == stacked.data_ptr()
    assert attn.wkv.weight.data_ptr() == stacked[attn.wq_a.out_features:].data_ptr()
    assert "_x_weight" not in dict(ours.named_buffers()) and len(ours.state_dict()) == len(hf.state_dict())

    other, _ = hf_model(seed=4)
    ours.load_state_dict({to_official(k): v for k, v in other.state_dict().items()}, strict=True, assign=True)
    torch.testing.assert_close(_run(ours, ids, [19]), hf_logits(other, ids), atol=ATOL, rtol=0)
