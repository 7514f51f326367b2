"""DeepSeek-V4.1's Triton kernels over the packed cache rows against their reference twins.

Runs on a CUDA device; without one, under Triton's CPU interpreter when TRITON_INTERPRET=1 (float32,
small shapes; `./dev.sh test` runs it so); otherwise skipped. Fresh random inputs per case; every cache
row that no query may read is poisoned (NaN for plain rows, 0xFF bytes — NaN codes and scales — for
packed ones), so a kernel that reads a row it should not, or misses one it should, fails. Under the
interpreter every test also checks each load and store of its kernels against the launch's tensor
arguments (`kernel_bounds`, conftest.py): an access the GPU would fault on fails the test on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from deepinfer.kernels import KernelSet, reference
from deepinfer.kernels.reference.paged import entry_location

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")]
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]
BIG = CUDA                      # V4.1-Flash shapes only on the GPU (the interpreter is slow)


@pytest.fixture(autouse=True)
def _triton(request: pytest.FixtureRequest):
    pytest.importorskip("triton")
    if not INTERPRET:
        yield
        return
    bounds = request.getfixturevalue("kernel_bounds")
    yield
    bounds.assert_clean()


def _poison(rows: torch.Tensor, where: torch.Tensor) -> None:
    """Rows at `where` (a mask over the leading dims) become NaN (plain) or 0xFF bytes (packed)."""
    rows[where] = 255 if rows.dtype == torch.uint8 else float("nan")


def _store(values: torch.Tensor, packed: bool, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    if not packed:
        return values.to(dtype)
    if fmt == "mxfp8":
        return reference.quant_mxfp8_rows(values)
    return reference.quant_fp4_rows(values, e4m3_scales=fmt == "fp4_e4m3")


@dataclass
class AttentionCase:
    q: torch.Tensor
    positions: torch.Tensor
    ring: torch.Tensor
    slots: torch.Tensor
    window: int
    sink: torch.Tensor
    chunk_kv: torch.Tensor | None
    chunk_start: int
    paged: torch.Tensor | None
    tables: torch.Tensor | None
    ids: torch.Tensor | None
    ratio: int

    def call(self, fn):
        return fn(self.q, self.positions, self.ring, self.slots, self.window, self.sink, self.q.shape[-1] ** -0.5,
                  self.chunk_kv, self.chunk_start, self.paged, self.tables, self.ids, self.ratio)


def attention_case(seed: int, num_queries: int, heads: int, dim: int, window: int, ratio: int, num_ids: int, *,
                   packed: bool, dtype: torch.dtype, chunk: int = 0, block_size: int = 8) -> AttentionCase:
    """Decode (chunk = 0: one query per sequence, each in its own slot and table) or one sequence's
    prefill chunk of `chunk` queries (the window partly from the chunk's rows, partly from the ring)."""
    gen = torch.Generator().manual_seed(seed)
    ring_len, rows_per_block = window + 3, block_size // ratio
    num_seqs = 1 if chunk else num_queries
    max_blocks = 6
    num_blocks = 1 + num_seqs * max_blocks
    if chunk:
        start = int(torch.randint(0, 3 * window, (1,), generator=gen))
        positions = torch.arange(start, start + num_queries)
        slot_of = torch.full((num_queries,), 1)
    else:
        start = 0
        positions = torch.randint(0, max_blocks * block_size, (num_queries,), generator=gen)
        positions[0] = 2                                                   # a window reaching before 0
        slot_of = torch.randperm(num_seqs, generator=gen) + 1
    ring = _store(torch.randn(num_seqs + 2, ring_len, dim, generator=gen) * 2, packed, "mxfp8", dtype)
    keep_ring = torch.zeros(num_seqs + 2, ring_len, dtype=torch.bool)
    for p, s in zip(positions.tolist(), slot_of.tolist()):
        for t in range(max(0, p - window + 1), min(p + 1, start) if chunk else p + 1):
            keep_ring[s, t % ring_len] = True
        keep_ring[s, 0] = True     # windows reaching before position 0 gather row 0 in the twin (masked there)
    _poison(ring, ~keep_ring)
    tables = torch.arange(1, num_blocks, dtype=torch.int32)[torch.randperm(num_blocks - 1, generator=gen)]
    tables = tables.view(num_seqs, max_blocks)
    tables[:, -1] = 0                                                  # a column that names no block
    paged = _store(torch.randn(num_blocks, rows_per_block, dim, generator=gen), packed, "fp4_e4m3", dtype)
    ids = torch.randint(-1, max_blocks * block_size // ratio + 4, (num_queries, num_ids), generator=gen)
    query_tables = tables.expand(num_queries, -1) if chunk else tables
    blocks, rows, inside = entry_location(query_tables.long(), ids, ratio, block_size)
    keep_paged = torch.zeros(num_blocks, rows_per_block, dtype=torch.bool)
    ok = (ids >= 0) & inside
    keep_paged[blocks[ok], rows[ok]] = True
    # the twin gathers (and masks) entry 0 for −1 picks and block 0 past the table: 0·NaN would be NaN there
    keep_paged[0] = True
    keep_paged[query_tables[:, 0].long(), 0] = True
    _poison(paged, ~keep_paged)
    to = dict(device=DEVICE)
    chunk_kv = (torch.randn(num_queries, dim, generator=gen) * 2).to(DEVICE, dtype) if chunk else None
    return AttentionCase(
        (torch.randn(num_queries, heads, dim, generator=gen)).to(DEVICE, dtype), positions.to(**to), ring.to(**to),
        slot_of.to(**to), window, torch.randn(heads, generator=gen).to(**to), chunk_kv, start,
        paged.to(**to), query_tables.to(**to), ids.to(**to), ratio)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and not torch.isnan(got).any()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


DECODE_CASES = [(3, 4, 64, 8, 2, 5, True), (5, 6, 96, 8, 1, 9, True), (2, 4, 48, 16, 2, 3, False),
                (1, 4, 64, 8, 1, 40, True)] + ([(4, 64, 512, 128, 2, 512, True), (64, 64, 512, 128, 1, 512, True),
                                                (200, 64, 512, 128, 1, 512, True)] if BIG else [])


@pytest.mark.parametrize(("num_seqs", "heads", "dim", "window", "ratio", "num_ids", "packed"), DECODE_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_matches_reference(num_seqs, heads, dim, window, ratio, num_ids, packed, dtype) -> None:
    from deepinfer.kernels.triton_ops import v41_attention_fused, v41_attention_invariant

    case = attention_case(num_seqs * 7 + dim, num_seqs, heads, dim, window, ratio, num_ids, packed=packed, dtype=dtype)
    want = case.call(reference.v41_attention)
    close(case.call(v41_attention_fused), want, dtype)
    close(case.call(v41_attention_invariant), want, dtype)
    window_only = AttentionCase(**{**case.__dict__, "paged": None, "tables": None, "ids": None})
    close(window_only.call(v41_attention_fused), window_only.call(reference.v41_attention), dtype)


PREFILL_CASES = [(6, 4, 64, 8, 2, 5, True), (11, 4, 64, 4, 1, 7, True), (5, 2, 48, 8, 2, 3, False)] + (
    [(300, 64, 512, 128, 2, 512, True)] if BIG else [])


@pytest.mark.parametrize(("num_queries", "heads", "dim", "window", "ratio", "num_ids", "packed"), PREFILL_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_attention_matches_reference(num_queries, heads, dim, window, ratio, num_ids, packed, dtype) -> None:
    from deepinfer.kernels.triton_ops import v41_attention_fused

    case = attention_case(num_queries + dim, num_queries, heads, dim, window, ratio, num_ids, packed=packed,
                          dtype=dtype, chunk=num_queries)
    close(case.call(v41_attention_fused), case.call(reference.v41_attention), dtype)


@pytest.mark.parametrize(("block_h", "block_n"), [(16, 16), (64, 32)], ids=["float32-tiles", "two-byte-tiles"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_later_prefill_query_block_stays_in_bounds(block_h, block_n, packed, kernel_bounds) -> None:
    """The prefill kernel for queries 9 … 23 of a 24-row chunk (as csa2 calls it per PREFILL_QUERY_BLOCK),
    at the float32 tiles and at the two-byte ones of >= 128 queries on the GPU (more heads and rows per
    tile than there are heads, window rows or picks): the interpreter cannot run those in bfloat16."""
    from deepinfer.kernels.triton_ops import v41_paged
    from deepinfer.kernels.triton_ops.paged import _attention_tiles

    case = attention_case(5, 24, 4, 64, 12, 2, 20, packed=packed, dtype=torch.float32, chunk=24)
    rows = slice(9, 24)
    args = (case.q[rows], case.positions[rows], case.ring, case.slots[rows], case.window, case.sink, 64**-0.5,
            case.chunk_kv, case.chunk_start, case.paged, case.tables[rows], case.ids[rows], case.ratio)
    tiles = {**_attention_tiles(4, 64, 1), "BLOCK_H": block_h, "BLOCK_N": block_n}
    got = v41_paged._launch_attention(*args, tiles, 1)
    kernel_bounds.assert_clean("_v41_attention_kernel")
    close(got, reference.v41_attention(*args), torch.float32)


def test_split_decode_attention_stays_in_bounds(kernel_bounds) -> None:
    from deepinfer.kernels.triton_ops import v41_attention_invariant

    case = attention_case(11, 3, 4, 64, 8, 2, 5, packed=True, dtype=torch.float32)
    close(case.call(v41_attention_invariant), case.call(reference.v41_attention), torch.float32)
    kernel_bounds.assert_clean("_v41_attention_kernel", "_combine_kernel")


def test_the_bounds_check_sees_a_read_past_a_tensor(kernel_bounds) -> None:
    from deepinfer.kernels.triton_ops.v41_quant import MXFP8, _quant_rows_kernel

    x, out = torch.randn(2, 64), torch.empty(2, 66, dtype=torch.uint8)
    _quant_rows_kernel[(2,)](x, out, 64, 66, 64, FMT=MXFP8, FAKE=False, BLOCK=32, NUM_BLOCKS=2, BLOCK_D=64)
    kernel_bounds.assert_clean("_quant_rows_kernel")
    _quant_rows_kernel[(2,)](x, out, 96, 66, 64, FMT=MXFP8, FAKE=False, BLOCK=32, NUM_BLOCKS=2, BLOCK_D=64)
    bad = [(v.kernel, v.kind, v.num_bad, v.num_checked, v.offset) for v in kernel_bounds.violations]
    assert bad == [("_quant_rows_kernel", "load", 32, 64, 512)]   # row 1 at x_row 96: floats 128 … 159 of 128
    kernel_bounds.violations.clear()


INDEX_CASES = [(3, 16, 32, 2, 8, 13, True), (11, 8, 32, 2, 8, 21, True), (4, 8, 64, 1, 8, 40, True),
               (2, 4, 48, 2, 8, 9, False)] + (
    [(64, 32, 128, 2, 64, 4096, True), (8, 32, 128, 1, 64, 8192, True)] if BIG else [])


@pytest.mark.parametrize(("num_queries", "heads", "dim", "ratio", "block_size", "num_entries", "packed"), INDEX_CASES)
@pytest.mark.parametrize("one_sequence", [False, True], ids=["per-query-tables", "one-table"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_index_scores_match_reference(num_queries, heads, dim, ratio, block_size, num_entries, packed, one_sequence,
                                      dtype) -> None:
    from deepinfer.kernels.triton_ops import v41_index_scores_fused

    gen = torch.Generator().manual_seed(num_entries + dim)
    rows_per_block = block_size // ratio
    max_blocks = -(-num_entries // rows_per_block) - 1                  # the last entries lie past the table
    num_blocks = 1 + num_queries * max_blocks
    keys = _store(torch.randn(num_blocks, rows_per_block, dim, generator=gen), packed, "fp4_ue8m0", dtype)
    tables = torch.arange(1, num_blocks, dtype=torch.int32)[torch.randperm(num_blocks - 1, generator=gen)]
    tables = tables.view(num_queries, max_blocks)
    used = torch.zeros(num_blocks, dtype=torch.bool)
    used[tables[:1] if one_sequence else tables] = True
    used[0] = True
    _poison(keys, ~used)
    table = tables[0] if one_sequence else tables
    q = torch.randn(num_queries, heads, dim, generator=gen).to(DEVICE, dtype)
    weights = torch.randn(num_queries, heads, generator=gen).to(DEVICE)
    args = (q, keys.to(DEVICE), table.to(DEVICE), num_entries, weights, dim**-0.5, ratio)
    got, want = v41_index_scores_fused(*args), reference.v41_index_scores(*args)
    assert got.shape == want.shape and not torch.isnan(got).any()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=tol)


def test_the_cuda_set_serves_the_v41_kernels() -> None:
    from deepinfer.kernels import triton_ops

    for batch_invariant in (False, True):
        ops = KernelSet("cuda", batch_invariant=batch_invariant)
        assert ops.sources["v41_attention"] == ("cuda-invariant" if batch_invariant else "cuda")
        assert ops.sources["v41_index_scores"] == ("cuda-invariant" if batch_invariant else "cuda")
        assert ops.sources["hc_mixes"] == ("cuda-invariant" if batch_invariant else "cuda")
        for name in ("hc_collapse", "hc_expand"):            # one program per token and channel block
            assert ops.sources[name] == ("cuda-invariant" if batch_invariant else "cuda")
        for name in ("quant_mxfp8_rows", "quant_fp4_rows", "fake_quant_mxfp8", "fake_quant_fp4_rows"):
            assert ops.sources[name] == "cuda"               # row-wise and exact: the same kernel in both sets
            assert getattr(ops, name) is getattr(triton_ops, f"{name}_fused")
    assert KernelSet("cuda").v41_attention is triton_ops.v41_attention_fused
    assert KernelSet("cuda", batch_invariant=True).v41_attention is triton_ops.v41_attention_invariant


MHC_CASES = [(1, 4, 64, 20), (3, 4, 96, 3), (7, 2, 48, 1)] + ([(300, 4, 5120, 20), (2, 4, 5120, 20)] if BIG else [])


@pytest.mark.parametrize(("num_tokens", "hc", "dim", "iters"), MHC_CASES)
@pytest.mark.parametrize("invariant", [False, True], ids=["fused", "invariant"])
def test_single_pass_mhc_kernels_match_reference(num_tokens, hc, dim, iters, invariant) -> None:
    """V4.1's hc_mixes (the weights alone), hc_collapse by a given pre and hc_expand, against the
    reference ops; the batch-invariant hc_mixes gives each token's rows alone as in the batch."""
    from deepinfer.kernels import triton_ops

    gen = torch.Generator().manual_seed(num_tokens * 7 + hc)
    dtype = torch.bfloat16 if CUDA else torch.float32
    streams = (torch.randn(num_tokens, hc, dim, generator=gen) * 3).to(DEVICE, dtype)
    fn = (torch.randn((2 + hc) * hc, hc * dim, generator=gen) * 0.2).to(DEVICE)
    scale = (1 + 0.3 * torch.randn(3, generator=gen)).to(DEVICE)
    base = torch.randn((2 + hc) * hc, generator=gen).to(DEVICE)
    kwargs = dict(sinkhorn_iters=iters, hc_eps=1e-6, norm_eps=1e-6)
    mixes = triton_ops.hc_mixes_invariant if invariant else triton_ops.hc_mixes_fused
    got = mixes(streams, fn, scale, base, **kwargs)
    want = reference.hc_mixes(streams, fn, scale, base, **kwargs)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    if invariant and num_tokens > 1:
        alone = mixes(streams[1:2], fn, scale, base, **kwargs)
        for g, a in zip(got, alone):
            assert torch.equal(g[1:2], a)
    pre, post, comb = want
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    collapsed = triton_ops.hc_collapse_fused(streams, pre)
    assert collapsed.dtype == dtype
    torch.testing.assert_close(collapsed.float(), reference.hc_collapse(streams, pre).float(), atol=tol, rtol=tol)
    block_out = torch.randn(num_tokens, dim, generator=gen).to(DEVICE, dtype)
    expanded = triton_ops.hc_expand_fused(block_out, streams, post, comb)
    assert expanded.dtype == dtype
    torch.testing.assert_close(expanded.float(), reference.hc_expand(block_out, streams, post, comb).float(),
                               atol=tol, rtol=tol)


def quant_inputs(seed: int, rows: int, dim: int, block: int) -> torch.Tensor:
    """Random rows at magnitudes from 1e-6 to 300 (an FP4 e4m3 scale holds block maxima up to 6 · 448),
    with the cases rounding is decided on: an all-zero row, a row below the scale floors, −0, and values
    on the e2m1 / e4m3 rounding midpoints of their block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen) * torch.logspace(-6, 2.5, rows)[:, None]
    x[0] = 0.0
    x[1] = torch.randn(dim, generator=gen) * 1e-9
    x[2, 1] = -0.0
    # block 0 of row 3: amax 6 (scale 1 for FP4), the rest on e2m1 midpoints and their negatives
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x[3, :block] = torch.cat((torch.tensor([6.0]), mids, -mids, torch.zeros(block - 15)))[:block]
    # block 0 of row 4: amax 448 (MXFP8 scale 1), the rest halfway between e4m3 neighbours
    x[4, :block] = torch.cat((torch.tensor([448.0, 1.0625, 17.0, 0.0029296875, -0.0009765625, 208.0]),
                              torch.zeros(block - 6)))
    return x.to(DEVICE)


@pytest.mark.parametrize(("rows", "dim"), [(9, 64), (7, 96), (6, 48)] + ([(4096, 512), (8192, 128)] if BIG else []))
@pytest.mark.parametrize("fmt", ["mxfp8", "fp4_e4m3", "fp4_ue8m0"])
def test_quantisation_is_bit_exact(rows, dim, fmt) -> None:
    from deepinfer.kernels import triton_ops

    block = 16 if fmt == "fp4_e4m3" else 32
    if dim % block:
        pytest.skip("the format's block does not divide dim")
    x = quant_inputs(rows * dim, rows, dim, block)
    if fmt == "mxfp8":
        pairs = [(triton_ops.quant_mxfp8_rows_fused(x), reference.quant_mxfp8_rows(x)),
                 (triton_ops.fake_quant_mxfp8_fused(x), reference.fake_quant_mxfp8(x))]
    else:
        e4m3 = fmt == "fp4_e4m3"
        pairs = [(triton_ops.quant_fp4_rows_fused(x, e4m3_scales=e4m3), reference.quant_fp4_rows(x, e4m3_scales=e4m3)),
                 (triton_ops.fake_quant_fp4_rows_fused(x, e4m3_scales=e4m3),
                  reference.fake_quant_fp4_rows(x, e4m3_scales=e4m3))]
    for got, want in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.uint8 else got.view(torch.int32),
                           want.view(torch.uint8) if want.dtype == torch.uint8 else want.view(torch.int32))
    if CUDA:                                              # bfloat16 inputs (the model's) and a strided view
        xb = torch.cat((x, x), dim=1).to(torch.bfloat16)[:, :dim]
        packed = triton_ops.quant_mxfp8_rows_fused(xb) if fmt == "mxfp8" else \
            triton_ops.quant_fp4_rows_fused(xb, e4m3_scales=fmt == "fp4_e4m3")
        want = reference.quant_mxfp8_rows(xb) if fmt == "mxfp8" else \
            reference.quant_fp4_rows(xb, e4m3_scales=fmt == "fp4_e4m3")
        assert torch.equal(packed, want)
