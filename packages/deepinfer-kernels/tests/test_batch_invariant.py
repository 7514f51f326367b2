"""The batch-invariant kernel sets: a row's output is bitwise the same alone and in batches of 2 to 64.

Every case draws a pool of 64 rows (tokens, sequences, windows, queries) and calls the op on row 0
alone, then inside batches of other pool rows of several sizes, row 0 at the front, the middle and the
back. Ops whose inputs are padded to the batch's widest row (attention rows, paged entries, index
keys) get the padding of each batch, as the engine does. The same cases run against:

- the CPU set `kernels_for("cpu", batch_invariant=True)` (the PyTorch twins of
  `deepinfer.kernels.invariant` and the reference ops of `invariant.AS_REFERENCE`), at 1 and 3 torch
  threads;
- the CUDA set (`backends._INVARIANT_CUDA`: Triton kernels), on a GPU in bfloat16 and float32, or
  under Triton's CPU interpreter (TRITON_INTERPRET=1, float32); marked `gpu`.

Each case also checks the set's result against the reference twin (close, not bitwise).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels import OP_NAMES, invariant, kernels_for, reference, register
from deepinfer.kernels.invariant import _pointwise
from deepinfer.kernels.invariant.linear import ROW_TILE
from deepinfer.kernels.registry import KernelSet

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
POOL = 64
SIZES = (2, 3, 8, 17, 33, 64)
TRITON = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")

Call = Callable[[KernelSet, Sequence[int]], object]


@dataclass(frozen=True)
class Case:
    """An op on a pool of POOL rows: `call(ops, rows)` runs it on those pool rows (in that order)
    and returns its output(s), each with one leading entry per row."""

    name: str
    call: Call
    tolerance: float = 1e-5        # against the reference (relative to the output's scale)


def _outputs(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def assert_batch_invariant(case: Case, ops: KernelSet) -> None:
    """Row 0 alone vs inside batches of SIZES rows at three positions: bitwise equal (an output whose
    last dim follows the batch's padding is compared on row 0's own width)."""
    alone = _outputs(case.call(ops, [0]))
    draw = random.Random(0)
    for size in SIZES:
        others = draw.sample(range(1, POOL), size - 1)
        for pos in sorted({0, size // 2, size - 1}):
            batch = _outputs(case.call(ops, others[:pos] + [0] + others[pos:]))
            for i, (a, b) in enumerate(zip(alone, batch)):
                row = b[pos][..., :a.shape[-1]] if b.dim() > 1 and b.shape[-1] != a.shape[-1] else b[pos]
                assert torch.equal(row, a[0]), f"{case.name}: output {i} of row 0 changed in a batch of {size} " \
                                               f"at position {pos}"


def assert_close_to_reference(case: Case, ops: KernelSet) -> None:
    rows = list(range(POOL))
    for got, want in zip(_outputs(case.call(ops, rows)), _outputs(case.call(kernels_for("cpu"), rows))):
        got, want = got.cpu(), want.cpu()
        if not got.is_floating_point():
            assert torch.equal(got, want), case.name
            continue
        scale = want.float().abs().max().clamp(min=1.0)
        torch.testing.assert_close(got.float(), want.float(), atol=case.tolerance * scale, rtol=case.tolerance,
                                   msg=lambda m: f"{case.name}: {m}")


# ------------------------------------------------------------------ the cases


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, device: str, dtype: torch.dtype = torch.float32, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * std).to(device=device, dtype=dtype)


def _idx(rows: Sequence[int], device: str) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.int64, device=device)


def _counts(low: int, high: int, seed: int) -> list[int]:
    """A per-row count in [low, high] (row 0 gets the middle value, so batches pad it both ways)."""
    draw = random.Random(seed)
    return [(low + high) // 2] + [draw.randint(low, high) for _ in range(POOL - 1)]


def linear_cases(device: str, dtype: torch.dtype) -> list[Case]:
    cases = []
    for k_in, n_out in ((192, 544), (96, 320), (64, 192), (384, 24), (256, 4096)):
        x = _randn(POOL, 3, k_in, seed=k_in, device=device, dtype=dtype)
        w = _randn(n_out, k_in, seed=n_out, device=device, dtype=dtype, std=k_in**-0.5)
        cases.append(Case(f"linear {k_in}->{n_out}", lambda ops, r, x=x, w=w: ops.linear(x[_idx(r, device), 0], w)))
    x = _randn(POOL, 3, 192, seed=1, device=device, dtype=dtype)
    w = _randn(544, 192, seed=2, device=device, dtype=dtype, std=0.1)
    cases.append(Case("linear, 3-d input", lambda ops, r: ops.linear(x[_idx(r, device)], w)))
    xg = _randn(POOL, 2, 128, seed=3, device=device, dtype=dtype)
    wg = _randn(2 * 64, 128, seed=4, device=device, dtype=dtype, std=0.1)
    cases.append(Case("grouped_linear", lambda ops, r: ops.grouped_linear(xg[_idx(r, device)], wg)))
    return cases


def moe_cases(device: str, dtype: torch.dtype) -> list[Case]:
    hidden, inter, experts, top_k = 64, 32, 8, 2
    x = _randn(POOL, hidden, seed=10, device=device, dtype=dtype)
    w1, w3 = (_randn(inter, hidden, seed=s, device=device, dtype=dtype, std=0.15) for s in (11, 12))
    w2 = _randn(hidden, inter, seed=13, device=device, dtype=dtype, std=0.2)
    stacked = torch.cat((w1, w3))            # w3's rows follow w1's: the CUDA kernel's single GEMM
    w1, w3 = stacked[:inter], stacked[inter:]
    ids = torch.stack([torch.randperm(experts, generator=_gen(100 + t))[:top_k] for t in range(POOL)]).to(device)
    weights = torch.rand(POOL, top_k, generator=_gen(14)).to(device)
    w13 = _randn(experts, 2 * inter, hidden, seed=15, device=device, dtype=dtype, std=0.15)
    w2e = _randn(experts, hidden, inter, seed=16, device=device, dtype=dtype, std=0.2)
    fp8 = [reference.quant_fp8_block(w.float().cpu(), 32) for w in (*w13, *w2e)]
    w13_8 = torch.stack([q for q, _ in fp8[:experts]]).to(device)
    s13_8 = torch.stack([s for _, s in fp8[:experts]]).to(device)
    w2_8 = torch.stack([q for q, _ in fp8[experts:]]).to(device)
    s2_8 = torch.stack([s for _, s in fp8[experts:]]).to(device)
    fp4 = [reference.quant_mxfp4(w.float().cpu()) for w in (*w13, *w2e)]
    w13_4 = torch.stack([q for q, _ in fp4[:experts]]).to(device)
    s13_4 = torch.stack([s for _, s in fp4[:experts]]).to(device)
    w2_4 = torch.stack([q for q, _ in fp4[experts:]]).to(device)
    s2_4 = torch.stack([s for _, s in fp4[experts:]]).to(device)
    logits = _randn(POOL, experts, seed=17, device=device, std=3.0)
    bias = _randn(experts, seed=18, device=device, std=0.1)
    scores = torch.rand(POOL, experts, generator=_gen(19)).to(device)
    bf16 = 2e-2 if dtype == torch.bfloat16 else 1e-5
    cases = [
        Case("clamped_swiglu", lambda ops, r: ops.clamped_swiglu(x[_idx(r, device)], w1, w3, w2, 0.5), bf16),
        Case("moe_experts", lambda ops, r: ops.moe_experts(x[_idx(r, device)], ids[_idx(r, device)],
                                                          weights[_idx(r, device)], w13, w2e, 0.5), bf16),
        Case("moe_experts_fp8", lambda ops, r: ops.moe_experts_fp8(
            x[_idx(r, device)], ids[_idx(r, device)], weights[_idx(r, device)], w13_8, s13_8, w2_8, s2_8, 0.5, 32),
            bf16 if dtype == torch.bfloat16 else 1e-4),
        Case("moe_experts_mxfp4", lambda ops, r: ops.moe_experts_mxfp4(
            x[_idx(r, device)], ids[_idx(r, device)], weights[_idx(r, device)], w13_4, s13_4, w2_4, s2_4, 0.5),
            bf16 if dtype == torch.bfloat16 else 1e-4),
        Case("routing_weights", lambda ops, r: ops.routing_weights(scores[_idx(r, device)], ids[_idx(r, device)],
                                                                  normalize=True, scaling=1.5)),
    ]
    for func in ("sqrtsoftplus", "sigmoid", "softmax"):
        cases.append(Case(f"route {func}", lambda ops, r, func=func: ops.route(
            logits[_idx(r, device)], bias, top_k, scoring_func=func, normalize=True, scaling=1.5)))
        cases.append(Case(f"router_scores {func}",
                          lambda ops, r, func=func: ops.router_scores(logits[_idx(r, device)], func)))
    cases.append(Case("select_experts", lambda ops, r: ops.select_experts(scores[_idx(r, device)], bias, top_k)))
    return cases


def mhc_cases(device: str, dtype: torch.dtype) -> list[Case]:
    hc, dim = 2, 192
    streams = _randn(POOL, hc, dim, seed=20, device=device, dtype=dtype)
    fn = _randn((2 + hc) * hc, hc * dim, seed=21, device=device, std=0.05)
    head_fn = _randn(hc, hc * dim, seed=22, device=device, std=0.05)
    scale, base = torch.tensor([0.9, 1.1, 1.3], device=device), _randn((2 + hc) * hc, seed=23, device=device)
    block_out = _randn(POOL, dim, seed=24, device=device, dtype=dtype)
    post = torch.rand(POOL, hc, generator=_gen(25)).to(device) * 2
    comb = torch.rand(POOL, hc, hc, generator=_gen(26)).to(device)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return [
        Case("hc_pre", lambda ops, r: ops.hc_pre(streams[_idx(r, device)], fn, scale, base, sinkhorn_iters=20,
                                                 hc_eps=1e-6, norm_eps=1e-6), tol),
        Case("hc_post", lambda ops, r: ops.hc_post(block_out[_idx(r, device)], streams[_idx(r, device)],
                                                   post[_idx(r, device)], comb[_idx(r, device)]), tol),
        Case("hc_head", lambda ops, r: ops.hc_head(streams[_idx(r, device)], head_fn, scale[:1], base[:hc],
                                                   hc_eps=1e-6, norm_eps=1e-6), tol),
    ]


def attention_cases(device: str, dtype: torch.dtype) -> list[Case]:
    heads, head_dim, max_rows = 4, 64, 90
    q = _randn(POOL, heads, head_dim, seed=30, device=device, dtype=dtype)
    kv = _randn(POOL, max_rows, head_dim, seed=31, device=device, dtype=dtype)
    counts = _counts(1, max_rows, seed=32)
    holes = torch.rand(POOL, max_rows, generator=_gen(33)) < 0.2
    valid = ((torch.arange(max_rows)[None, :] < torch.tensor(counts)[:, None]) & ~holes).to(device)
    valid[:, 0] = True
    sink = _randn(heads, seed=34, device=device)

    def sparse(ops: KernelSet, r: Sequence[int]):
        width = max(counts[i] for i in r)            # the batch's widest row; the rest is padding
        i = _idx(r, device)
        return ops.sparse_attention(q[i], kv[i, :width], valid[i, :width], sink, head_dim**-0.5)

    index_heads, index_dim, num_keys = 4, 32, 50
    iq = _randn(POOL, index_heads, index_dim, seed=35, device=device, dtype=dtype)
    keys = _randn(num_keys, index_dim, seed=36, device=device, dtype=dtype)
    per_query = _randn(POOL, num_keys, index_dim, seed=37, device=device, dtype=dtype)
    key_counts = _counts(1, num_keys, seed=38)
    hw = _randn(POOL, index_heads, seed=39, device=device)

    def scores_per_query(ops: KernelSet, r: Sequence[int]):
        width = max(key_counts[i] for i in r)
        i = _idx(r, device)
        return ops.indexer_scores(iq[i], per_query[i, :width], hw[i], index_dim**-0.5)

    windows = _randn(POOL, 8, head_dim, seed=40, device=device)
    gates = _randn(POOL, 8, head_dim, seed=41, device=device, std=2.0)
    gates[:, 0] = float("-inf")                       # a missing slot, as before the first window
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return [
        Case("sparse_attention", sparse, tol),
        Case("indexer_scores, shared keys",
             lambda ops, r: ops.indexer_scores(iq[_idx(r, device)], keys, hw[_idx(r, device)], index_dim**-0.5), tol),
        Case("indexer_scores, keys per query", scores_per_query, tol),
        Case("compress_pool", lambda ops, r: ops.compress_pool(windows[_idx(r, device)], gates[_idx(r, device)])),
    ] + paged_cases(device, dtype)


def paged_cases(device: str, dtype: torch.dtype) -> list[Case]:
    """Sequence i has state slot i + 1, blocks 1 + 8i … and a position in [0, 127]."""
    heads, head_dim, window, ratio, block_size, max_blocks = 4, 64, 8, 4, 16, 8
    ring_len = window + 2
    positions = torch.tensor(_counts(0, block_size * max_blocks - 1, seed=50), device=device)
    slots = torch.arange(1, POOL + 1, device=device)
    tables = (1 + torch.arange(POOL * max_blocks).view(POOL, max_blocks)).to(device=device, dtype=torch.int32)
    num_blocks = 1 + POOL * max_blocks
    ring = _randn(POOL + 1, ring_len, head_dim, seed=51, device=device, dtype=dtype)
    paged = _randn(num_blocks, block_size // ratio, head_dim, seed=52, device=device, dtype=dtype)
    q = _randn(POOL, heads, head_dim, seed=53, device=device, dtype=dtype)
    sink = _randn(heads, seed=54, device=device)
    visible = ((positions + 1) // ratio).tolist()
    picks = [torch.randperm(max(v, 1), generator=_gen(55 + i))[:min(v, 6)].tolist() for i, v in enumerate(visible)]

    def attention(ops: KernelSet, r: Sequence[int]):
        width = max(1, max(len(picks[i]) for i in r))      # the batch's top-k width, −1 beyond a row's picks
        ids = torch.full((len(r), width), -1, dtype=torch.int64)
        for row, i in enumerate(r):
            ids[row, :len(picks[i])] = torch.tensor(picks[i], dtype=torch.int64)
        i = _idx(r, device)
        return ops.paged_decode_attention(q[i], ring, slots[i], positions[i], window, sink, head_dim**-0.5, paged,
                                          tables[i], ids.to(device), ratio)

    index_heads, index_dim = 4, 32
    iq = _randn(POOL, index_heads, index_dim, seed=56, device=device, dtype=dtype)
    index_keys = _randn(num_blocks, block_size // ratio, index_dim, seed=57, device=device, dtype=dtype)
    hw = _randn(POOL, index_heads, seed=58, device=device)

    def index_scores(ops: KernelSet, r: Sequence[int]):
        i = _idx(r, device)
        num_entries = max(1, max(visible[j] for j in r))    # the batch's context bound
        return ops.paged_indexer_scores(iq[i], index_keys, tables[i], num_entries, hw[i], index_dim**-0.5, ratio)

    width = 32
    kv_in = {o: _randn(POOL, (2 if o else 1) * width, seed=60 + o, device=device, dtype=dtype) for o in (0, 1)}
    gate_in = {o: _randn(POOL, (2 if o else 1) * width, seed=62 + o, device=device, dtype=dtype) for o in (0, 1)}
    ape = {o: _randn(ratio, (2 if o else 1) * width, seed=64 + o, device=device, std=0.1) for o in (0, 1)}
    rings = {o: (_randn(POOL + 1, 2 * ratio, (2 if o else 1) * width, seed=66 + o, device=device),
                 _randn(POOL + 1, 2 * ratio, (2 if o else 1) * width, seed=68 + o, device=device)) for o in (0, 1)}
    norm_w = 1 + _randn(width, seed=70, device=device, std=0.1)
    inv_freq = reference.rope_inv_freq(8, 10000.0).to(device)

    def compress(ops: KernelSet, r: Sequence[int], overlap: int):
        i = _idx(r, device)
        ring_kv, ring_gate = (t.clone() for t in rings[overlap])       # fresh state per call
        store = torch.zeros(num_blocks, block_size // ratio, width, device=device, dtype=dtype)
        rows = ops.compress_decode(kv_in[overlap][i], gate_in[overlap][i], ape[overlap], positions[i], slots[i],
                                   ring_kv, ring_gate, norm_w, inv_freq, 1e-6, overlap=bool(overlap), paged=store,
                                   block_tables=tables[i])
        closes = (positions[i] + 1) % ratio == 0                   # an open window's row is unspecified
        entry = positions[i] // ratio
        stored = store[tables[i].long().gather(1, (entry * ratio // block_size)[:, None])[:, 0],
                       (entry * ratio % block_size) // ratio]
        return torch.where(closes[:, None], rows, 0.0), stored, ring_kv[slots[i]], ring_gate[slots[i]]

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return [
        Case("paged_decode_attention", attention, tol),
        Case("paged_indexer_scores", index_scores, tol),
        Case("compress_decode (HCA)", lambda ops, r: compress(ops, r, 0), tol),
        Case("compress_decode (CSA, overlapping)", lambda ops, r: compress(ops, r, 1), tol),
    ]


def v41_cases(device: str, dtype: torch.dtype) -> list[Case]:
    """DeepSeek-V4.1: single-pass mHC, the Engram gate, attention and index scores over packed rows (MXFP8
    window rings, FP4 compressed rows and keys), the candidate blocks, top-k and the row quantisation."""
    hc, dim = 2, 192
    streams = _randn(POOL, hc, dim, seed=100, device=device, dtype=dtype)
    fn = _randn((2 + hc) * hc, hc * dim, seed=101, device=device, std=0.05)
    scale, base = torch.tensor([0.9, 1.1, 1.3], device=device), _randn((2 + hc) * hc, seed=102, device=device)
    pre = _randn(POOL, hc, seed=103, device=device).sigmoid()
    post, comb = 2 * _randn(POOL, hc, seed=104, device=device).sigmoid(), _randn(POOL, hc, hc, seed=105,
                                                                                   device=device).softmax(-1)
    block_out = _randn(POOL, dim, seed=106, device=device, dtype=dtype)
    key, weight = _randn(POOL, hc, dim, seed=107, device=device), 1 + _randn(hc, dim, seed=108, device=device, std=0.1)
    mix = dict(sinkhorn_iters=5, hc_eps=1e-6, norm_eps=1e-6)

    heads, head_dim, window, ratio, block_size, max_blocks = 4, 64, 8, 2, 16, 8
    rows_per_block, ring_len = block_size // ratio, window + 2
    positions = torch.tensor(_counts(0, block_size * max_blocks - 1, seed=110), device=device)
    slots = torch.arange(1, POOL + 1, device=device)
    tables = (1 + torch.arange(POOL * max_blocks).view(POOL, max_blocks)).to(device=device, dtype=torch.int32)
    num_blocks = 1 + POOL * max_blocks
    ring = reference.quant_mxfp8_rows(_randn(POOL + 1, ring_len, head_dim, seed=111, device="cpu")).to(device)
    paged = reference.quant_fp4_rows(_randn(num_blocks, rows_per_block, head_dim, seed=112, device="cpu"),
                                     e4m3_scales=True).to(device)
    q = _randn(POOL, heads, head_dim, seed=113, device=device, dtype=dtype)
    sink = _randn(heads, seed=114, device=device)
    visible = ((positions + 1) // ratio).tolist()
    picks = [torch.randperm(max(v, 1), generator=_gen(115 + i))[:min(v, 6)].tolist() for i, v in enumerate(visible)]

    def attention(ops: KernelSet, r: Sequence[int]):
        width = max(1, max(len(picks[i]) for i in r))
        ids = torch.full((len(r), width), -1, dtype=torch.int64)
        for row, i in enumerate(r):
            ids[row, :len(picks[i])] = torch.tensor(picks[i], dtype=torch.int64)
        i = _idx(r, device)
        return ops.v41_attention(q[i], positions[i], ring, slots[i], window, sink, head_dim**-0.5, None, 0, paged,
                                 tables[i], ids.to(device), ratio)

    index_heads, index_dim = 4, 32
    iq = _randn(POOL, index_heads, index_dim, seed=116, device=device, dtype=dtype)
    index_keys = reference.quant_fp4_rows(_randn(num_blocks, rows_per_block, index_dim, seed=117, device="cpu"),
                                          e4m3_scales=False).to(device)
    hw = _randn(POOL, index_heads, seed=118, device=device)

    def index_scores(ops: KernelSet, r: Sequence[int]):
        i = _idx(r, device)
        num_entries = max(1, max(visible[j] for j in r))
        return ops.v41_index_scores(iq[i], index_keys, tables[i], num_entries, hw[i], index_dim**-0.5, ratio)

    scores = _randn(POOL, 40, seed=119, device=device)
    scores[:, 5] = scores[:, 6]                                         # ties
    seen = torch.tensor(_counts(1, 40, seed=120), device=device)
    scores = scores.masked_fill(torch.arange(40, device=device)[None, :] >= seen[:, None], float("-inf"))
    wide = _randn(POOL, 128, seed=121, device=device, dtype=dtype, std=3.0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return [
        Case("hc_mixes", lambda ops, r: ops.hc_mixes(streams[_idx(r, device)], fn, scale, base, **mix)),
        Case("hc_collapse", lambda ops, r: ops.hc_collapse(streams[_idx(r, device)], pre[_idx(r, device)])),
        Case("hc_expand", lambda ops, r: ops.hc_expand(block_out[_idx(r, device)], streams[_idx(r, device)],
                                                       post[_idx(r, device)], comb[_idx(r, device)])),
        Case("engram_gate", lambda ops, r: ops.engram_gate(streams[_idx(r, device)].float(), key[_idx(r, device)],
                                                           weight, 1e-6)),
        Case("v41_attention (packed rows)", attention, tol),
        Case("v41_index_scores (packed keys)", index_scores, tol),
        Case("candidate_blocks", lambda ops, r: ops.candidate_blocks(scores[_idx(r, device)], seen[_idx(r, device)],
                                                                     3, 4)),
        Case("topk_finite", lambda ops, r: ops.topk_finite(scores[_idx(r, device)], 6)),
        Case("quant_mxfp8_rows", lambda ops, r: ops.quant_mxfp8_rows(wide[_idx(r, device)])),
        Case("quant_fp4_rows", lambda ops, r: ops.quant_fp4_rows(wide[_idx(r, device)], e4m3_scales=True)),
    ]


def row_cases(device: str, dtype: torch.dtype) -> list[Case]:
    """Ops of `invariant.AS_REFERENCE` that take a batch."""
    x = _randn(POOL, 4, 64, seed=80, device=device, dtype=dtype)
    w = 1 + _randn(64, seed=81, device=device, std=0.1)
    positions = torch.tensor(_counts(0, 4000, seed=82), device=device)
    inv_freq = reference.rope_inv_freq(16, 10000.0).to(device)
    scores = _randn(POOL, 40, seed=83, device=device)
    scores[:, 5] = scores[:, 6]                                         # ties
    visible = torch.tensor(_counts(1, 40, seed=84), device=device)
    wide = _randn(POOL, 448, seed=85, device=device, dtype=dtype, std=5.0)
    return [
        Case("rms_norm", lambda ops, r: ops.rms_norm(x[_idx(r, device), 0], w, 1e-6)),
        Case("norm_rope", lambda ops, r: ops.norm_rope(x[_idx(r, device)], w, 1e-6, positions[_idx(r, device)],
                                                       inv_freq)),
        Case("apply_rope, inverse", lambda ops, r: ops.apply_rope(x[_idx(r, device)], positions[_idx(r, device)],
                                                                  inv_freq, inverse=True)),
        Case("topk_lowest_index", lambda ops, r: ops.topk_lowest_index(scores[_idx(r, device)],
                                                                       visible[_idx(r, device)], 8)),
        Case("fake_quant_fp8", lambda ops, r: ops.fake_quant_fp8(wide[_idx(r, device)], 64)),
        Case("fake_quant_fp4", lambda ops, r: ops.fake_quant_fp4(wide[_idx(r, device), :64], 32)),
    ] + [sampling_case(device)]


def sampling_case(device: str) -> Case:
    vocab = 4096
    logits = _randn(POOL, vocab, seed=90, device=device, std=3.0)
    noise = torch.empty(POOL, vocab).exponential_(generator=_gen(91)).clamp_min(1e-30).to(device)
    draw = random.Random(92)
    top_k = torch.tensor([vocab] + [draw.choice((vocab, 50, 7)) for _ in range(POOL - 1)], device=device)
    top_p = torch.tensor([1.0] + [draw.choice((1.0, 0.9)) for _ in range(POOL - 1)], device=device)
    min_p = torch.tensor([0.0] + [draw.choice((0.0, 0.05)) for _ in range(POOL - 1)], device=device)
    temperature = torch.tensor([0.7] + [draw.uniform(0.5, 1.5) for _ in range(POOL - 1)], device=device)

    def call(ops: KernelSet, r: Sequence[int]):
        i = _idx(r, device)
        cuts = (top_k[i] < vocab).any() or (top_p[i] < 1).any()        # the sampler's host-side hint
        hint = int(top_k[i].max()) if cuts else 0
        return ops.sample_race(logits[i], temperature[i], top_k[i], top_p[i], min_p[i], noise[i], hint)

    return Case("sample_race (row 0 without cuts, others with)", call)


def all_cases(device: str, dtype: torch.dtype) -> list[Case]:
    return (linear_cases(device, dtype) + moe_cases(device, dtype) + mhc_cases(device, dtype)
            + attention_cases(device, dtype) + row_cases(device, dtype) + v41_cases(device, dtype))


CPU_CASES = {dtype: all_cases("cpu", dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(params=[1, 3], ids=lambda n: f"{n}threads")
def torch_threads(request):
    """The CPU kernels split work by thread count; the invariance must hold at any."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("index", range(len(CPU_CASES[torch.float32])),
                         ids=[c.name for c in CPU_CASES[torch.float32]])
