"""The grouped expert GEMMs of prefill (`triton_ops.moe_grouped`) against their PyTorch twins.

Runs on a CUDA device (bfloat16, the V4-Flash shapes too); without one, under Triton's CPU interpreter
when TRITON_INTERPRET=1 (float32, tiny shapes, every load and store bounds-checked by `kernel_bounds`);
otherwise skipped. Twins: `reference.moe_experts` (bf16), `reference.moe.moe_experts_fp8_w8a8` (FP8
block-scaled weights, activations quantised per 1 × block group; checked stage by stage, see
`fp8_stages`), `reference.moe_experts_mxfp4`.
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.kernels import reference, repack_mxfp4_for_decode
from deepinfer.kernels.reference.moe import down_fp8_w8a8, quant_fp8_groups, swiglu_fp8_w8a8

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


# Of a group's absolute maximum: how far the kernel's SwiGLU output may lie beyond half an e4m3 step
# from the twin's, and its group scales from the twin's (relative). The two differ by the order of the
# float32 additions (per K block partial products scaled into the accumulator, against one product
# over the dequantised operands) and, on Hopper, by the FP8 tensor cores' e8m13 accumulator. At
# V4-Flash's K (hidden 4096), emulated in float64 on CPU: float32 order alone 2.5e-8 beyond half a step
# and 1.2e-6 on scales; the e8m13 accumulator (the sum truncated after each 32-input step, or every
# addend first cut to the largest one's grid) up to 3.1e-4 and 4.9e-4. 2^-8 leaves ~8×; an indexing
# bug moves values by far more, and a scale 1% off fails.
FP8_ACT_SLACK = 2.0**-8


def check_fp8_act(codes: torch.Tensor, scales: torch.Tensor, want: torch.Tensor, block: int) -> None:
    """The kernel's quantised SwiGLU output (`codes` [pairs, inter] as float, `scales` [pairs, inter /
    block]) is the twin's float32 one (`want`) quantised: each group's scale within FP8_ACT_SLACK of
    the twin's, each value within half the e4m3 spacing at the twin's value plus FP8_ACT_SLACK of the
    group maximum (a value near a rounding boundary may take either neighbouring code)."""
    rows, cols = want.shape
    groups = want.reshape(rows, cols // block, block)
    amax = groups.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    bad = ~((scales - scale).abs() <= FP8_ACT_SLACK * scale)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} group scales off, first at (pair, group) "
                           f"{bad.nonzero()[0].tolist()}: {scales[bad][0]} != {scale[bad][0]}")
    exponent = torch.frexp((groups.abs() / scale[..., None]).clamp(min=2.0**-6))[1] - 1
    half_step = torch.ldexp(torch.full_like(groups, 2.0**-4), exponent) * scale[..., None]
    err = (codes.reshape(groups.shape) * scales[..., None] - groups).abs()
    bad = ~(err <= half_step + FP8_ACT_SLACK * amax[..., None])
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} activations off by more than half an e4m3 step, "
                           f"first at (pair, group, column) {bad.nonzero()[0].tolist()}")


def fp8_stages(x, ids, weights, args, limit: float, block: int, tiles=None) -> torch.Tensor:
    """The FP8 grouped kernels run as `grouped_experts` does, each stage checked against the twin's
    stage fed the same input (the kernel's own); returns the output.

    Why not the output against the twin's (`moe_experts_fp8_w8a8`) elementwise, as before: both
    quantise the SwiGLU output to e4m3 again, from float32 values that differ by accumulation order,
    so a value near a rounding boundary takes the neighbouring code in one and not the other (one
    e4m3 step, up to 1/8 of the value, then spread over a whole output row by w2). At V4-Flash shapes
    (512 tokens, hidden 4096, width 2048, limit 10), emulated in torch: float64 instead of float32
    accumulation, or the kernel's per-128-input float32 blocks, flip 3.7e-5 of the codes and the worst
    output element takes 0.25 of atol + rtol·|want| at atol = rtol = 3e-2; with Hopper's e8m13 FP8
    accumulator (the sum truncated after each 32-input step) 6.6e-3 flip and the worst takes 0.79;
    cutting every addend to the largest one's grid first, 1.2e-2 flip and on the first 128 tokens the
    worst goes from 0.58 to 0.69. 4096 tokens have 8× the elements: no margin. Stage by stage no flip
    carries over:
    - x's quantiser: bitwise the twin's;
    - the up kernel: `check_fp8_act` against `swiglu_fp8_w8a8` (half an e4m3 step + FP8_ACT_SLACK);
    - the down kernel, fed the kernel's own quantised activations: `down_fp8_w8a8` on the same values,
      and the slot sums, to TOL (float32 accumulation order and the rounding to x's dtype only).
    An indexing bug (a wrong row, scale or group) moves values by far more than half a step, or a
    group's scale by far more than FP8_ACT_SLACK (`test_fp8_stage_check_catches_indexing_bugs`).
    """
    from deepinfer.kernels.triton_ops import moe
    from deepinfer.kernels.triton_ops import moe_grouped as mg

    w13, s13, w2, s2 = args
    num_tokens, top_k = ids.shape
    hidden, inter = x.shape[1], w2.shape[-1]
    tiles = tiles or mg.expert_tiles(moe.FP8_BLOCK, hidden, inter, block)
    up_plan, down_plan = mg.plans(ids, w13.shape[0], tiles)
    xq, xs = mg.quant_groups(x, block)
    xq_want, xs_want = quant_fp8_groups(x, block)
    assert torch.equal(xs, xs_want) and torch.equal(xq.float(), xq_want.float())
    act, acts = mg.run_up(xq, xs, up_plan, mg.Weights(w13, s13, moe.FP8_BLOCK, block), top_k, limit, inter, tiles.up)
    codes, scales = torch.empty(act.shape, device=x.device), torch.empty(acts.shape, device=x.device)
    codes[up_plan.order], scales[up_plan.order] = act.float(), acts          # pair order (kernel: sorted rows)
    check_fp8_act(codes, scales, swiglu_fp8_w8a8(x, ids, w13, s13, limit, block), block)
    flat_weights = weights.reshape(-1).float().contiguous()
    y = mg.run_down(act, acts, down_plan, flat_weights, mg.Weights(w2, s2, moe.FP8_BLOCK, block), hidden, x.dtype,
                    tiles.down)
    deq = (codes.reshape(-1, inter // block, block) * scales[..., None]).reshape(-1, inter)
    y_want = down_fp8_w8a8(deq, ids, weights, w2, s2, block, x.dtype)
    close(y, y_want)
    out = mg.sum_slots(y, num_tokens, top_k, x.dtype)
    out_want = torch.zeros(num_tokens, hidden, device=x.device)
    for k in range(top_k):
        out_want += y_want.view(num_tokens, top_k, hidden)[:, k].float()
    close(out, out_want.to(x.dtype))
    return out


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
    codes: they round to the even one, as torch and the GPU's conversion do. Both scales are the
    correctly rounded amax / 448 (float64 division rounded once to float32: exact for float32
    operands), not amax times 1/448's float32 reciprocal, which torch computes for `cuda_tensor / 448`
    and which differs by an ulp in about half the groups (the GPU failure of issue #29)."""
    from deepinfer.kernels.triton_ops.moe_grouped import quant_groups

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 96, generator=gen) * torch.logspace(-3, 2, 96)).to(DEVICE, dtype)
    x[2, :32] = 0.0                                                    # an all-zero group: scale 1
    x[3, 40] = 448.0 * 3                                               # a group's maximum exactly at ±448
    poison_allocator()
    q, s = quant_groups(x, 32)
    q_want, s_want = quant_fp8_groups(x, 32)
    amax = x.float().reshape(7, 3, 32).abs().amax(-1).double()
    assert torch.equal(s_want, torch.where(amax > 0, amax / 448.0, 1.0).float())
    assert torch.equal(s, s_want) and s[2, 0] == 1.0
    assert torch.equal(q.float(), q_want.float())


