"""Sort-free sampling, each row split over many programs: twin of `reference.sample_race`.

A row's vocabulary is cut into chunks of CHUNK tokens, one program per (row, chunk), so a single
row keeps the whole GPU busy. A fixed sequence of launches (the same for every batch, so CUDA graphs
can capture it) streams the logits several times; nothing but the token is written back:

1. stats: per chunk, the max of logits / temperature and the sum of exp relative to it; a one-program-
   per-row launch combines them into the row's max and softmax normaliser (stored, so every later
   launch reads the same two numbers);
2. top-k (rows with top_k < vocab): a k-ary search for the k-th largest probability. Probabilities are
   >= 0, so their float32 bit patterns order like their values. Pass i counts, per chunk, the tokens
   above SPLITS evenly spaced bit thresholds inside the current bracket; pass i + 1's programs sum
   those partial counts (in a fixed order, all of them alike) and keep the sub-interval where the
   count crosses k, SPLITS-fold narrower. The bracket starts at [0, bits(p_max)] < 2^30 wide, so
   PASSES = 8 passes (SPLITS = 16) reach the exact boundary value; ties there are kept by ascending
   id (k - count above of them). Passes after convergence, and all passes of rows without top-k,
   only carry the bracket over;
3. top-p (rows with top_p < 1): the same search on the probability mass above each threshold,
   against top_p * the mass top-k keeps (the tokens above the top-k boundary plus its kept ties),
   giving the smallest value whose first tie is still kept; its ties are kept while the mass before
   them stays below the limit;
4. ties: per chunk, how many tokens sit exactly on each boundary (their ranks need the counts of the
   chunks before);
5. race, per chunk: keep = inside both prefixes and p >= min_p * p_max; the best kept p / noise
   (ties -> lowest id); a last one-program-per-row launch picks the row's best over its chunks
   (ties -> lowest id, as torch.argmax).

Top-k is exact (integer counts). The top-p mass sums and the probabilities themselves are computed
in another order (and with another exp) than torch's, so tokens can differ from the reference only
where top_p * total falls within float rounding of a prefix sum of the sorted probabilities, or two
race scores within rounding of each other. No host sync, static launch sequence: CUDA-graph safe.

When no row cuts (the host's num_candidates hint is 0) only steps 1 and 5 run: 4 launches.

Which serves a call (H200, vocab 129,280, `benchmarks/kernels_gpu.py`; docs/benchmarks/decode_h200.md):
the sampler runs eagerly, where each of the 23 launches costs ~24 µs of host time, so the kernels
(~550 µs eager, 60–300 µs of GPU time up to 32 rows) lose to the reference's top-k below 128 rows
(1,032 vs 1,172 µs at 128) and to its full sort below 32 (560 vs 914 µs at 32); without cuts they win
at every batch (70 vs 98 µs at 1 row, 157 vs 659 µs at 256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ..reference.sampling import TOPK_INSTEAD_OF_SORT, check_num_candidates
from ._launch import on_triton

FUSED_MIN_ROWS = 128          # fewer rows in a batch with top-k / top-p: the reference serves the call,
FUSED_MIN_ROWS_SORTING = 32   # or fewer than this many where it would sort the vocabulary (see the docstring)
CHUNK = 2048           # tokens per program
TILE = 512             # tokens per step inside a chunk
SPLITS = 16            # thresholds per search pass
PASSES = 8             # search passes per cut: SPLITS ** PASSES = 2 ** 32 > any bracket (< 2 ** 30)
TOP_K, TOP_P = 0, 1    # the two cuts a search pass can serve


@triton.jit
def _tile(row_ptr, start, end, temperature, TILE: tl.constexpr):
    """Logits / temperature of tokens start … start + TILE (those at or past `end` are -inf)."""
    ids = start + tl.arange(0, TILE)
    live = ids < end
    return tl.load(row_ptr + ids, mask=live, other=-float("inf")) / temperature, ids, live


@triton.jit
def _probs(row_ptr, start, end, temperature, z_max, total, TILE: tl.constexpr):
    z, ids, live = _tile(row_ptr, start, end, temperature, TILE)
    p = tl.exp(z - z_max) / total
    return p, p.to(tl.int32, bitcast=True), ids, live


@triton.jit
def _chunk(vocab, CHUNK: tl.constexpr):
    """(row, chunk, first token, end token) of this program."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    start = chunk * CHUNK
    return row, chunk, start, tl.minimum(start + CHUNK, vocab)


