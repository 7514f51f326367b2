"""DeepSeek-V4.1 reference ops against hand-computed cases (reference/deepseek-v4-spec.md §2.9, §3.2)."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.kernels.reference import (
    candidate_blocks,
    dequant_fp4_rows,
    dequant_mxfp8_rows,
    engram_hash,
    engram_offsets,
    engram_primes,
    hc_collapse,
    hc_expand,
    hc_mixes,
    hc_post,
    hc_pre,
    packed_row_bytes,
    quant_fp4_rows,
    quant_mxfp8_rows,
    topk_finite,
)
from deepinfer.kernels.reference.v41_engram import is_prime
from deepinfer.kernels.reference.v41_quant import e2m1_codes, e2m1_values, pow2_ceil


def test_packed_row_sizes_of_the_released_model() -> None:
    assert packed_row_bytes("mxfp8", 512) == 528          # window row: 512 FP8 + 16 UE8M0
    assert packed_row_bytes("fp4_e4m3", 512) == 288       # compressed KV: 256 code bytes + 32 e4m3
    assert packed_row_bytes("fp4_ue8m0", 128) == 68       # index key: 64 code bytes + 4 UE8M0
    assert 3 * (288 + 68) / 2 + (288 + 68) == 890         # bytes per token of the 4 KV sources


def test_e2m1_rounds_to_nearest_even() -> None:
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 6.0, 0.3, -0.0, 4.9])
    assert e2m1_values(e2m1_codes(v)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, 6.0, 0.5, -0.0, 4.0]
    assert e2m1_codes(torch.tensor([-0.75])).item() == 0b1010


def test_pow2_ceil_is_exact_at_and_just_above_powers_of_two() -> None:
    just_above = torch.tensor(2.0**-10).nextafter(torch.tensor(1.0))
    got = pow2_ceil(torch.stack([torch.tensor(1.0), torch.tensor(1.5), just_above, torch.tensor(3.0)]))
    assert got.tolist() == [1.0, 2.0, 2.0**-9, 4.0]


def test_mxfp8_hand_case() -> None:
    x = torch.zeros(64)
    x[0], x[1], x[2], x[3] = 352.0, -2.0, 0.5, 336.0  # block 0: amax/448 < 1 → scale 1; 336 ties to 320
    x[32], x[33] = 900.0, 3.0                      # block 1: 900/448 → scale 4; 225 → e4m3 224
    rows = quant_mxfp8_rows(x)
    assert rows.shape == (66,) and rows[64:].tolist() == [127, 129]
    y = dequant_mxfp8_rows(rows, 64)
    assert y[:4].tolist() == [352.0, -2.0, 0.5, 320.0] and y[32].item() == 896.0 and y[33].item() == 3.0
    assert dequant_mxfp8_rows(quant_mxfp8_rows(torch.zeros(32)), 32).abs().sum() == 0


def test_fp4_hand_cases() -> None:
    x = torch.tensor([6.0, 0.75, 1.75, -3.5, 5.0, 0.25] + [0.0] * 10)      # amax 6 → e4m3 scale 1.0
    rows = quant_fp4_rows(x, e4m3_scales=True)
    assert rows.shape == (9,) and rows[8].item() == 0x38                  # e4m3 1.0
    assert rows[0].item() == 0x7 | (0x2 << 4)                              # 6 | 1.0<<4, low nibble first
    assert dequant_fp4_rows(rows, 16, e4m3_scales=True)[:6].tolist() == [6.0, 1.0, 2.0, -4.0, 4.0, 0.0]
    x = torch.zeros(32)
    x[0], x[1], x[2] = 12.0, 3.0, 2.5                                      # ue8m0: 12 / 6 → scale 2
    rows = quant_fp4_rows(x, e4m3_scales=False)
    assert rows.shape == (17,) and rows[16].item() == 128
    assert dequant_fp4_rows(rows, 32, e4m3_scales=False)[:3].tolist() == [12.0, 3.0, 2.0]


@pytest.mark.parametrize("fmt", ["mxfp8", "fp4_e4m3", "fp4_ue8m0"])
def test_packed_round_trip_error_bounds(fmt) -> None:
    """Per block: FP8 e4m3 keeps 3 mantissa bits (error ≤ |x|·2^-4, or 2^-10·scale near zero); e2m1's
    gaps give error ≤ max(scale/4, |x|/4), plus, with an e4m3 scale (rounded by up to 1/16 of itself,
    or 2^-10 when subnormal), the clamp of values above 6 × the rounded-down scale."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 512, generator=gen) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=gen).float())
    if fmt == "mxfp8":
        y = dequant_mxfp8_rows(quant_mxfp8_rows(x), 512)
        scale = pow2_ceil(x.view(64, 16, 32).abs().amax(-1) / 448).repeat_interleave(32, 1)
        bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    else:
        e4m3 = fmt == "fp4_e4m3"
        block = 16 if e4m3 else 32
        y = dequant_fp4_rows(quant_fp4_rows(x, e4m3_scales=e4m3), 512, e4m3_scales=e4m3)
        amax = x.view(64, -1, block).abs().amax(-1).repeat_interleave(block, 1)
        scale = amax / 6 * 1.0625 + 2.0**-10 if e4m3 else amax / 6 * 2.0
        bound = torch.maximum(scale / 4, x.abs() / 4) + (amax / 16 + 6 * 2.0**-10 if e4m3 else 0)
    assert ((y - x).abs() <= bound * (1 + 1e-6)).all()
    if fmt == "mxfp8":
        assert torch.equal(dequant_mxfp8_rows(quant_mxfp8_rows(y), 512), y)       # power-of-two scales:
    elif fmt == "fp4_ue8m0":                                                       # decoded rows are fixed points
        assert torch.equal(dequant_fp4_rows(quant_fp4_rows(y, e4m3_scales=False), 512, e4m3_scales=False), y)


