"""Reference ops against independent formulations and the spec's pinned numbers."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.kernels import kernels_for, register
from deepinfer.kernels import reference as ref


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_matches_formula() -> None:
    x, w = torch.randn(3, 16, generator=_gen(0)), torch.randn(16, generator=_gen(1))
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6), expect)
    assert ref.rms_norm(x.bfloat16(), w, 1e-6).dtype == torch.bfloat16


def test_yarn_correction_range_of_v4_flash() -> None:
    # spec §2.3: rd 64, base 160000, original 65536, beta 32/1 → low 15, high 25, factor 16
    yarn = ref.YarnScaling(factor=16.0, original_max_position_embeddings=65536)
    plain = ref.rope_inv_freq(64, 160000.0)
    scaled = ref.rope_inv_freq(64, 160000.0, yarn)
    torch.testing.assert_close(scaled[:16], plain[:16])                 # ramp 0 up to low = 15
    torch.testing.assert_close(scaled[25:], plain[25:] / 16)            # ramp 1 from high = 25
    ramp = (20 - 15) / (25 - 15)
    torch.testing.assert_close(scaled[20], plain[20] / 16 * ramp + plain[20] * (1 - ramp))


def test_rope_rotates_trailing_pairs_and_inverts() -> None:
    x = torch.randn(5, 3, 12, generator=_gen(2))
    pos = torch.tensor([0, 1, 7, 100, 4096])
    inv = ref.rope_inv_freq(4, 10000.0)
    y = ref.apply_rope(x, pos, inv)
    torch.testing.assert_close(y[..., :8], x[..., :8])
    angle = pos[3].float() * inv[1]
    a, b = x[3, 0, 10], x[3, 0, 11]                                     # pair 1 of the rope dims
    torch.testing.assert_close(y[3, 0, 10], a * torch.cos(angle) - b * torch.sin(angle))
    torch.testing.assert_close(y[3, 0, 11], b * torch.cos(angle) + a * torch.sin(angle))
    torch.testing.assert_close(ref.apply_rope(y, pos, inv, inverse=True), x, atol=1e-5, rtol=0)


def test_hc_pre_gives_doubly_stochastic_comb_and_post_mixes_transposed() -> None:
    hc, dim = 3, 8
    streams = torch.randn(4, hc, dim, generator=_gen(3))
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=_gen(4)) * 0.1
    base, scale = torch.randn((2 + hc) * hc, generator=_gen(5)), torch.tensor([0.7, 1.2, 0.9])
    x, post, comb = ref.hc_pre(streams, fn, scale, base, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    torch.testing.assert_close(comb.sum(-1), torch.ones(4, hc), atol=1e-3, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(4, hc), atol=1e-5, rtol=0)
    assert x.shape == (4, dim) and bool((post > 0).all() and (post < 2).all())
    block_out = torch.randn(4, dim, generator=_gen(6))
    out = ref.hc_post(block_out, streams, post, comb)
    k = 1
    expect = post[:, k, None] * block_out + sum(comb[:, j, k, None] * streams[:, j] for j in range(hc))
    torch.testing.assert_close(out[:, k], expect)


def test_compress_pool_is_per_channel_softmax_and_ignores_missing_slots() -> None:
    kv = torch.randn(2, 6, 4, generator=_gen(7))
    gate = torch.randn(2, 6, 4, generator=_gen(8))
    gate[0, :3] = float("-inf")
    out = ref.compress_pool(kv, gate)
    w = torch.exp(gate[1, :, 2]) / torch.exp(gate[1, :, 2]).sum()
    torch.testing.assert_close(out[1, 2], (w * kv[1, :, 2]).sum())
    w0 = torch.softmax(gate[0, 3:, 0], 0)
    torch.testing.assert_close(out[0, 0], (w0 * kv[0, 3:, 0]).sum())


def test_topk_ties_go_to_lowest_index_and_respect_visibility() -> None:
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 2.0, 9.0], [5.0, 1.0, 0.0, 0.0, 0.0]])
    picks = ref.topk_lowest_index(scores, torch.tensor([5, 4, 1]), 3)
    assert picks.tolist() == [[0, 1, 2], [1, 2, 3], [0, -1, -1]]


def test_indexer_scores_formula() -> None:
    q, k = torch.randn(2, 3, 4, generator=_gen(9)), torch.randn(5, 4, generator=_gen(10))
    w = torch.randn(2, 3, generator=_gen(11))
    out = ref.indexer_scores(q, k, w, 0.5)
    expect = sum(w[1, h] * torch.relu(q[1, h] @ k[2]) * 0.5 for h in range(3))
    torch.testing.assert_close(out[1, 2], expect)


def test_sparse_attention_with_sink_matches_explicit_softmax() -> None:
    q, kv = torch.randn(2, 2, 8, generator=_gen(12)), torch.randn(2, 5, 8, generator=_gen(13))
    valid = torch.tensor([[True, False, True, True, False], [False] * 5])
    sink = torch.tensor([0.3, -1.0])
    out = ref.sparse_attention(q, kv, valid, sink, 8**-0.5)
    s = torch.stack([q[0, 1] @ kv[0, j] * 8**-0.5 for j in (0, 2, 3)])
    denom = torch.exp(s).sum() + math.exp(-1.0)
    expect = sum(torch.exp(s[n]) * kv[0, j] for n, j in enumerate((0, 2, 3))) / denom
    torch.testing.assert_close(out[0, 1], expect)
    assert bool((out[1] == 0).all())                                    # no valid row → 0


def test_grouped_linear_is_block_diagonal() -> None:
    x, w = torch.randn(3, 2, 6, generator=_gen(14)), torch.randn(2 * 4, 6, generator=_gen(15))
    out = ref.grouped_linear(x, w)
    torch.testing.assert_close(out[:, 1], x[:, 1] @ w[4:].t())


def test_routing_selects_with_bias_but_weights_without() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    scores = ref.router_scores(logits, "sqrtsoftplus")
    torch.testing.assert_close(scores, torch.sqrt(torch.log1p(torch.exp(logits))))
    ids = ref.select_experts(scores, torch.tensor([0.0, 0.0, 5.0, 0.0]), 2)
    assert ids.tolist() == [[2, 1]]
    weights = ref.routing_weights(scores, ids, normalize=True, scaling=1.5)
    torch.testing.assert_close(weights.sum(), torch.tensor(1.5))
    torch.testing.assert_close(weights[0, 0] / weights[0, 1], scores[0, 2] / scores[0, 1])


def test_moe_experts_equals_dense_loop_and_clamps() -> None:
    x = torch.randn(5, 8, generator=_gen(16)) * 20
    w13, w2 = torch.randn(3, 12, 8, generator=_gen(17)), torch.randn(3, 8, 6, generator=_gen(18))
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    wts = torch.rand(5, 2, generator=_gen(19))
    out = ref.moe_experts(x, ids, wts, w13, w2, 10.0)
    for t in range(5):
        expect = sum(
            wts[t, j] * (w2[e] @ (torch.nn.functional.silu((w13[e, :6] @ x[t]).clamp(max=10))
                                  * (w13[e, 6:] @ x[t]).clamp(-10, 10)))
            for j, e in enumerate(ids[t].tolist())
        )
        torch.testing.assert_close(out[t], expect, atol=1e-4, rtol=1e-5)


def test_dequant_fp8_block_and_mxfp4_known_values() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, -0.25]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[128.0, 127.0]], dtype=torch.float32).to(torch.uint8)   # e8m0 bytes: 2^1, 2^0
    out = ref.dequant_fp8_block(w, scale, 2)
    assert out.tolist() == [[2.0, -4.0, 0.5], [896.0, 0.0, -0.25]]
    packed = torch.tensor([[0x21, 0xF8] + [0] * 14], dtype=torch.uint8)   # codes 1, 2, 8 (−0), 15 (−6)
    out = ref.dequant_mxfp4(packed, torch.tensor([[126]], dtype=torch.uint8))  # scale 2^-1
    assert out[0, :4].tolist() == [0.25, 0.5, -0.0, -3.0]
    with pytest.raises(ValueError, match="fp8 scale shape"):
        ref.dequant_fp8_block(w, torch.ones(2, 2), 2)


def test_quant_fp8_block_round_trips_and_fp8_experts_equal_dequantised_ones() -> None:
    w = torch.randn(300, 260, generator=_gen(30)) * 0.1
    w[:128, :128] = 0.0                                           # an all-zero block: scale 1
    q, scale = ref.quant_fp8_block(w, 128)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 3) and scale[0, 0] == 1.0
    back = ref.dequant_fp8_block(q, scale, 128)
    assert (back - w).abs().max() <= w.abs().max() / 16             # e4m3: 3 mantissa bits
    assert back[:128, :128].abs().max() == 0 and (q.float().abs().amax() <= 448)

    experts, hidden, inter, block = 4, 64, 32, 32
    quantised = [ref.quant_fp8_block(torch.randn(2 * inter, hidden, generator=_gen(31 + e)), block)
                 for e in range(experts)]
    down = [ref.quant_fp8_block(torch.randn(hidden, inter, generator=_gen(41 + e)), block) for e in range(experts)]
    w13, s13 = torch.stack([q for q, _ in quantised]), torch.stack([s for _, s in quantised])
    w2, s2 = torch.stack([q for q, _ in down]), torch.stack([s for _, s in down])
    x = torch.randn(5, hidden, generator=_gen(50))
    ids, weights = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3]]), torch.rand(5, 2, generator=_gen(51))
    want = ref.moe_experts(x, ids, weights, torch.stack([ref.dequant_fp8_block(q, s, block) for q, s in quantised]),
                           torch.stack([ref.dequant_fp8_block(q, s, block) for q, s in down]), 7.0)
    torch.testing.assert_close(ref.moe_experts_fp8(x, ids, weights, w13, s13, w2, s2, 7.0, block), want)


def test_quant_mxfp4_is_fake_quant_fp4_and_mxfp4_experts_equal_dequantised_ones() -> None:
    w = torch.randn(6, 64, generator=_gen(60)) * 0.3
    packed, scale = ref.quant_mxfp4(w)
    assert packed.dtype == scale.dtype == torch.uint8 and packed.shape == (6, 32) and scale.shape == (6, 2)
    torch.testing.assert_close(ref.dequant_mxfp4(packed, scale), ref.fake_quant_fp4(w, 32), atol=0, rtol=0)
    with pytest.raises(ValueError, match="in=40 divisible by the group 32"):
        ref.quant_mxfp4(torch.ones(2, 40))

    experts, hidden, inter = 3, 64, 32
    up = [ref.quant_mxfp4(torch.randn(2 * inter, hidden, generator=_gen(61 + e))) for e in range(experts)]
    down = [ref.quant_mxfp4(torch.randn(hidden, inter, generator=_gen(71 + e))) for e in range(experts)]
    x = torch.randn(4, hidden, generator=_gen(80))
    ids, weights = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0]]), torch.rand(4, 2, generator=_gen(81))
    want = ref.moe_experts(x, ids, weights, torch.stack([ref.dequant_mxfp4(p, s) for p, s in up]),
                           torch.stack([ref.dequant_mxfp4(p, s) for p, s in down]), 7.0)
    got = ref.moe_experts_mxfp4(x, ids, weights, torch.stack([p for p, _ in up]), torch.stack([s for _, s in up]),
                                torch.stack([p for p, _ in down]), torch.stack([s for _, s in down]), 7.0)
    torch.testing.assert_close(got, want)


def test_fake_quant_values_are_representable() -> None:
    x = torch.randn(4, 128, generator=_gen(20)) * 3
    q8 = ref.fake_quant_fp8(x, 64)
    assert (q8 - x).abs().max() <= x.abs().max() / 16
    blocks = q8.view(4, 2, 64)
    scale = torch.exp2(torch.ceil(torch.log2(x.view(4, 2, 64).abs().amax(-1, keepdim=True) / 448)))
    torch.testing.assert_close((blocks / scale).to(torch.float8_e4m3fn).float() * scale, blocks, atol=0, rtol=0)
    q4 = ref.fake_quant_fp4(x, 32)
    scale4 = torch.exp2(torch.ceil(torch.log2(x.view(4, 4, 32).abs().amax(-1, keepdim=True) / 6)))
    levels = set((q4.view(4, 4, 32) / scale4).abs().flatten().tolist())
    assert levels <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


def test_registry_falls_back_to_reference_and_rejects_unknown_ops() -> None:
    ops = kernels_for("cpu")
    assert ops.rms_norm is ref.rms_norm and set(ops.sources.values()) == {"reference"}
    with pytest.raises(ValueError, match="not a reference op"):
        register("no_such_op", "cuda", lambda: ref.rms_norm)
    with pytest.raises(AttributeError, match="no kernel named"):
        _ = ops.no_such_op