@triton.jit
def _chunk_stats_kernel(logits_ptr, temperature_ptr, max_ptr, sum_ptr, vocab, stride, num_chunks,
                        CHUNK: tl.constexpr, TILE: tl.constexpr):
    row, chunk, start, end = _chunk(vocab, CHUNK)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    temperature = tl.load(temperature_ptr + row)
    z_max = tl.full([TILE], -float("inf"), tl.float32)
    for tile in range(start, end, TILE):
        z, _, _ = _tile(row_ptr, tile, end, temperature, TILE)
        z_max = tl.maximum(z_max, z)
    chunk_max = tl.max(z_max, 0)
    total = tl.zeros([TILE], tl.float32)
    for tile in range(start, end, TILE):
        z, _, _ = _tile(row_ptr, tile, end, temperature, TILE)
        total += tl.where(z > -float("inf"), tl.exp(z - chunk_max), 0.0)
    tl.store(max_ptr + row * num_chunks + chunk, chunk_max)
    tl.store(sum_ptr + row * num_chunks + chunk, tl.sum(total, 0))


@triton.jit
def _row_stats_kernel(max_ptr, sum_ptr, stats_ptr, num_chunks, NC_BLOCK: tl.constexpr):
    """The row's max and softmax normaliser from its chunks' (stats_ptr: [rows, 2] float32)."""
    row = tl.program_id(0)
    c = tl.arange(0, NC_BLOCK)
    live = c < num_chunks
    chunk_max = tl.load(max_ptr + row * num_chunks + c, mask=live, other=-float("inf"))
    chunk_sum = tl.load(sum_ptr + row * num_chunks + c, mask=live, other=0.0)
    z_max = tl.max(chunk_max, 0)
    total = tl.sum(tl.where(chunk_max > -float("inf"), tl.exp(chunk_max - z_max) * chunk_sum, 0.0), 0)
    tl.store(stats_ptr + row * 2, z_max)
    tl.store(stats_ptr + row * 2 + 1, total)


@triton.jit
def _row_stats(stats_ptr, row):
    """(row max of logits / temperature, softmax normaliser, bits of p_max = exp(0) / normaliser)."""
    z_max = tl.load(stats_ptr + row * 2)
    total = tl.load(stats_ptr + row * 2 + 1)
    return z_max, total, (1.0 / total).to(tl.int32, bitcast=True)


@triton.jit
def _thresholds(lo, hi, SPLITS: tl.constexpr):
    step = (hi - lo + SPLITS - 1) // SPLITS
    return tl.minimum(lo + tl.arange(0, SPLITS) * step, hi), step


@triton.jit
def _narrow(lo, hi, step, crossed, value, value_at_hi, SPLITS: tl.constexpr):
    """The bracket's next [lo, hi] from the thresholds' predicate (false ... false true ... true),
    and the measured value at the new hi."""
    num_false = tl.sum((crossed == 0).to(tl.int32), 0)
    found = num_false < SPLITS
    value_at_hi = tl.where(found, tl.sum(tl.where(tl.arange(0, SPLITS) == num_false, value, 0), 0), value_at_hi)
    new_hi = tl.where(found, tl.minimum(lo + num_false * step, hi), hi)
    new_lo = tl.where(num_false == 0, lo, lo + (num_false - 1) * step + 1)
    return new_lo, new_hi, value_at_hi


@triton.jit
def _cut(state_ptr, row, num_rows, step):
    """(lo, hi, value at hi, limit) stored for search step `step` of a cut."""
    at = state_ptr + (step * num_rows + row) * 4
    return (tl.load(at).to(tl.int32, bitcast=True), tl.load(at + 1).to(tl.int32, bitcast=True), tl.load(at + 2),
            tl.load(at + 3))