FORMATS = ["bf16", "fp8", "mxfp4", "mxfp4-packed"]          # mxfp4-packed: codes re-packed (`mxfp4_layout`)
SMALL = [(40, 8, 3, 64, 64, False), (29, 8, 2, 128, 96, True)]      # tokens, experts, top_k, hidden, inter, skew


def run_format(fmt: str, x, ids, weights, w13, w2, *, block: int, tiles=None):
    """(the grouped kernels' output, the twin's) for one weight format; FP8's "twin" is the stage by
    stage run, each stage checked against the twin's (`fp8_stages`)."""
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
                fp8_stages(x, ids, weights, args, 0.5, block, tiles))
    args = quantised(w13, w2, reference.quant_mxfp4)
    w13q, w2q, code = args[0], args[2], moe.MXFP4
    if fmt == "mxfp4-packed":
        w13q, w2q, code = repack_mxfp4_for_decode(w13q), repack_mxfp4_for_decode(w2q), moe.MXFP4_PACKED
    return (grouped_experts(x, ids, weights, w13q, w2q, 0.5, code, args[1], args[3], 32, w2.shape[-1], tiles),
            reference.moe_experts_mxfp4(x, ids, weights, *args, 0.5))


def mxfp4_op(op, fmt: str):
    """The MXFP4 experts op `op` on checkpoint-layout arguments; "mxfp4-packed": on codes re-packed
    here (`packed=True`)."""
    if fmt != "mxfp4-packed":
        return op
    return lambda x, ids, weights, w13, s13, w2, s2, limit: op(x, ids, weights, repack_mxfp4_for_decode(w13), s13,
                                                               repack_mxfp4_for_decode(w2), s2, limit, packed=True)


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

    if fmt == "mxfp4-packed" and shape != "shipped":
        pytest.skip("the mxfp4 cases cover the tile shapes: re-packed codes change the decode alone")
    block = 32
    code = {"bf16": moe.PLAIN, "fp8": moe.FP8_BLOCK, "mxfp4": moe.MXFP4, "mxfp4-packed": moe.MXFP4_PACKED}[fmt]
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