def test_cpu_set_is_batch_invariant(index: int, dtype: torch.dtype, torch_threads: int) -> None:
    assert_batch_invariant(CPU_CASES[dtype][index], kernels_for("cpu", batch_invariant=True))


@pytest.mark.parametrize("index", range(len(CPU_CASES[torch.float32])),
                         ids=[c.name for c in CPU_CASES[torch.float32]])
def test_cpu_set_matches_the_reference(index: int) -> None:
    assert_close_to_reference(CPU_CASES[torch.float32][index], kernels_for("cpu", batch_invariant=True))


# ------------------------------------------------------------------ the CUDA set (Triton)

TRITON_DEVICE = "cuda" if CUDA else "cpu"
TRITON_DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]


@pytest.fixture(scope="module")
def triton_cases():
    pytest.importorskip("triton")
    return {dtype: all_cases(TRITON_DEVICE, dtype) for dtype in TRITON_DTYPES}


@pytest.mark.gpu
@TRITON
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("index", range(len(CPU_CASES[torch.float32])),
                         ids=[c.name for c in CPU_CASES[torch.float32]])
def test_cuda_set_is_batch_invariant(index: int, dtype: torch.dtype, triton_cases) -> None:
    case = triton_cases[dtype][index]
    ops = KernelSet("cuda", batch_invariant=True)     # under the interpreter its kernels run on CPU tensors
    assert_batch_invariant(case, ops)
    if dtype == torch.float32:
        assert_close_to_reference(case, ops)