@triton.jit
def _top_k_result(k_state_ptr, top_k_ptr, row, num_rows, PASSES: tl.constexpr):
    """(bits of the k-th largest probability, how many of its ties to keep); (-1, 0) when off."""
    _, k_bits, count_at_hi, _ = _cut(k_state_ptr, row, num_rows, PASSES)
    top_k = tl.load(top_k_ptr + row)
    return k_bits, tl.where(k_bits >= 0, top_k - count_at_hi.to(tl.int64), 0).to(tl.int32)


@triton.jit
def _search_kernel(logits_ptr, temperature_ptr, stats_ptr, top_k_ptr, top_p_ptr, k_state_ptr, state_ptr, count_ptr,
                   mass_ptr, base_ptr, vocab, stride, num_rows, num_chunks, step, CUT: tl.constexpr,
                   CHUNK: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, NC_BLOCK: tl.constexpr,
                   PASSES: tl.constexpr):
    """Search step `step` of cut CUT (TOP_K or TOP_P): take the bracket of step - 1 and its partial
    counts / masses (all programs of the row alike), narrow it, store it (chunk 0) and, while it is
    open, this chunk's partials for its thresholds. Step PASSES only stores the result.

    state: [PASSES + 1, rows, 4] float32 (lo and hi as int32 bits, value at hi, top-p limit);
    count / mass: [2, rows, chunks, SPLITS] int32 / float32 and base: [2, rows, chunks] float32, by
    step parity: the partials, and the mass above the top-k boundary (top-p)."""
    row, chunk, start, end = _chunk(vocab, CHUNK)
    z_max, total, top_bits = _row_stats(stats_ptr, row)
    if CUT == 0:
        on = tl.load(top_k_ptr + row) < vocab
        first_lo = tl.where(on, 0, -1)
    else:
        top_p = tl.load(top_p_ptr + row)
        on = top_p < 1.0
        base_bits, k_ties = _top_k_result(k_state_ptr, top_k_ptr, row, num_rows, PASSES)
        k_tie_mass = tl.where(base_bits >= 0, k_ties.to(tl.float32) * base_bits.to(tl.float32, bitcast=True), 0.0)
        first_lo = tl.where(on, base_bits - 1, -1)     # below the top-k boundary: at least one pass runs
    if step == 0:
        lo, hi = first_lo, tl.where(on, top_bits, -1)
        value_at_hi, limit = 0.0, float("inf")
    else:
        lo, hi, value_at_hi, limit = _cut(state_ptr, row, num_rows, step - 1)
        if lo < hi:                                    # step - 1 searched: narrow by its partials
            parity = (step - 1) % 2
            c = tl.arange(0, NC_BLOCK)
            part = ((parity * num_rows + row) * num_chunks + c[:, None]) * SPLITS + tl.arange(0, SPLITS)[None, :]
            live = (c < num_chunks)[:, None]
            thresholds, width = _thresholds(lo, hi, SPLITS)
            if CUT == 0:
                count = tl.sum(tl.load(count_ptr + part, mask=live, other=0), 0)
                lo, hi, value_at_hi = _narrow(lo, hi, width, count < tl.load(top_k_ptr + row).to(tl.int32),
                                              count.to(tl.float32), value_at_hi, SPLITS)
            else:
                mass = tl.sum(tl.load(mass_ptr + part, mask=live, other=0.0), 0)
                kept_above = tl.sum(tl.load(base_ptr + (parity * num_rows + row) * num_chunks + c,
                                            mask=c < num_chunks, other=0.0), 0)
                limit = top_p * (kept_above + k_tie_mass)
                lo, hi, value_at_hi = _narrow(lo, hi, width, mass < limit, mass, value_at_hi, SPLITS)
    if chunk == 0:
        at = state_ptr + (step * num_rows + row) * 4
        tl.store(at, lo.to(tl.float32, bitcast=True))
        tl.store(at + 1, hi.to(tl.float32, bitcast=True))
        tl.store(at + 2, value_at_hi)
        tl.store(at + 3, limit)
    if (step < PASSES) & (lo < hi):
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        temperature = tl.load(temperature_ptr + row)
        thresholds, _width = _thresholds(lo, hi, SPLITS)
        count = tl.zeros([TILE, SPLITS], tl.int32)
        mass = tl.zeros([TILE, SPLITS], tl.float32)
        base = tl.zeros([TILE], tl.float32)
        for tile in range(start, end, TILE):
            p, bits, _, _ = _probs(row_ptr, tile, end, temperature, z_max, total, TILE)
            over = bits[:, None] > thresholds[None, :]
            if CUT == 0:
                count += over.to(tl.int32)
            else:
                mass += tl.where(over, p[:, None], 0.0)
                base += tl.where(bits > base_bits, p, 0.0)
        parity = step % 2
        part = ((parity * num_rows + row) * num_chunks + chunk) * SPLITS + tl.arange(0, SPLITS)
        if CUT == 0:
            tl.store(count_ptr + part, tl.sum(count, 0))
        else:
            tl.store(mass_ptr + part, tl.sum(mass, 0))
            tl.store(base_ptr + (parity * num_rows + row) * num_chunks + chunk, tl.sum(base, 0))