def test_engram_primes_small_case_by_hand() -> None:
    primes = engram_primes(2, 3, 2, 50)          # primes above 49, in order, never reused
    assert primes == [[[53, 59], [61, 67]], [[71, 73], [79, 83]]]
    assert engram_offsets(primes) == [[0, 53, 112, 173], [0, 71, 144, 223]]
    assert [n for n in range(30) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]


def test_engram_primes_give_the_released_table_sizes() -> None:
    primes = engram_primes(2, 4, 8, 16_000_000)
    assert [sum(p for size in layer for p in size) for layer in primes] == [384006168, 384016682]
    flat = [p for layer in primes for size in layer for p in size]
    assert len(set(flat)) == 48 and min(flat) > 15_999_999


def test_engram_hash_by_hand() -> None:
    tokens = torch.tensor([[3, 5, 2]])              # c0 (the token), c1, c2
    multipliers = torch.tensor([[7, 11, 13]])
    primes = torch.tensor([[[5, 7], [11, 13]]])
    offsets = torch.tensor([[0, 5, 12, 23]])
    # r = 21; r ^= 55 → 34 → (34 % 5, 34 % 7) = (4, 6); r ^= 26 → 56 → (56 % 11, 56 % 13) = (1, 4)
    assert engram_hash(tokens, multipliers, primes, offsets).tolist() == [[[4, 11, 13, 27]]]


def test_engram_hash_is_exact_for_int64_products() -> None:
    big = torch.tensor([[99091, 99090]])
    m = torch.tensor([[(2**63 - 1) // 99092 // 2 * 2 - 1, 3]])
    want = ((99091 * m[0, 0].item()) ^ (99090 * 3)) % 1000003
    assert engram_hash(big, m, torch.tensor([[[1000003]]]), torch.tensor([[0]])).item() == want


def test_candidate_blocks_pin_the_newest_block_and_break_ties_low() -> None:
    inf = math.inf
    scores = torch.tensor([[5.0, 1, 1, 5, 0, 0, 9, -inf, -inf, -inf]])
    # blocks of 3: b0 = 5, b1 = 5 (tie: b0 wins), b2 holds the newest visible key 6 → pinned, b3 = −inf
    mask = candidate_blocks(scores, torch.tensor([7]), topk_blocks=2, block_size=3)
    assert mask.tolist() == [[True, True, True, False, False, False, True, True, True, False]]
    none_visible = candidate_blocks(torch.full((1, 4), -inf), torch.tensor([0]), topk_blocks=2, block_size=2)
    assert not none_visible.any()


def test_topk_finite_lowest_index_on_ties() -> None:
    scores = torch.tensor([[3.0, 7, 7, -math.inf, 1]])
    assert topk_finite(scores, 3).tolist() == [[1, 2, 0]]
    assert topk_finite(scores, 6).tolist() == [[1, 2, 0, 4, -1]]


def test_single_pass_mhc_pieces_match_v4_sites() -> None:
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(5, 2, 8, generator=gen)
    fn, base, scale = torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen), torch.rand(3, generator=gen)
    pre, post, comb = hc_mixes(h, fn, scale, base, sinkhorn_iters=4, hc_eps=1e-6, norm_eps=1e-6)
    collapsed, post4, comb4 = hc_pre(h, fn, scale, base, sinkhorn_iters=4, hc_eps=1e-6, norm_eps=1e-6)
    torch.testing.assert_close(hc_collapse(h, pre), collapsed)
    torch.testing.assert_close(post, post4)
    torch.testing.assert_close(comb, comb4)
    x = torch.randn(5, 8, generator=gen)
    torch.testing.assert_close(hc_expand(x, h, post, comb), hc_post(x, h, post, comb))