# ------------------------------------------------------------------ the sets themselves


def test_every_op_is_a_twin_or_as_reference() -> None:
    twins, as_reference = set(invariant.__all__), set(invariant.AS_REFERENCE)
    assert not twins & as_reference
    assert twins | as_reference == set(OP_NAMES)


def test_the_invariant_set_resolves_twins_and_registered_kernels() -> None:
    cpu = kernels_for("cpu", batch_invariant=True)
    assert cpu is kernels_for(torch.device("cpu"), batch_invariant=True)
    assert cpu is not kernels_for("cpu") and cpu.batch_invariant and not kernels_for("cpu").batch_invariant
    assert cpu.linear is invariant.linear and cpu.sources["linear"] == "invariant"
    assert cpu.rms_norm is reference.rms_norm and cpu.sources["rms_norm"] == "reference"
    pytest.importorskip("triton")
    cuda = KernelSet("cuda", batch_invariant=True)
    assert {name for name, source in cuda.sources.items() if source == "cuda-invariant"} == {
        "linear", "grouped_linear", "clamped_swiglu", "moe_experts", "moe_experts_fp8", "moe_experts_mxfp4", "route",
        "hc_pre", "hc_post", "hc_head", "sparse_attention", "prefill_attention", "paged_decode_attention",
        "indexer_scores", "paged_indexer_scores", "compress_decode", "sample_race", "v41_attention", "v41_index_scores",
        "hc_mixes", "hc_collapse", "hc_expand"}
    assert {name for name, source in cuda.sources.items() if source == "invariant"} == {
        "compress_pool", "router_scores", "routing_weights", "engram_gate"}