@triton.jit
def _cuts(top_k_ptr, k_state_ptr, p_state_ptr, row, num_rows, PASSES: tl.constexpr):
    """Both cuts' results: (k_bits, k_ties, p_bits, p_mass, p_limit)."""
    k_bits, k_ties = _top_k_result(k_state_ptr, top_k_ptr, row, num_rows, PASSES)
    _, p_bits, p_mass, p_limit = _cut(p_state_ptr, row, num_rows, PASSES)
    return k_bits, k_ties, p_bits, p_mass, p_limit


@triton.jit
def _ties_kernel(logits_ptr, temperature_ptr, stats_ptr, top_k_ptr, k_state_ptr, p_state_ptr, ties_ptr, vocab,
                 stride, num_rows, num_chunks, CHUNK: tl.constexpr, TILE: tl.constexpr, PASSES: tl.constexpr):
    """Per chunk, the tokens on the top-k and on the top-p boundary (ties: [rows, chunks, 2] int32)."""
    row, chunk, start, end = _chunk(vocab, CHUNK)
    z_max, total, _top_bits = _row_stats(stats_ptr, row)
    k_bits, _k_ties, p_bits, _p_mass, _p_limit = _cuts(top_k_ptr, k_state_ptr, p_state_ptr, row, num_rows, PASSES)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    temperature = tl.load(temperature_ptr + row)
    on_k = tl.zeros([TILE], tl.int32)
    on_p = tl.zeros([TILE], tl.int32)
    for tile in range(start, end, TILE):
        _, bits, _, live = _probs(row_ptr, tile, end, temperature, z_max, total, TILE)
        on_k += (live & (bits == k_bits)).to(tl.int32)
        on_p += (live & (bits == p_bits)).to(tl.int32)
    at = ties_ptr + (row * num_chunks + chunk) * 2
    tl.store(at, tl.sum(on_k, 0))
    tl.store(at + 1, tl.sum(on_p, 0))


@triton.jit
def _tie_ranks(ties, seen):
    """Ranks among the boundary's ties in id order (counting `seen` earlier ones), and the new count."""
    as_int = ties.to(tl.int32)
    return seen + tl.cumsum(as_int, 0) - as_int, seen + tl.sum(as_int, 0)


