"""The grouped expert GEMMs of prefill (`triton_ops.moe_grouped`) against their PyTorch twins.

Runs on a CUDA device (bfloat16, the V4-Flash shapes too); without one, under Triton's CPU interpreter
when TRITON_INTERPRET=1 (float32, tiny shapes, every load and store bounds-checked by `kernel_bounds`);
otherwise skipped. Twins: `reference.moe_experts` (bf16), `reference.moe.moe_experts_fp8_w8a8` (FP8
block-scaled weights, activations quantised per 1 × block group), `reference.moe_experts_mxfp4`.
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.reference.moe import moe_experts_fp8_w8a8, quant_fp8_groups

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 3e-2 if CUDA else 1e-4
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")]


@pytest.fixture(autouse=True)
def _checked(request):
    """Under the interpreter every test runs inside `kernel_bounds` (conftest.py)."""
    pytest.importorskip("triton")
    yield request.getfixturevalue("kernel_bounds") if INTERPRET else None


def poison_allocator() -> None:
    if CUDA:
        held = [torch.full((n,), float("nan"), device="cuda") for n in [1 << 16] * 16 + [1 << 24] * 4]
        del held


def case(seed: int, num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, *, skew: bool = False):
    """Tokens, routing (distinct experts per token; `skew`: half the pairs on expert 0's neighbours
    so some experts get several row tiles and others none) and float32 experts (w13, w2) on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, DTYPE)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skew:
        logits[:, : max(top_k, num_experts // 8)] += 3.0
    ids = logits.topk(top_k, dim=-1).indices.to(DEVICE)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(DEVICE)
    dgen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=dgen, device=DEVICE) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=dgen, device=DEVICE) * inter**-0.5
    return x, ids, weights, w13, w2


def quantised(w13: torch.Tensor, w2: torch.Tensor, quant) -> list[torch.Tensor]:
    """[w13, w13_scale, w2, w2_scale] through `quant` (a matrix → (q, scale)), expert by expert."""
    out = []
    for w in (w13, w2):
        q, s = zip(*(quant(w[e]) for e in range(w.shape[0])), strict=True)
        out += [torch.stack(q), torch.stack(s)]
    return [out[0], out[1], out[2], out[3]]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL, rtol=TOL)


def test_plan_tiles_cover_each_experts_rows_once() -> None:
    from deepinfer.kernels.triton_ops.moe_grouped import plan_tiles

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]], device=DEVICE)
    plan = plan_tiles(ids, num_experts=5, block_m=2)
    assert plan.order.tolist() == [1, 4, 3, 8, 7, 0, 2, 5, 6, 9]          # stable within each expert
    # expert 0: rows 0-1; 1: 2-3; 2: 4; 3: 5-6, 7-8, 9; expert 4 has none; then unused tiles
    assert plan.tiles.tolist() == [[0, 1, 2, 3, 3, 3, -1, -1, -1, -1],            # ceil(10 / 2) + min(5, 10)
                                   [0, 2, 4, 5, 7, 9, 0, 0, 0, 0],
                                   [2, 4, 5, 7, 9, 10, 0, 0, 0, 0]]
    assert plan.max_tiles == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_groups_matches_its_twin(dtype) -> None:
    """Bitwise. bfloat16 inputs (8 significant bits) put some values exactly halfway between two e4m3
    codes: they round to the even one, as torch and the GPU's conversion do."""
    from deepinfer.kernels.triton_ops.moe_grouped import quant_groups

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 96, generator=gen) * torch.logspace(-3, 2, 96)).to(DEVICE, dtype)
    x[2, :32] = 0.0                                                    # an all-zero group: scale 1
    x[3, 40] = 448.0 * 3                                               # a group's maximum exactly at ±448
    poison_allocator()
    q, s = quant_groups(x, 32)
    q_want, s_want = quant_fp8_groups(x, 32)
    assert torch.equal(s, s_want) and s[2, 0] == 1.0
    assert torch.equal(q.float(), q_want.float())


FORMATS = ["bf16", "fp8", "mxfp4"]
SMALL = [(40, 8, 3, 64, 64, False), (29, 8, 2, 128, 96, True)]      # tokens, experts, top_k, hidden, inter, skew


def run_format(fmt: str, x, ids, weights, w13, w2, *, block: int, tiles=None):
    """(the grouped kernels' output, the twin's) for one weight format."""
    from deepinfer.kernels.triton_ops import moe
    from deepinfer.kernels.triton_ops.moe_grouped import grouped_experts

    if fmt == "bf16":
        w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
        return (grouped_experts(x, ids, weights, w13, w2, 0.5, moe.PLAIN, w13, w2, 1, w2.shape[-1], tiles),
                reference.moe_experts(x, ids, weights, w13, w2, 0.5))
    if fmt == "fp8":
        args = quantised(w13, w2, lambda w: reference.quant_fp8_block(w, block))
        return (grouped_experts(x, ids, weights, args[0], args[2], 0.5, moe.FP8_BLOCK, args[1], args[3], block,
                                w2.shape[-1], tiles),
                moe_experts_fp8_w8a8(x, ids, weights, *args, 0.5, block))
    args = quantised(w13, w2, reference.quant_mxfp4)
    return (grouped_experts(x, ids, weights, args[0], args[2], 0.5, moe.MXFP4, args[1], args[3], 32, w2.shape[-1],
                            tiles),
            reference.moe_experts_mxfp4(x, ids, weights, *args, 0.5))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter", "skew"), SMALL)
