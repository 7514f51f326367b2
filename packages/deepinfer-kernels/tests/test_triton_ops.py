"""Triton kernels against their reference twins, on fresh random inputs at several shapes.

Runs on a CUDA device; without one, under Triton's CPU interpreter when TRITON_INTERPRET=1 (float32
only, small shapes); otherwise skipped. Outputs are poisoned first: the caching allocator is filled
with NaN before each call, and cache tensors the kernels write in place start as NaN wherever the
reference does not write, so a kernel that skips or strays from an element fails.
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.kernels import reference

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")]
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]
BIG = CUDA                      # the real V4-Flash shapes only on the GPU (the interpreter is slow)


def flash_experts(*case) -> pytest.param:
    """A case with all 256 V4-Flash routed experts: its weights and the reference's dequantised copies
    take up to ~34 GB, so it is `gpu_heavy` (tools/gpu_tests.sh runs those one at a time, after the
    concurrent shards)."""
    return pytest.param(*case, marks=pytest.mark.gpu_heavy)


@pytest.fixture(autouse=True)
def _free_after_heavy_cases(request):
    """A `gpu_heavy` case hands its cached memory back when it ends (the next heavy case needs it)."""
    yield
    if CUDA and request.node.get_closest_marker("gpu_heavy") is not None:
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _triton():
    pytest.importorskip("triton")


def poison_allocator() -> None:
    """Leave NaN in the memory the next allocations will reuse (both of the allocator's pools)."""
    if CUDA:
        held = [torch.full((n,), float("nan"), device="cuda") for n in [1 << 16] * 16 + [1 << 24] * 4]
        del held


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def device_randn(seed: int, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Random weights drawn on DEVICE itself (drawing the V4-Flash experts on the host and copying
    them took minutes per GPU test)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and not torch.isnan(got).any()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("num_tokens", "hc", "dim", "iters"),
                         [(1, 4, 64, 20), (7, 2, 48, 3), (33, 4, 96, 1)] + ([(300, 4, 4096, 20)] if BIG else []))
def test_fused_hc_pre_matches_reference(num_tokens, hc, dim, iters) -> None:
    from deepinfer.kernels.triton_ops import hc_pre_fused

    gen = torch.Generator().manual_seed(num_tokens + hc)
    dtype = torch.bfloat16 if CUDA else torch.float32
    streams = randn(gen, num_tokens, hc, dim, dtype=dtype)
    fn, scale = randn(gen, (2 + hc) * hc, hc * dim, scale=0.2), 1 + randn(gen, 3, scale=0.3)
    base = randn(gen, (2 + hc) * hc)
    kwargs = dict(sinkhorn_iters=iters, hc_eps=1e-6, norm_eps=1e-6)
    poison_allocator()
    got = hc_pre_fused(streams, fn, scale, base, **kwargs)
    want = reference.hc_pre(streams, fn, scale, base, **kwargs)
    for g, w in zip(got, want):
        close(g, w, torch.bfloat16 if g.dtype == torch.bfloat16 else torch.float32)


POST_CASES = [(1, 4, 64), (5, 2, 100), (3, 4, 700)] + ([(64, 4, 4096)] if BIG else [])


@pytest.mark.parametrize(("num_tokens", "hc", "dim"), POST_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_hc_post_matches_reference(num_tokens, hc, dim, dtype) -> None:
    from deepinfer.kernels.triton_ops import hc_post_fused

    gen = torch.Generator().manual_seed(num_tokens * dim)
    x, res = randn(gen, num_tokens, dim, dtype=dtype), randn(gen, num_tokens, hc, dim, dtype=dtype)
    post, comb = randn(gen, num_tokens, hc).sigmoid() * 2, randn(gen, num_tokens, hc, hc).softmax(-1)
    poison_allocator()
    close(hc_post_fused(x, res, post, comb), reference.hc_post(x, res, post, comb), dtype)


NORM_CASES = [((1, 64), True, torch.bfloat16), ((37, 4, 512), False, torch.bfloat16),
              ((5, 16384), False, torch.float32), ((9, 1024), True, torch.float32)]


@pytest.mark.parametrize(("shape", "weighted", "dtype"), [c for c in NORM_CASES if c[2] in DTYPES])
def test_fused_rms_norm_matches_reference(shape, weighted, dtype) -> None:
    from deepinfer.kernels.triton_ops import rms_norm_fused

    gen = torch.Generator().manual_seed(shape[0])
    x = randn(gen, *shape, dtype=dtype, scale=3)
    w = 1 + randn(gen, shape[-1], scale=0.1) if weighted else None
    poison_allocator()
    got = rms_norm_fused(x, w, 1e-6)
    close(got, reference.rms_norm(x, w, 1e-6), torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)


@pytest.mark.parametrize(("shape", "rope_dim", "inverse"), [((3, 512), 64, False), ((6, 8, 512), 64, True),
                                                            ((11, 4, 128), 64, False), ((2, 16), 16, True)])
def test_fused_rope_matches_reference(shape, rope_dim, inverse) -> None:
    from deepinfer.kernels.triton_ops import apply_rope_fused

    gen = torch.Generator().manual_seed(shape[-1])
    dtype = DTYPES[0]
    x = randn(gen, *shape, dtype=dtype)
    pos = torch.randint(0, 100000, (shape[0],), generator=gen).to(DEVICE)
    inv = reference.rope_inv_freq(rope_dim, 160000.0, reference.YarnScaling(16.0, 65536)).to(DEVICE)
    poison_allocator()
    got = apply_rope_fused(x, pos, inv, inverse=inverse)
    assert torch.equal(got[..., :-rope_dim], x[..., :-rope_dim])
    close(got, reference.apply_rope(x, pos, inv, inverse=inverse), dtype)


@pytest.mark.parametrize(("tokens", "heads", "dim", "weighted"), [(3, 1, 512, True), (5, 8, 512, False),
                                                                  (2, 4, 128, True)])
def test_fused_norm_rope_reads_column_slices_in_place(tokens, heads, dim, weighted) -> None:
    """RMSNorm + RoPE in one kernel, and each of them alone, on a column slice of a wider tensor (a
    stacked projection's output), against the reference composition."""
    from deepinfer.kernels.triton_ops import apply_rope_fused, norm_rope_fused, rms_norm_fused

    gen = torch.Generator().manual_seed(tokens * heads)
    dtype = DTYPES[0]
    wide = randn(gen, tokens, 3 * heads * dim + 16, dtype=dtype, scale=3)
    x = wide[:, 16:16 + heads * dim].view(tokens, heads, dim) if heads > 1 else wide[:, 16:16 + dim]
    w = 1 + randn(gen, dim, scale=0.1) if weighted else None
    pos = torch.randint(0, 100000, (tokens,), generator=gen).to(DEVICE)
    inv = reference.rope_inv_freq(64, 10000.0).to(DEVICE)
    poison_allocator()
    close(norm_rope_fused(x, w, 1e-6, pos, inv), reference.norm_rope(x, w, 1e-6, pos, inv), dtype)
    close(rms_norm_fused(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype)
    close(apply_rope_fused(x, pos, inv), reference.apply_rope(x, pos, inv), dtype)


def _tables(gen: torch.Generator, num_seqs: int, max_blocks: int) -> torch.Tensor:
    """Disjoint random block ids ≥ 1 per sequence (block 0 is the reserved dummy)."""
    ids = torch.randperm(num_seqs * max_blocks, generator=gen) + 1
    return ids.view(num_seqs, max_blocks).to(DEVICE)


COMPRESS_CASES = [  # (num_seqs, ratio, overlap, width, block_size)
    (5, 4, True, 64, 16), (6, 8, False, 32, 64), (3, 4, True, 48, 8)] + (
    [(32, 4, True, 512, 128), (8, 128, False, 512, 128), (16, 4, True, 128, 128)] if BIG
    else [(2, 128, False, 16, 128)])


@pytest.mark.parametrize(("num_seqs", "ratio", "overlap", "width", "block_size"), COMPRESS_CASES)
def test_fused_compress_decode_matches_reference(num_seqs, ratio, overlap, width, block_size) -> None:
    from deepinfer.kernels.triton_ops import compress_decode_fused

    gen = torch.Generator().manual_seed(num_seqs * ratio + width)
    mult, max_blocks = (2 if overlap else 1), 6
    ring = mult * ratio + 3                                                  # with backtracking room
    num_slots, num_blocks = num_seqs + 2, num_seqs * max_blocks + 1
    slots = (torch.randperm(num_slots - 1, generator=gen)[:num_seqs] + 1).to(DEVICE)
    # Half the sequences close a window with this token; a few sit in the first window.
    entries = torch.randint(0, max_blocks * block_size // ratio, (num_seqs,), generator=gen)
    entries[: num_seqs // 3] = 0
    offset = torch.randint(0, ratio, (num_seqs,), generator=gen)
    offset[::2] = ratio - 1
    positions = (entries * ratio + offset).to(DEVICE)
    tables = _tables(gen, num_seqs, max_blocks)
    kv, gate = randn(gen, num_seqs, mult * width, dtype=torch.bfloat16), randn(gen, num_seqs, mult * width)
    ape, norm_w = randn(gen, ratio, mult * width, scale=0.5), 1 + randn(gen, width, scale=0.1)
    inv = reference.rope_inv_freq(min(width, 64), 160000.0).to(DEVICE)
    ring_kv, ring_gate = randn(gen, num_slots, ring, mult * width), randn(gen, num_slots, ring, mult * width)
    paged = torch.full((num_blocks, block_size // ratio, width), float("nan"), device=DEVICE)
    state = [t.clone() for t in (ring_kv, ring_gate, paged)]
    poison_allocator()
    got = compress_decode_fused(kv, gate, ape, positions, slots, ring_kv, ring_gate, norm_w, inv, 1e-6,
                                overlap=overlap, paged=paged, block_tables=tables)
    want = reference.compress_decode(kv, gate, ape, positions, slots, *state[:2], norm_w, inv, 1e-6,
                                     overlap=overlap, paged=state[2], block_tables=tables)
    done = (positions + 1) % ratio == 0
    close(got[done], want[done], torch.float32)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(ring_kv, state[0], rtol=0, atol=0)
    torch.testing.assert_close(ring_gate, state[1], rtol=0, atol=0)
    # Every paged row but the reserved block 0 matches, NaN (never written) included.
    torch.testing.assert_close(paged[1:], state[2][1:], atol=1e-4, rtol=1e-4, equal_nan=True)
    assert (~torch.isnan(paged[1:]).all(-1)).sum() == done.sum()


ATTENTION_CASES = [  # (num_seqs, heads, head_dim, window, ratio, num_ids, block_size)
    (3, 4, 64, 16, 4, 20, 16), (4, 16, 32, 8, 0, 0, 16), (2, 8, 48, 24, 128, 5, 128), (5, 20, 64, 16, 4, 40, 32)] + (
    [(8, 64, 512, 128, 4, 512, 128), (32, 64, 512, 128, 128, 8, 128), (1, 64, 512, 128, 0, 0, 128),
     (20, 20, 64, 16, 4, 40, 32), (130, 20, 48, 24, 128, 5, 128), (130, 64, 512, 128, 4, 512, 128)] if BIG else [])
# (the GPU's bfloat16 tiles grow with the batch: 16, 32 and 64 heads per program at 1-15, 16-127, 128+ sequences)


@pytest.mark.parametrize(("num_seqs", "heads", "head_dim", "window", "ratio", "num_ids", "block_size"),
                         ATTENTION_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_paged_decode_attention_matches_reference(num_seqs, heads, head_dim, window, ratio, num_ids,
                                                         block_size, dtype) -> None:
    from deepinfer.kernels.triton_ops import paged_decode_attention_fused

    gen = torch.Generator().manual_seed(num_seqs * heads + head_dim + ratio)
    ring_len, max_blocks = window + 2, 4
    q = randn(gen, num_seqs, heads, head_dim, dtype=dtype)
    ring = randn(gen, num_seqs + 1, ring_len, head_dim, dtype=dtype)
    slots = (torch.randperm(num_seqs, generator=gen) + 1).to(DEVICE)
    positions = torch.randint(0, 3 * window, (num_seqs,), generator=gen).to(DEVICE)   # some windows not yet full
    sink = randn(gen, heads, scale=2.0)
    args = {}
    if ratio:
        rows = block_size // ratio
        paged = randn(gen, num_seqs * max_blocks + 1, rows, head_dim, dtype=dtype)
        paged[0] = float("nan")                                   # never read: entries past the table are skipped
        ids = torch.randint(0, (max_blocks + 1) * rows, (num_seqs, num_ids), generator=gen)   # some past the table
        ids[torch.rand(num_seqs, num_ids, generator=gen) < 0.3] = -1
        args = dict(paged=paged, block_tables=_tables(gen, num_seqs, max_blocks), entry_ids=ids.to(DEVICE),
                    ratio=ratio)
    poison_allocator()
    got = paged_decode_attention_fused(q, ring, slots, positions, window, sink, head_dim**-0.5, **args)
    if ratio:
        args["paged"] = args["paged"].nan_to_num()              # the reference multiplies masked rows by 0
    want = reference.paged_decode_attention(q, ring, slots, positions, window, sink, head_dim**-0.5, **args)
    close(got, want, dtype)


INDEX_CASES = [(3, 4, 32, 4, 16, 37), (2, 16, 64, 4, 64, 20), (4, 20, 48, 8, 32, 9)] + (
    [(8, 64, 128, 4, 128, 256), (64, 64, 128, 4, 128, 1024)] if BIG else [])


@pytest.mark.parametrize(("num_seqs", "heads", "dim", "ratio", "block_size", "num_entries"), INDEX_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_paged_indexer_scores_matches_reference(num_seqs, heads, dim, ratio, block_size, num_entries,
                                                      dtype) -> None:
    from deepinfer.kernels.triton_ops import paged_indexer_scores_fused

    gen = torch.Generator().manual_seed(num_seqs * heads + num_entries)
    max_blocks = max(1, num_entries * ratio // block_size - 1)            # the last entries fall past the table
    q = randn(gen, num_seqs, heads, dim, dtype=dtype)
    keys = randn(gen, num_seqs * max_blocks + 1, block_size // ratio, dim, dtype=dtype)
    weights = randn(gen, num_seqs, heads) * heads**-0.5
    tables = _tables(gen, num_seqs, max_blocks)
    poison_allocator()
    got = paged_indexer_scores_fused(q, keys, tables, num_entries, weights, dim**-0.5, ratio)
    want = reference.paged_indexer_scores(q, keys, tables, num_entries, weights, dim**-0.5, ratio)
    close(got, want, torch.float32 if dtype == torch.float32 else torch.bfloat16)


ROUTE_CASES = [(5, 16, 4, "sqrtsoftplus", True), (3, 64, 6, "sigmoid", False), (4, 20, 3, "softmax", True)] + (
    [(256, 256, 6, "sqrtsoftplus", True)] if BIG else [])


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "scoring", "normalize"), ROUTE_CASES)
def test_fused_route_matches_reference(num_tokens, num_experts, top_k, scoring, normalize) -> None:
    from deepinfer.kernels.triton_ops import route_fused

    gen = torch.Generator().manual_seed(num_tokens * num_experts)
    logits = randn(gen, num_tokens, num_experts, scale=4.0)
    logits[0, :4] = 30.0                                     # ties (and softplus' linear branch)
    logits[-1, -3:] = -40.0
    bias = (torch.randint(0, 3, (num_experts,), generator=gen).float() * 0.5).to(DEVICE)   # more ties
    kwargs = dict(scoring_func=scoring, normalize=normalize, scaling=1.5)
    poison_allocator()
    ids, weights = route_fused(logits, bias, top_k, **kwargs)
    want_ids, want_weights = reference.route(logits, bias, top_k, **kwargs)
    assert torch.equal(ids, want_ids)
    close(weights, want_weights, torch.float32)


@pytest.mark.parametrize(("num_rows", "num_keys", "k"), [(4, 37, 8), (3, 300, 512), (2, 1000, 64)] + (
    [(64, 4096, 512), (8, 8192, 2048)] if BIG else []))
def test_fused_topk_matches_reference(num_rows, num_keys, k) -> None:
    from deepinfer.kernels.triton_ops import topk_lowest_index_fused

    gen = torch.Generator().manual_seed(num_rows * num_keys + k)
    scores = torch.randint(-3, 4, (num_rows, num_keys), generator=gen).float() * 0.25     # many ties
    scores[0, ::3] = -0.0
    scores = scores.to(DEVICE)
    visible = torch.randint(0, num_keys + 1, (num_rows,), generator=gen)
    visible[0] = num_keys
    poison_allocator()
    got = topk_lowest_index_fused(scores, visible.to(DEVICE), k)
    assert torch.equal(got, reference.topk_lowest_index(scores, visible.to(DEVICE), k))


MOE_CASES = [(1, 8, 2, 64, 32), (5, 16, 4, 96, 48), (40, 8, 3, 64, 64)] + (
    [flash_experts(1, 256, 6, 4096, 2048), flash_experts(32, 256, 6, 4096, 2048)] if BIG else [])


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter"), MOE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_experts_matches_reference(num_tokens, num_experts, top_k, hidden, inter, dtype) -> None:
    from deepinfer.kernels.triton_ops import clamped_swiglu_fused, moe_experts_fused

    gen = torch.Generator().manual_seed(num_tokens * num_experts + hidden)
    x = randn(gen, num_tokens, hidden, dtype=dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(DEVICE)
    weights = randn(gen, num_tokens, top_k).abs()
    w13 = device_randn(hidden, num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = device_randn(inter, num_experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    poison_allocator()
    got = moe_experts_fused(x, ids, weights, w13, w2, 0.5)
    close(got, reference.moe_experts(x, ids, weights, w13, w2, 0.5), dtype)
    w1, w3, w2s = w13[0, :inter], w13[0, inter:], w2[0]          # w3's rows follow w1's: one GEMV
    poison_allocator()
    close(clamped_swiglu_fused(x, w1, w3, w2s, 0.5), reference.clamped_swiglu(x, w1, w3, w2s, 0.5), dtype)
    w1, w3 = w1.clone(), w3.clone()                              # apart: two
    poison_allocator()
    close(clamped_swiglu_fused(x, w1, w3, w2s, 0.5), reference.clamped_swiglu(x, w1, w3, w2s, 0.5), dtype)


def _quantised_experts(gen, num_tokens, num_experts, top_k, hidden, inter, dtype, quant):
    """Tokens, their routing and `num_experts` random experts (drawn on DEVICE) through `quant`
    (weight → (q, scale)): (x, ids, weights, [w13, w13_scale, w2, w2_scale])."""
    x = randn(gen, num_tokens, hidden, dtype=dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(DEVICE)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(DEVICE)
    w13, s13 = zip(*(quant(device_randn(2 * e, 2 * inter, hidden, scale=hidden**-0.5)) for e in range(num_experts)),
                   strict=True)
    w2, s2 = zip(*(quant(device_randn(2 * e + 1, hidden, inter, scale=inter**-0.5)) for e in range(num_experts)),
                 strict=True)
    return x, ids, weights, [torch.stack(t) for t in (w13, s13, w2, s2)]


FP8_MOE_CASES = [(3, 8, 2, 64, 64, 32), (40, 8, 3, 64, 96, 32)] + (
    [flash_experts(1, 256, 6, 4096, 2048, 128), flash_experts(32, 256, 6, 4096, 2048, 128)] if BIG else [])


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter", "block"), FP8_MOE_CASES)
@pytest.mark.parametrize("aligned_by", ["sort kernel", "torch ops"])
def test_fused_fp8_experts_match_reference(num_tokens, num_experts, top_k, hidden, inter, block, aligned_by,
                                           monkeypatch) -> None:
    """FP8 block-scaled experts: the Triton kernels against the reference (which dequantises), with
    the pairs aligned by the one-program sort (small batches) and by torch ops (large ones)."""
    from deepinfer.kernels.triton_ops import moe as triton_moe

    if aligned_by == "torch ops":
        monkeypatch.setattr(triton_moe, "FUSED_MAX_PAIRS", 2)
    gen = torch.Generator().manual_seed(num_tokens * hidden + block)
    dtype = DTYPES[0]
    x, ids, weights, args = _quantised_experts(gen, num_tokens, num_experts, top_k, hidden, inter, dtype,
                                               lambda w: reference.quant_fp8_block(w, block))
    poison_allocator()
    got = triton_moe.moe_experts_fp8_fused(x, ids, weights, args[0], args[1], args[2], args[3], 0.5, block)
    want = reference.moe_experts_fp8(x, ids, weights, args[0], args[1], args[2], args[3], 0.5, block)
    close(got, want, dtype)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter"),
                         [(3, 8, 2, 64, 64), (40, 8, 3, 128, 96)]
                         + ([flash_experts(32, 256, 6, 4096, 2048)] if BIG else []))
@pytest.mark.parametrize("aligned_by", ["sort kernel", "torch ops"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_mxfp4_experts_match_reference(num_tokens, num_experts, top_k, hidden, inter, aligned_by, dtype,
                                             monkeypatch) -> None:
    """MXFP4 experts: the Triton kernels against the reference; bfloat16 activations on a GPU take
    the microscaling dot, others decode the codes per tile."""
    from deepinfer.kernels.triton_ops import moe as triton_moe

    if aligned_by == "torch ops":
        monkeypatch.setattr(triton_moe, "FUSED_MAX_PAIRS", 2)
    gen = torch.Generator().manual_seed(num_tokens * hidden + inter)
    x, ids, weights, args = _quantised_experts(gen, num_tokens, num_experts, top_k, hidden, inter, dtype,
                                               reference.quant_mxfp4)
    poison_allocator()
    got = triton_moe.moe_experts_mxfp4_fused(x, ids, weights, *args, 0.5)
    close(got, reference.moe_experts_mxfp4(x, ids, weights, *args, 0.5), dtype)


@pytest.mark.parametrize(("num_queries", "heads", "rows", "head_dim"),
                         [(5, 16, 40, 64), (3, 20, 7, 48)] + ([(64, 64, 640, 512)] if BIG else []))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_sparse_attention_matches_reference(num_queries, heads, rows, head_dim, dtype) -> None:
    """The prefill's attention over gathered rows: random validity, one query with no valid row
    (returns 0), a head count not a multiple of the head block."""
    from deepinfer.kernels.triton_ops import sparse_attention_fused

    gen = torch.Generator().manual_seed(num_queries * rows + head_dim)
    q = randn(gen, num_queries, heads, head_dim, dtype=dtype)
    kv = randn(gen, num_queries, rows, head_dim, dtype=dtype)
    valid = torch.rand(num_queries, rows, generator=gen) < 0.7
    valid[1] = False
    sink = randn(gen, heads)
    poison_allocator()
    got = sparse_attention_fused(q, kv, valid.to(DEVICE), sink, head_dim**-0.5)
    close(got, reference.sparse_attention(q, kv, valid.to(DEVICE), sink, head_dim**-0.5), dtype)
    assert not got[1].any()


PREFILL_CASES = [  # (num_queries, start, heads, head_dim, window, ratio, num_ids, block_size)
    (9, 0, 4, 64, 8, 4, 5, 16), (7, 13, 20, 48, 8, 0, 0, 16), (6, 300, 8, 32, 16, 128, 3, 128)] + (
    [(300, 4000, 64, 512, 128, 4, 512, 128), (200, 0, 64, 512, 128, 128, 64, 128),
     (129, 8000, 64, 512, 128, 0, 0, 128)] if BIG else [])


@pytest.mark.parametrize(("num_queries", "start", "heads", "head_dim", "window", "ratio", "num_ids", "block_size"),
                         PREFILL_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_prefill_attention_matches_reference(num_queries, start, heads, head_dim, window, ratio, num_ids,
                                                   block_size, dtype, request) -> None:
    """One sequence's prefill queries over a contiguous window run (the rows before position 0 NaN:
    never read) and entries through the block table: picks of −1, picks past the table (block 0
    holds NaN: never read), a head count not a multiple of the head block."""
    from deepinfer.kernels.triton_ops import prefill_attention_fused

    gen = torch.Generator().manual_seed(num_queries + start + heads + ratio)
    q = randn(gen, num_queries, heads, head_dim, dtype=dtype)
    window_kv = randn(gen, window + num_queries, head_dim, dtype=dtype)
    window_kv[:max(0, window - start)] = float("nan")
    sink = randn(gen, heads, scale=2.0)
    args = {}
    if ratio:
        rows, max_blocks = block_size // ratio, 4
        paged = randn(gen, max_blocks + 2, rows, head_dim, dtype=dtype)
        paged[0] = float("nan")
        ids = torch.randint(0, (max_blocks + 1) * rows, (num_queries, num_ids), generator=gen)
        ids[torch.rand(num_queries, num_ids, generator=gen) < 0.3] = -1
        table = (torch.randperm(max_blocks + 1, generator=gen)[:max_blocks] + 1).to(DEVICE)
        args = dict(paged=paged, block_table=table, entry_ids=ids.to(DEVICE), ratio=ratio)
    poison_allocator()
    bounds = request.getfixturevalue("kernel_bounds") if INTERPRET else None   # every access inside its tensor
    got = prefill_attention_fused(q, window_kv, start, window, sink, head_dim**-0.5, **args)
    if bounds is not None:
        bounds.assert_clean("_prefill_attention_kernel")
    if ratio:
        args["paged"] = args["paged"].nan_to_num()              # the reference multiplies masked rows by 0
    want = reference.prefill_attention(q, window_kv.nan_to_num(), start, window, sink, head_dim**-0.5, **args)
    close(got, want, dtype)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's bounds check")
def test_prefill_attention_with_long_chunk_tiles_stays_in_bounds(kernel_bounds) -> None:
    """The two-byte tiles the GPU takes for long chunks (64 heads, 32 rows, more than this case's
    heads, window and picks), run on float32 under the interpreter: every access inside its tensor."""
    from deepinfer.kernels.triton_ops import paged

    gen = torch.Generator().manual_seed(7)
    num_queries, start, heads, head_dim, window, ratio, rows = 11, 5, 20, 64, 8, 4, 4
    q = randn(gen, num_queries, heads, head_dim)
    window_kv = randn(gen, window + num_queries, head_dim)
    paged_kv = randn(gen, 6, rows, head_dim)
    table = torch.tensor([3, 1, 4, 2], dtype=torch.int32)
    ids = torch.randint(-1, 5 * rows, (num_queries, 7), generator=gen)
    sink = randn(gen, heads)
    args = (q, window_kv, start, window, sink, head_dim**-0.5, paged_kv, table, ids, ratio)
    got = paged._prefill_attention(*args, paged._attention_tiles(2, head_dim, 256))
    kernel_bounds.assert_clean("_prefill_attention_kernel")
    close(got, reference.prefill_attention(*args), torch.float32)


INDEXER_CASES = [(5, 4, 32, 37), (20, 3, 64, 9), (1, 2, 16, 70)] + (
    [(4096, 64, 128, 1024), (300, 64, 128, 2047)] if BIG else [])


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's bounds check")
def test_indexer_scores_with_two_byte_tiles_stays_in_bounds(kernel_bounds) -> None:
    """The GPU's bfloat16 tiles (64 queries x 128 keys, more than this case has), on float32 under the
    interpreter: every access inside its tensor, the scores right."""
    import triton

    from deepinfer.kernels.triton_ops import indexer

    gen = torch.Generator().manual_seed(11)
    num_queries, heads, dim, num_keys = 70, 3, 32, 130
    q = randn(gen, num_queries, heads, dim)
    keys = randn(gen, num_keys, dim)
    weights = randn(gen, num_queries, heads)
    out = torch.empty(num_queries, num_keys)
    tiles = indexer.index_tiles(2, dim)
    indexer._index_scores_kernel[(triton.cdiv(num_keys, tiles["BLOCK_N"]), triton.cdiv(num_queries, tiles["BLOCK_M"]))](
        q, keys, weights, out, q.stride(0), q.stride(1), keys.stride(0), weights.stride(0), out.stride(0),
        num_queries, heads, dim, num_keys, dim**-0.5, PRECISION="ieee", **tiles)
    kernel_bounds.assert_clean("_index_scores_kernel")
    close(out, reference.indexer_scores(q, keys, weights, dim**-0.5), torch.float32)


@pytest.mark.parametrize(("num_queries", "heads", "dim", "num_keys"), INDEXER_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_indexer_scores_match_reference(num_queries, heads, dim, num_keys, dtype, request) -> None:
    """The prefill's index scores against shared keys; the queries a head slice of a wider tensor."""
    from deepinfer.kernels.triton_ops import indexer_scores_fused

    gen = torch.Generator().manual_seed(num_queries * heads + num_keys)
    q = randn(gen, num_queries, heads + 1, dim, dtype=dtype)[:, 1:]
    keys = randn(gen, num_keys, dim, dtype=dtype)
    weights = randn(gen, num_queries, heads) * heads**-0.5
    poison_allocator()
    bounds = request.getfixturevalue("kernel_bounds") if INTERPRET else None
    got = indexer_scores_fused(q, keys, weights, dim**-0.5)
    if bounds is not None:
        bounds.assert_clean("_index_scores_kernel")
    close(got, reference.indexer_scores(q, keys, weights, dim**-0.5), torch.float32 if dtype == torch.float32
          else torch.bfloat16)


GEMV_CASES = [((1, 256), 1000), ((3, 96), 64), ((2, 1, 512), 37), ((4, 1024), 4096), ((1, 512), 4100),
              ((2, 300), 2050)] + (
    [((1, 4096), 1024), ((1, 1024), 32768), ((2, 8192), 4096), ((4, 4096), 512), ((1, 4096), 4160)] if BIG else [])
# float16 reaches the tensor-core kernel under the interpreter too (its bfloat16 dot is wrong there).
GEMV_DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float16, torch.float32]


@pytest.mark.parametrize(("x_shape", "n_out"), GEMV_CASES)
@pytest.mark.parametrize("dtype", GEMV_DTYPES)
def test_fused_linear_matches_reference(x_shape, n_out, dtype) -> None:
    """Both GEMV kernels (one row / narrow outputs, and the tensor-core one), on strided inputs:
    x a column slice of a wider tensor, the weight a block of rows of a taller one."""
    from deepinfer.kernels.triton_ops import linear_fused

    gen = torch.Generator().manual_seed(n_out + x_shape[-1])
    k_in = x_shape[-1]
    x = randn(gen, *x_shape[:-1], k_in + 8, dtype=dtype)[..., 8:]
    w = randn(gen, n_out + 5, k_in, dtype=dtype, scale=k_in**-0.5)[3:n_out + 3]
    poison_allocator()
    got, want = linear_fused(x, w), reference.linear(x, w)
    assert got.shape == want.shape and got.dtype == want.dtype and not torch.isnan(got).any()
    tol = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_takes_float32_weights_for_low_precision_rows(rows) -> None:
    """`gemv` of bfloat16 rows with a float32 weight (the mHC projection) equals the float32 product."""
    from deepinfer.kernels.triton_ops.gemv import gemv

    gen = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if CUDA else torch.float16
    x, w = randn(gen, rows, 640, dtype=dtype), randn(gen, 24, 640)
    poison_allocator()
    got = gemv(x, w, torch.float32)
    close(got, x.float() @ w.t(), torch.float32)


@pytest.mark.parametrize(("rows", "k_in", "splits"), [(1, 16384, 8), (3, 1000, 8), (2, 96, 4)])
def test_gemv_partials_sum_to_the_product(rows, k_in, splits) -> None:
    """Split-K partials (the mHC projection's form): at most `splits` K ranges, summing to x @ wᵀ."""
    from deepinfer.kernels.triton_ops.gemv import gemv_partials

    gen = torch.Generator().manual_seed(k_in)
    dtype = torch.bfloat16 if CUDA else torch.float16
    x, w = randn(gen, rows, k_in, dtype=dtype), randn(gen, 24, k_in, scale=k_in**-0.5)
    poison_allocator()
    parts = gemv_partials(x, w, splits)
    assert 1 < parts.shape[0] <= splits and parts.shape[1:] == (rows, 24) and not torch.isnan(parts).any()
    close(parts.sum(0), x.float() @ w.t(), torch.float32)


OFF = None    # top_k off (vocab)
# One row's (temperature, top_k, top_p, min_p); rows of a case cycle through them.
SAMPLING_ROWS = [(1.0, OFF, 1.0, 0.0), (0.7, 1, 1.0, 0.0), (1.3, 50, 1.0, 0.0), (1.0, OFF, 0.9, 0.0),
                 (0.9, OFF, 1e-4, 0.0), (1.0, OFF, 1.0, 0.2), (0.8, 50, 0.8, 0.05), (1.1, 300, 0.95, 0.0),
                 (0.6, 7, 0.5, 0.0)]


def sampling_case(gen: torch.Generator, num_rows: int, vocab: int, scale: float = 3.0) -> tuple:
    """Seeded `sample_race` arguments on DEVICE: random logits (a third of row num_rows // 2 banned;
    the last of >= 3 rows has one finite logit), row settings cycling through SAMPLING_ROWS."""
    logits = torch.randn(num_rows, vocab, generator=gen) * scale
    logits[num_rows // 2, torch.randperm(vocab, generator=gen)[:vocab // 3]] = -float("inf")
    if num_rows >= 3:
        logits[-1] = -float("inf")
        logits[-1, vocab // 2] = 0.0
    rows = [SAMPLING_ROWS[i % len(SAMPLING_ROWS)] for i in range(num_rows)]
    temperature, top_k, top_p, min_p = (torch.tensor(column) for column in zip(*[
        (t, vocab if k is OFF else k, p, m) for t, k, p, m in rows]))
    noise = torch.empty(num_rows, vocab).exponential_(generator=gen)
    return tuple(t.to(DEVICE) for t in (logits, temperature.float(), top_k, top_p.float(), min_p.float(), noise))


def least_likely_noise(logits: torch.Tensor, temperature: torch.Tensor, tiebreak: float = 0.0) -> torch.Tensor:
    """Noise p² (times 1 − tiebreak · id / vocab): the race then picks the least likely kept token,
    and among its kept ties the highest id, so the token pins where a row's cut falls."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    ids = torch.arange(logits.shape[1], device=logits.device)
    return (probs * probs * (1 - tiebreak * ids / logits.shape[1])).clamp_min(torch.finfo(torch.float32).tiny)


def with_hint(args: tuple) -> tuple:
    """`sample_race` arguments plus the sampler's host-side num_candidates hint."""
    logits, top_k, top_p = args[0], args[2], args[3]
    cuts = bool(((top_k < logits.shape[-1]) | (top_p < 1)).any())
    return (*args, min(int(top_k.max()), logits.shape[-1]) if cuts else 0)


@pytest.fixture
def sampling_kernel_for_any_batch(monkeypatch):
    """The sampling kernels even below FUSED_MIN_ROWS[_SORTING] (where they otherwise hand over to the
    reference), with rows split into chunks of 1,024 tokens so that most cases span several."""
    from deepinfer.kernels.triton_ops import sampling

    monkeypatch.setattr(sampling, "FUSED_MIN_ROWS", 0)
    monkeypatch.setattr(sampling, "FUSED_MIN_ROWS_SORTING", 0)
    monkeypatch.setattr(sampling, "CHUNK", 1024)


SAMPLE_CASES = [(1, 1000), (3, 4099), (33, 1000), (9, 4099)] + ([(3, 129280), (64, 129280)] if BIG else [])


@pytest.mark.parametrize("least_likely", [False, True])
@pytest.mark.parametrize(("num_rows", "vocab"), SAMPLE_CASES)
@pytest.mark.usefixtures("sampling_kernel_for_any_batch")
def test_fused_sample_race_matches_reference(num_rows, vocab, least_likely) -> None:
    """Exp(1) noise (the sampler's), and noise that makes each row's token its least likely kept one."""
    from deepinfer.kernels.triton_ops import sample_race_fused

    gen = torch.Generator().manual_seed(num_rows * vocab)
    args = sampling_case(gen, num_rows, vocab)
    if least_likely:
        args = (*args[:5], least_likely_noise(args[0], args[1]))
    args = with_hint(args)
    poison_allocator()
    got = sample_race_fused(*args)
    assert got.dtype == torch.int64 and got.shape == (num_rows,)
    assert torch.equal(got, reference.sample_race(*args))


@pytest.mark.parametrize(("num_rows", "vocab"), [(5, 4099)] + ([(64, 129280)] if BIG else []))
@pytest.mark.usefixtures("sampling_kernel_for_any_batch")
def test_fused_sample_race_without_cuts(num_rows, vocab) -> None:
    """No row has top-k or top-p (hint 0): the kernels skip both searches and the ties; temperature
    and min-p still apply (the least-likely noise pins where min-p cuts)."""
    from deepinfer.kernels.triton_ops import sample_race_fused

    gen = torch.Generator().manual_seed(vocab + 1)
    logits, temperature, top_k, top_p, _, exp_noise = sampling_case(gen, num_rows, vocab)
    top_k, top_p = torch.full_like(top_k, vocab), torch.ones_like(top_p)
    min_p = torch.rand(num_rows, generator=gen).mul(0.3).to(DEVICE)
    for noise in (exp_noise, least_likely_noise(logits, temperature)):
        args = (logits, temperature, top_k, top_p, min_p, noise)
        assert with_hint(args)[-1] == 0
        poison_allocator()
        assert torch.equal(sample_race_fused(*args, 0), reference.sample_race(*args, 0))
    with pytest.raises(ValueError, match="num_candidates"):
        sample_race_fused(*args, vocab + 1)


@pytest.mark.usefixtures("sampling_kernel_for_any_batch")
def test_fused_sample_race_on_the_full_vocabulary() -> None:
    """One row of V4's 129,280 tokens with top-p 0.9 (about 5 s under the interpreter); more on CUDA."""
    from deepinfer.kernels.triton_ops import sample_race_fused

    gen = torch.Generator().manual_seed(129280)
    logits, temperature, top_k, _, min_p, noise = sampling_case(gen, 1, 129280)
    args = with_hint((logits, temperature, top_k, torch.full_like(temperature, 0.9), min_p, noise))
    poison_allocator()
    assert torch.equal(sample_race_fused(*args), reference.sample_race(*args))


@pytest.mark.parametrize("top_p", [1.0, 0.37])
@pytest.mark.usefixtures("sampling_kernel_for_any_batch")
def test_fused_sample_race_keeps_lowest_ids_among_ties(top_p) -> None:
    """Quantised logits tie in groups; top_k cuts inside a group, and the noise picks the highest
    kept id of the least likely kept value, so a wrong tie count or order changes the token."""
    from deepinfer.kernels.triton_ops import sample_race_fused

    gen = torch.Generator().manual_seed(11)
    num_rows, vocab = 6, 1500
    logits = (torch.randint(0, 8, (num_rows, vocab), generator=gen) * 0.5).to(DEVICE)
    temperature = torch.ones(num_rows, device=DEVICE)
    top_k = torch.tensor([1, 3, 40, 190, 777, vocab], device=DEVICE)
    top_p = torch.full((num_rows,), top_p, device=DEVICE)
    min_p = torch.zeros(num_rows, device=DEVICE)
    args = with_hint((logits, temperature, top_k, top_p, min_p, least_likely_noise(logits, temperature, tiebreak=1e-3)))
    poison_allocator()
    assert torch.equal(sample_race_fused(*args), reference.sample_race(*args))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.usefixtures("sampling_kernel_for_any_batch")
def test_fused_sample_race_replays_in_a_cuda_graph() -> None:
    from deepinfer.kernels.triton_ops import sample_race_fused

    args = with_hint(sampling_case(torch.Generator().manual_seed(5), 16, 129280))
    want = sample_race_fused(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = sample_race_fused(*args)
    args[0].copy_(args[0].flip(1))      # new logits in place: the replay must read them
    graph.replay()
    assert torch.equal(got, sample_race_fused(*args)) and not torch.equal(got, want)