@triton.jit
def _race_kernel(logits_ptr, temperature_ptr, noise_ptr, min_p_ptr, stats_ptr, top_k_ptr, k_state_ptr, p_state_ptr,
                 ties_ptr, best_ptr, best_id_ptr, vocab, stride, noise_stride, num_rows, num_chunks,
                 CHUNK: tl.constexpr, TILE: tl.constexpr, PASSES: tl.constexpr, NC_BLOCK: tl.constexpr,
                 CUTS: tl.constexpr):
    """Per chunk, the best kept p / noise and its id (ties -> lowest id; best: [rows, chunks]). Without
    CUTS (no row of the batch has top-k or top-p) the cut states and ties are not read."""
    row, chunk, start, end = _chunk(vocab, CHUNK)
    z_max, total, top_bits = _row_stats(stats_ptr, row)
    floor = tl.load(min_p_ptr + row) * top_bits.to(tl.float32, bitcast=True)
    if CUTS:
        k_bits, k_ties, p_bits, p_mass, p_limit = _cuts(top_k_ptr, k_state_ptr, p_state_ptr, row, num_rows, PASSES)
        c = tl.arange(0, NC_BLOCK)
        before = c < chunk
        k_seen = tl.sum(tl.load(ties_ptr + (row * num_chunks + c) * 2, mask=before, other=0), 0)
        p_seen = tl.sum(tl.load(ties_ptr + (row * num_chunks + c) * 2 + 1, mask=before, other=0), 0)
    else:                                              # both cuts off: every bit pattern (p >= 0) is above -1
        k_bits, p_bits = tl.full([], -1, tl.int32), tl.full([], -1, tl.int32)
        k_ties, k_seen, p_seen = tl.full([], 0, tl.int32), tl.full([], 0, tl.int32), tl.full([], 0, tl.int32)
        p_mass, p_limit = tl.full([], 0.0, tl.float32), tl.full([], float("inf"), tl.float32)
    p_value = tl.where(p_bits >= 0, p_bits.to(tl.float32, bitcast=True), 0.0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    row_noise = noise_ptr + row.to(tl.int64) * noise_stride
    temperature = tl.load(temperature_ptr + row)
    best = tl.full([TILE], -1.0, tl.float32)
    best_id = tl.zeros([TILE], tl.int32)
    for tile in range(start, end, TILE):
        p, bits, ids, live = _probs(row_ptr, tile, end, temperature, z_max, total, TILE)
        k_tie = live & (bits == k_bits)
        k_rank, k_seen = _tie_ranks(k_tie, k_seen)
        p_tie = live & (bits == p_bits)
        p_rank, p_seen = _tie_ranks(p_tie, p_seen)
        keep = (bits > k_bits) | (k_tie & (k_rank < k_ties))
        keep &= (bits > p_bits) | (p_tie & (p_mass + p_rank.to(tl.float32) * p_value < p_limit))
        keep &= p >= floor
        noise = tl.load(row_noise + ids, mask=live, other=1.0)
        score = tl.where(live, tl.where(keep, p, 0.0) / noise, -1.0)
        better = score > best            # strict: an earlier (lower) id keeps its place on a tie
        best = tl.where(better, score, best)
        best_id = tl.where(better, ids, best_id)
    winner = tl.max(best, 0)
    tl.store(best_ptr + row * num_chunks + chunk, winner)
    tl.store(best_id_ptr + row * num_chunks + chunk, tl.min(tl.where(best == winner, best_id, vocab), 0))


@triton.jit
def _pick_kernel(best_ptr, best_id_ptr, out_ptr, vocab, num_chunks, NC_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, NC_BLOCK)
    live = c < num_chunks
    best = tl.load(best_ptr + row * num_chunks + c, mask=live, other=-2.0)
    best_id = tl.load(best_id_ptr + row * num_chunks + c, mask=live, other=vocab)
    winner = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == winner, best_id, vocab), 0).to(tl.int64))


def sample_race_fused(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                      noise: Tensor, num_candidates: int) -> Tensor:
    """Same contract as `reference.sample_race` (float32 logits and noise with unit-stride rows). With
    `num_candidates` 0 the kernels skip both cuts; otherwise it only says whether the reference would
    sort, which sets how many rows the kernels need to serve the call (FUSED_MIN_ROWS[_SORTING])."""
    num_rows, vocab = logits.shape
    check_num_candidates(logits, num_candidates)
    if num_candidates == 0:                   # no cuts: 4 launches, faster than the reference at any batch
        min_rows = 1
    elif num_candidates > TOPK_INSTEAD_OF_SORT or num_candidates == vocab:
        min_rows = FUSED_MIN_ROWS_SORTING
    else:
        min_rows = FUSED_MIN_ROWS
    if num_rows < max(min_rows, 1) or not _takes(logits, noise):
        return reference.sample_race(logits, temperature, top_k, top_p, min_p, noise, num_candidates)
    return _race(logits, temperature, top_k, top_p, min_p, noise, num_candidates)


