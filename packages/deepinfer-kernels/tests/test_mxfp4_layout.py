"""`deepinfer.kernels.mxfp4_layout`: the `packed` decoder's code layout, its inverse, and the ops on it."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import packed_layout_wanted, reference, repack_mxfp4_for_decode, unpack_mxfp4_from_decode
from deepinfer.kernels.mxfp4_layout import SOURCE_BITS

_ROTATE = {0: (0,), 1: (4,), 2: (10,), 3: (6, 14)}      # the decoder's rotations per pair (module docstring)
_MASKS = {0: 0x81C081C0, 1: 0x81C081C0, 2: 0x81C081C0, 3: (0x80C080C0, 0x01000100)}


def _decoded(words: torch.Tensor, j: int) -> torch.Tensor:
    """Pair j's bf16 bits (uint32 as int64) of re-packed words (int64), by the decoder's rotations."""
    def rotl(w: torch.Tensor, k: int) -> torch.Tensor:
        return ((w << k) | (w >> (32 - k))) & 0xFFFFFFFF if k else w
    masks = _MASKS[j] if isinstance(_MASKS[j], tuple) else (_MASKS[j],)
    out = torch.zeros_like(words)
    for k, m in zip(_ROTATE[j], masks, strict=True):
        out |= rotl(words, k) & m
    return out


def test_every_word_bit_holds_one_code_bit() -> None:
    bits = [b for pair in SOURCE_BITS for half in pair for b in half]
    assert sorted(bits) == list(range(32))


def test_repack_and_unpack_are_inverse_at_any_leading_shape() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (3, 5, 48), generator=gen, dtype=torch.uint8)
    packed = repack_mxfp4_for_decode(codes)
    assert packed.shape == codes.shape and packed.dtype == torch.uint8
    assert not torch.equal(packed, codes)
    assert torch.equal(unpack_mxfp4_from_decode(packed), codes)
    assert torch.equal(repack_mxfp4_for_decode(codes.view(torch.int8)), packed)        # int8 storage alike


def test_word_c_decodes_to_lane_c_pairs_in_natural_order() -> None:
    """Word c of a group, rotated and masked as the decoder does, gives the bf16 bits of code × 2^-126
    of the column pairs c, c + 4, c + 8, c + 12: `reference.dequant_mxfp4` under scale byte 1 (2^-126)."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (7, 32), generator=gen, dtype=torch.uint8)           # 2 groups a row
    values = reference.dequant_mxfp4(codes, torch.ones(7, 2, dtype=torch.uint8))       # e · 2^-126, float32
    want = (values.view(torch.int32) >> 16).long() & 0xFFFF                            # exact in bf16
    words = repack_mxfp4_for_decode(codes).view(torch.int32).long() & 0xFFFFFFFF       # [7, 8]
    for g in range(2):
        for c in range(4):
            for j in range(4):
                bits = _decoded(words[:, 4 * g + c], j)
                col = 32 * g + 2 * (c + 4 * j)
                assert torch.equal(bits & 0xFFFF, want[:, col]) and torch.equal(bits >> 16, want[:, col + 1])


@pytest.mark.parametrize(("shape", "dtype", "match"), [((4, 24), torch.uint8, "multiple of 16"),
                                                       ((4, 32), torch.int32, "uint8 or int8")])
def test_bad_codes_are_refused(shape, dtype, match) -> None:
    with pytest.raises(ValueError, match=match):
        repack_mxfp4_for_decode(torch.zeros(shape, dtype=dtype))
    with pytest.raises(ValueError, match=match):
        unpack_mxfp4_from_decode(torch.zeros(shape, dtype=dtype))


def test_the_reference_op_reads_packed_codes() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=gen)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    weights = torch.rand(3, 2, generator=gen)
    q13 = [reference.quant_mxfp4(torch.randn(64, 64, generator=gen) / 8) for _ in range(3)]
    q2 = [reference.quant_mxfp4(torch.randn(64, 32, generator=gen) / 8) for _ in range(3)]
    w13, s13, w2, s2 = (torch.stack([q[i] for q in qs]) for qs in (q13, q2) for i in (0, 1))
    want = reference.moe_experts_mxfp4(x, ids, weights, w13, s13, w2, s2, 7.0)
    got = reference.moe_experts_mxfp4(x, ids, weights, repack_mxfp4_for_decode(w13), s13,
                                      repack_mxfp4_for_decode(w2), s2, 7.0, packed=True)
    assert torch.equal(got, want)


def test_only_cuda_wants_the_packed_layout(monkeypatch) -> None:
    pytest.importorskip("triton")
    from deepinfer.kernels.triton_ops import moe

    monkeypatch.setattr(moe, "MXFP4_REPACK", True)
    assert packed_layout_wanted("cuda") and not packed_layout_wanted("cpu")
    monkeypatch.setattr(moe, "MXFP4_REPACK", False)
    assert not packed_layout_wanted("cuda")


def test_the_packed_decoder_is_refused_as_the_decoder_of_codes_as_stored(monkeypatch) -> None:
    pytest.importorskip("triton")
    from deepinfer.kernels.triton_ops import moe, mxfp4

    monkeypatch.setattr(moe, "MXFP4_DECODE", mxfp4.MX_PACKED)
    codes = torch.zeros(2, 64, 16, dtype=torch.uint8)
    scales = torch.zeros(2, 64, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="MXFP4_DECODE"):
        moe._experts(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), codes, codes, 1.0,
                     moe.MXFP4, scales, scales, 32, 64)
