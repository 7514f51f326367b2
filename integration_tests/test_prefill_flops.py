"""benchmarks/prefill_flops.py: the prefill FLOP and byte model against hand-computed values on a tiny
V4 config, against the GEMM shapes of the model deepinfer-model builds, and chunked = one-shot."""

from __future__ import annotations

import pytest
import torch
from scripts_under_test import TINY_V4, load_script

from deepinfer.model import DeepseekV4Config
from deepinfer.model.model import build_model

flops = load_script("benchmarks/prefill_flops.py")




@pytest.fixture(scope="module")
def cfg() -> DeepseekV4Config:
    return DeepseekV4Config.from_dict(TINY_V4)


def test_closed_form_sums_match_the_loops() -> None:
    for lo in range(0, 20):
        for hi in range(lo - 1, 40):
            assert flops.sum_min(lo, hi, 8) == sum(min(8, m) for m in range(lo, hi + 1))
            for r in (1, 4, 8):
                assert flops.sum_floor_div(lo, hi, r) == sum(m // r for m in range(lo, hi + 1))
                assert flops.sum_floor_div(lo, hi, r, 2) == sum(min(2, m // r) for m in range(lo, hi + 1))


def test_attention_core_and_indexer_by_hand(cfg: DeepseekV4Config) -> None:
    # 12 queries from position 0 (n = 1 … 12). Window keys min(8, n): 1+…+8 + 4·8 = 68.
    csa = flops.layer_costs(cfg, 1, 0, 12)
    # CSA picks min(2, n // 4): n = 4…7 → 1 (4 terms), n = 8…12 → 2 (5 terms): 14 keys; 82 in all.
    assert csa["attn_core"].flops == 4 * 4 * 32 * 82
    # Index scores over n // 4 entries: 0,0,0,1,1,1,1,2,2,2,2,3 = 15; wq_b [2·16, 32], weights_proj [2, 64].
    assert csa["indexer"].flops == 2 * 12 * (32 * 32 + 64 * 2) + 2 * 2 * (16 + 1) * 15
    # HCA sees every n // 8 entry: n = 8…12 → 5 keys; 73 in all. The sliding layer: the window only.
    assert flops.layer_costs(cfg, 2, 0, 12)["attn_core"].flops == 4 * 4 * 32 * 73
    assert flops.layer_costs(cfg, 0, 0, 12)["attn_core"].flops == 4 * 4 * 32 * 68
    # Floor bytes: q and output (12 × 4 × 32 each), 12 window rows and the 3 entries of the chunk, bf16.
    assert csa["attn_core"].bytes == (2 * 12 * 4 * 32 + (12 + 3) * 32) * 2


def test_compressor_mhc_and_experts_by_hand(cfg: DeepseekV4Config) -> None:
    csa = flops.layer_costs(cfg, 1, 0, 12, expert_dtype="fp8")
    # CSA: overlapping (c = 2) main compressor of width 32 and index compressor of width 16: wkv + wgate
    # of [2·width, 64] each; 3 entries emitted, each pooling 2·4 slots per channel, then normed
    # (4 per channel) and rotated (3 per rope channel, 8 of them) — for each of the two compressors.
    assert csa["compressor"].flops == (2 * 12 * 64 * 4 * (32 + 16) + 3 * 2 * 8 * (32 + 16) + 3 * (32 + 16) * 4
                                       + 2 * 3 * 8 * 3)
    # mHC, two sites: hc_pre = the [(2 + 2)·2 = 8, 2·64] mix GEMM, RMS and collapse (2·12·128·(8 + 2))
    # + Sinkhorn (4·12·2²·3); hc_post = 2·12·128·(2 + 1).
    assert csa["mhc"].flops == 2 * (2 * 12 * 128 * 10 + 4 * 12 * 4 * 3 + 2 * 12 * 128 * 3)
    # Routed: 6·T·k·D·I; bytes: 4·(1 − (1/2)^12) experts touched of 3·64·64 FP8 weights (+ block
    # scales), x read and the output written in bf16.
    assert csa["moe_routed"].flops == 6 * 12 * 2 * 64 * 64
    touched = 4 * (1 - 0.5**12)
    assert csa["moe_routed"].bytes == pytest.approx(touched * 3 * 64 * 64 * (1 + 4 / 128**2) + 2 * 12 * 64 * 2)


def test_gemm_flops_are_twice_the_weights_the_model_holds(cfg: DeepseekV4Config) -> None:
    model = build_model(cfg, device="meta", dtype=torch.bfloat16)
    tokens = 5
    for layer, block in enumerate(model.layers):
        costs = flops.layer_costs(cfg, layer, 0, tokens)
        attn = block.attn
        proj = sum(m.weight.numel() for m in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a, attn.wo_b))
        assert costs["attn_proj"].flops == 2 * tokens * proj
        assert costs["router"].flops == 2 * tokens * block.ffn.gate.weight.numel()
        shared = sum(m.weight.numel() for m in (block.ffn.shared_experts.w1, block.ffn.shared_experts.w2,
                                                  block.ffn.shared_experts.w3))
        assert costs["moe_shared"].flops == 2 * tokens * shared
        per_expert = (block.ffn.experts.w13.numel() + block.ffn.experts.w2.numel()) / cfg.n_routed_experts
        assert costs["moe_routed"].flops == 2 * tokens * cfg.num_experts_per_tok * per_expert


def test_chunked_prefill_adds_up_to_one_shot(cfg: DeepseekV4Config) -> None:
    one_shot = flops.prefill_costs(cfg, [(0, 40)])
    chunks = flops.prefill_costs(cfg, flops.chunked(40, 16))
    assert flops.chunked(40, 16) == [(0, 16), (16, 16), (32, 8)]
    for name in ("attn_core", "indexer", "compressor", "moe_routed", "attn_proj", "mhc", "norm_rope"):
        assert chunks[name].flops == pytest.approx(one_shot[name].flops), name
    # Each chunk computes one logits row: 3 LM heads of 2·D·V against one.
    assert chunks["embed_head"].flops - one_shot["embed_head"].flops == pytest.approx(
        2 * (2 * 64 * 256 + 2 * 64 * 2 * 3 + 4 * 64))
    with pytest.raises(ValueError):
        flops.prefill_costs(cfg, [(0, 0)])