def test_registering_a_second_invariant_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="batch-invariant implementation for device type 'cuda'"):
        register("linear", "cuda", lambda: reference.linear, batch_invariant=True)
    with pytest.raises(ValueError, match="not a reference op"):
        register("no_such_op", "cuda", lambda: reference.linear, batch_invariant=True)


def test_linear_twin_runs_fixed_row_tiles() -> None:
    x = _randn(ROW_TILE + 5, 3, 40, seed=0, device="cpu")
    w = _randn(24, 40, seed=1, device="cpu")
    out = invariant.linear(x, w)
    assert out.shape == (ROW_TILE + 5, 3, 24)
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert invariant.linear(x[:0], w).shape == (0, 3, 24)


@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus"])
def test_pointwise_twins_give_the_same_bits_at_any_position(name: str) -> None:
    """An element alone (a kernel's scalar tail) and inside a long tensor (its vector body) agree."""
    x = torch.randn(4096, generator=_gen(7)) * 8
    x[::97] = torch.tensor([25.0, -25.0, 0.0, -0.0, 19.99, 20.01]).repeat(8)[: x[::97].numel()]
    fn = getattr(_pointwise, name)
    whole = fn(x)
    pieces = torch.cat([fn(x[i:i + n]) for i, n in _pieces(x.numel())])
    assert torch.equal(pieces, whole)
    torch.testing.assert_close(whole, getattr(F, name)(x) if name != "sigmoid" else torch.sigmoid(x),
                               atol=1e-6, rtol=1e-6)


def _pieces(total: int) -> list[tuple[int, int]]:
    out, i, n = [], 0, 1
    while i < total:
        out.append((i, min(n, total - i)))
        i, n = i + n, n % 37 + 1
    return out


def test_sum_along_adds_slices_in_order() -> None:
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0]])            # float32: 1e8 + 1 rounds back to 1e8
    assert _pointwise.sum_along(x, 1).item() == 1.0      # ((1e8 + 1) − 1e8) + 1
    assert ((x[:, 0] + x[:, 2]) + (x[:, 1] + x[:, 3])).item() == 2.0    # another order, other bits
    assert _pointwise.sum_along(x, 1, keepdim=True).shape == (1, 1)


def test_reference_linear_depends_on_the_batch() -> None:
    """The control: the plain GEMM (MKL) gives row 0 other bits at some batch size, so the twins'
    invariance above is not vacuous."""
    x = _randn(64, 192, seed=3, device="cpu")
    w = _randn(544, 192, seed=4, device="cpu", std=0.1)
    alone = reference.linear(x[:1], w)[0]
    assert any(not torch.equal(reference.linear(x[:m], w)[0], alone) for m in range(2, 65))