FP8_BUGS = ["none", "x scales of the next K block", "w13 scales of the next K block", "act scales of the row before in "
            "each expert's last row", "act scales 1% high", "down reads the next K block's act scales",
            "each expert's last tile a row short"]


@pytest.mark.parametrize("bug", FP8_BUGS)
def test_fp8_stage_check_catches_indexing_bugs(bug, monkeypatch) -> None:
    """`fp8_stages` is tight, not only sound: each bug, put in at a stage boundary as a kernel with
    that indexing error would compute it, makes it fail (down to "act scales 1% high", about 1% of
    the output: mostly within the old elementwise atol = rtol = 3e-2); without one it passes."""
    from dataclasses import replace

    from deepinfer.kernels.triton_ops import moe_grouped as mg

    x, ids, weights, w13, w2 = case(11, 40, 8, 3, 128, 64, skew=True)
    block = 32
    args = quantised(w13, w2, lambda w: reference.quant_fp8_block(w, block))
    run_up, run_down, plans = mg.run_up, mg.run_down, mg.plans
    ends = torch.cumsum(torch.bincount(ids.reshape(-1), minlength=8), 0)

    def up(x, xs, plan, w13, *rest):
        if bug == "x scales of the next K block":
            xs = xs.roll(-1, 1).contiguous()
        if bug == "w13 scales of the next K block":
            w13 = replace(w13, scale=w13.scale.roll(-1, 2).contiguous())
        act, acts = run_up(x, xs, plan, w13, *rest)
        if bug == "act scales 1% high":
            acts = acts * 1.01
        if bug.startswith("act scales of the row before"):
            last = ends[ends > 1] - 1
            acts = acts.index_copy(0, last, acts[last - 1])
        return act, acts

    def down(act, acts, *rest):
        return run_down(act, acts.roll(-1, 1).contiguous() if bug.startswith("down") else acts, *rest)

    def short(plan):
        expert, first, end = plan.tiles.long()
        last = (expert >= 0) & (end == ends[expert.clamp(min=0)]) & (end - first >= 2)
        return replace(plan, tiles=torch.stack((expert, first, end - last.long())).int())

    monkeypatch.setattr(mg, "run_up", up)
    monkeypatch.setattr(mg, "run_down", down)
    if bug == "each expert's last tile a row short":
        monkeypatch.setattr(mg, "plans", lambda *a: tuple(map(short, plans(*a))))
    if bug == "none":
        fp8_stages(x, ids, weights, args, 10.0, block)          # limit 0.5 would clamp many groups alike
        return
    with pytest.raises(AssertionError, match="off by more than|group scales off|not close"):
        fp8_stages(x, ids, weights, args, 10.0, block)


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
                assert torch.equal(got, fp8_stages(x, ids, weights, args, 0.5, block))
                assert (got.float() - plain.float()).norm() / plain.float().norm() < 0.1
            else:
                close(got, plain)
        else:
            args = quantised(w13, w2, reference.quant_mxfp4)
            close(mxfp4_op(moe.moe_experts_mxfp4_fused, fmt)(x, ids, weights, *args, 0.5),
                  reference.moe_experts_mxfp4(x, ids, weights, *args, 0.5))


@pytest.mark.gpu_heavy
@pytest.mark.skipif(not CUDA, reason="the V4-Flash shapes need the GPU")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [512, 4096])
def test_grouped_experts_at_v4_flash_shapes(fmt, num_tokens, monkeypatch) -> None:
    """256 experts × 2048, hidden 4096, top-6 through the registered op (4096 tokens: ~96 rows an
    expert, full and half-height tiles; 512: ~12, half-height ones), against the twin (FP8: stage by
    stage, `fp8_stages`; its output elementwise against the twin's is no sound check)."""
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
                     fp8_stages(x, ids, weights, args, 10.0, 128))
    else:
        args = quantised(w13, w2, reference.quant_mxfp4)
        del w13, w2
        got, want = (mxfp4_op(moe.moe_experts_mxfp4_fused, fmt)(x, ids, weights, *args, 10.0),
                     reference.moe_experts_mxfp4(x, ids, weights, *args, 10.0))
    close(got, want)
    torch.cuda.empty_cache()