def sample_race_invariant(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                          noise: Tensor, num_candidates: int) -> Tensor:
    """Same contract as `reference.sample_race`, batch-invariant: the kernels at every row count (the
    reference and the kernels round differently, so switching by batch size could change a row's
    token). Where the kernels do not apply: the reference."""
    check_num_candidates(logits, num_candidates)
    if logits.shape[0] == 0 or not _takes(logits, noise):
        return reference.sample_race(logits, temperature, top_k, top_p, min_p, noise, num_candidates)
    return _race(logits, temperature, top_k, top_p, min_p, noise, num_candidates)


def _takes(logits: Tensor, noise: Tensor) -> bool:
    return (on_triton(logits) and logits.dtype == torch.float32 and noise.dtype == torch.float32
            and logits.stride(-1) == 1 and noise.stride(-1) == 1)


def _race(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, noise: Tensor,
          num_candidates: int) -> Tensor:
    """The launch sequence of the module docstring (float32 logits and noise with unit-stride rows)."""
    num_rows, vocab = logits.shape
    device = logits.device
    num_chunks = triton.cdiv(vocab, CHUNK)
    nc_block = triton.next_power_of_2(num_chunks)
    temperature, top_k = temperature.float().contiguous(), top_k.contiguous()
    top_p, min_p = top_p.float().contiguous(), min_p.float().contiguous()
    chunks = (num_rows, num_chunks)
    shape = dict(CHUNK=CHUNK, TILE=TILE)

    chunk_max = torch.empty(chunks, dtype=torch.float32, device=device)
    chunk_sum = torch.empty(chunks, dtype=torch.float32, device=device)
    stats = torch.empty(num_rows, 2, dtype=torch.float32, device=device)
    _chunk_stats_kernel[chunks](logits, temperature, chunk_max, chunk_sum, vocab, logits.stride(0), num_chunks,
                                **shape, num_warps=4)
    _row_stats_kernel[(num_rows,)](chunk_max, chunk_sum, stats, num_chunks, NC_BLOCK=nc_block, num_warps=1)

    states = torch.empty(2, PASSES + 1, num_rows, 4, dtype=torch.float32, device=device)
    ties = torch.empty(num_rows, num_chunks, 2, dtype=torch.int32, device=device)
    cuts = num_candidates > 0              # the host's hint: 0 = no row has top-k or top-p
    if cuts:
        count = torch.empty(2, num_rows, num_chunks, SPLITS, dtype=torch.int32, device=device)
        mass = torch.empty(2, num_rows, num_chunks, SPLITS, dtype=torch.float32, device=device)
        base = torch.empty(2, num_rows, num_chunks, dtype=torch.float32, device=device)
        for cut in (TOP_K, TOP_P):
            for step in range(PASSES + 1):
                grid = chunks if step < PASSES else (num_rows, 1)
                _search_kernel[grid](logits, temperature, stats, top_k, top_p, states[TOP_K], states[cut], count,
                                     mass, base, vocab, logits.stride(0), num_rows, num_chunks, step, CUT=cut,
                                     **shape, SPLITS=SPLITS, NC_BLOCK=nc_block, PASSES=PASSES, num_warps=4)
        _ties_kernel[chunks](logits, temperature, stats, top_k, states[TOP_K], states[TOP_P], ties, vocab,
                             logits.stride(0), num_rows, num_chunks, **shape, PASSES=PASSES, num_warps=4)
    best = torch.empty(chunks, dtype=torch.float32, device=device)
    best_id = torch.empty(chunks, dtype=torch.int32, device=device)
    _race_kernel[chunks](logits, temperature, noise, min_p, stats, top_k, states[TOP_K], states[TOP_P], ties, best,
                         best_id, vocab, logits.stride(0), noise.stride(0), num_rows, num_chunks, **shape,
                         PASSES=PASSES, NC_BLOCK=nc_block, CUTS=cuts, num_warps=4)
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    _pick_kernel[(num_rows,)](best, best_id, out, vocab, num_chunks, NC_BLOCK=nc_block, num_warps=1)
    return out