@pytest.mark.parametrize("shape", ["shipped", "32 / 16 rows", "16 rows"])
def test_grouped_experts_match_their_twins(fmt, num_tokens, num_experts, top_k, hidden, inter, skew, shape,
                                           _checked) -> None:
    """The shipped tiles (here every tile takes the half-height path), 32-row tiles with 16-row
    halves (both paths take rows), 16-row tiles without halves."""
    from dataclasses import replace

    from deepinfer.kernels.triton_ops import moe
    from deepinfer.kernels.triton_ops.moe_grouped import ExpertTiles, expert_tiles, grouped_supported

    block = 32
    code = {"bf16": moe.PLAIN, "fp8": moe.FP8_BLOCK, "mxfp4": moe.MXFP4}[fmt]
    tiles = expert_tiles(code, hidden, inter, block)
    if shape != "shipped":
        rows, half = (32, True) if shape == "32 / 16 rows" else (16, False)
        tiles = ExpertTiles(replace(tiles.up, block_m=rows, half=half), replace(tiles.down, block_m=rows, half=half))
    assert grouped_supported(code, hidden, inter, block, tiles)
    x, ids, weights, w13, w2 = case(num_tokens + hidden, num_tokens, num_experts, top_k, hidden, inter, skew=skew)
    poison_allocator()
    got, want = run_format(fmt, x, ids, weights, w13, w2, block=block, tiles=tiles)
    close(got, want)
    if _checked is not None:
        _checked.assert_clean("_up_kernel", "_down_kernel", "_sum_slots_kernel")


@pytest.mark.parametrize("fmt", FORMATS)
def test_large_batches_take_the_grouped_kernels(fmt, monkeypatch) -> None:
    """The registered ops switch to the grouped kernels from GROUPED_MIN_PAIRS pairs: FP8 then
    quantises its activations (the w8a8 twin matches, the bf16-activation reference only roughly),
    bf16 and MXFP4 still match their reference."""
    from deepinfer.kernels.triton_ops import moe

    x, ids, weights, w13, w2 = case(5, 40, 8, 3, 64, 64)
    block = 32
    for grouped in (False, True):
        monkeypatch.setattr(moe, "GROUPED_MIN_PAIRS", 1 if grouped else ids.numel() + 1)
        monkeypatch.setattr(moe, "GROUPED_FP8", True)
        poison_allocator()
        if fmt == "bf16":
            w13c, w2c = w13.to(x.dtype), w2.to(x.dtype)
            close(moe.moe_experts_fused(x, ids, weights, w13c, w2c, 0.5),
                  reference.moe_experts(x, ids, weights, w13c, w2c, 0.5))
        elif fmt == "fp8":
            args = quantised(w13, w2, lambda w: reference.quant_fp8_block(w, block))
            got = moe.moe_experts_fp8_fused(x, ids, weights, *args, 0.5, block)
            plain = reference.moe_experts_fp8(x, ids, weights, *args, 0.5, block)
            if grouped:
                close(got, moe_experts_fp8_w8a8(x, ids, weights, *args, 0.5, block))
                assert (got.float() - plain.float()).norm() / plain.float().norm() < 0.1
            else:
                close(got, plain)
        else:
            args = quantised(w13, w2, reference.quant_mxfp4)
            close(moe.moe_experts_mxfp4_fused(x, ids, weights, *args, 0.5),
                  reference.moe_experts_mxfp4(x, ids, weights, *args, 0.5))


@pytest.mark.gpu_heavy
@pytest.mark.skipif(not CUDA, reason="the V4-Flash shapes need the GPU")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [512, 4096])
def test_grouped_experts_at_v4_flash_shapes(fmt, num_tokens, monkeypatch) -> None:
    """256 experts × 2048, hidden 4096, top-6 through the registered op (4096 tokens: ~96 rows an
    expert, full and half-height tiles; 512: ~12, half-height ones), against the twin."""
    from deepinfer.kernels.triton_ops import moe

    x, ids, weights, w13, w2 = case(num_tokens, num_tokens, 256, 6, 4096, 2048)
    assert ids.numel() >= moe.GROUPED_MIN_PAIRS
    monkeypatch.setattr(moe, "GROUPED_FP8", True)
    poison_allocator()
    if fmt == "bf16":
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        got, want = (moe.moe_experts_fused(x, ids, weights, w13, w2, 10.0),
                     reference.moe_experts(x, ids, weights, w13, w2, 10.0))
    elif fmt == "fp8":
        args = quantised(w13, w2, lambda w: reference.quant_fp8_block(w, 128))
        del w13, w2
        got, want = (moe.moe_experts_fp8_fused(x, ids, weights, *args, 10.0, 128),
                     moe_experts_fp8_w8a8(x, ids, weights, *args, 10.0, 128))
    else:
        args = quantised(w13, w2, reference.quant_mxfp4)
        del w13, w2
        got, want = (moe.moe_experts_mxfp4_fused(x, ids, weights, *args, 10.0),
                     reference.moe_experts_mxfp4(x, ids, weights, *args, 10.0))
    close(got, want)
    torch.cuda.empty_cache()
