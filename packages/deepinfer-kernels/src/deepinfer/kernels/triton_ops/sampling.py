"""Sort-free sampling in one launch: twin of `reference.sample_race`.

One program per row streams the row's logits several times (nothing but the token is written):

1. max of logits / temperature, then the softmax normaliser (2 passes);
2. top-k (rows with top_k < vocab): a k-ary search for the k-th largest probability. Probabilities are
   >= 0, so their float32 bit patterns order like their values; each pass counts the tokens above
   SPLITS evenly spaced bit thresholds inside the current bracket and keeps the sub-interval where
   the count crosses k, SPLITS-fold narrower. The bracket starts at [0, bits(p_max)] < 2^30 wide, so
   this ends after at most ceil(30 / log2(SPLITS)) passes (8 for SPLITS = 16), at the exact
   boundary value; ties there are kept by ascending id (k - count above of them);
3. top-p (rows with top_p < 1): the same search on the probability mass above each threshold,
   against top_p * the mass kept by top-k (the tokens above the top-k boundary plus its kept ties),
   giving the smallest value whose first tie is still kept; its ties are kept while the mass before
   them stays below the limit;
4. the race (1 pass, reading the noise too): keep = inside both prefixes and p >= min_p * p_max; the
   token is argmax kept p / noise, ties -> lowest id (ties at the boundaries are ranked by a running
   cumulative count, in id order).

Top-k is exact (integer counts). The top-p mass sums and the probabilities themselves are computed
in another order (and with another exp) than torch's, so tokens can differ from the reference only
where top_p * total falls within float rounding of a prefix sum of the sorted probabilities, or two
race scores within rounding of each other. No host sync, static launch shape: CUDA-graph safe.

One program per row leaves most of the GPU idle for small batches, and each search pass makes
vocab x SPLITS comparisons on one SM: on an H200 (vocab 129,280) this is slower than the reference
for top-k, and faster for top-p / temperature only from about 128 rows (benchmarks/kernels_gpu.py),
so `sample_race_fused` hands batches below FUSED_MIN_ROWS to the reference. Splitting a row over many
programs (one launch per search pass, partial counts summed in a fixed order) is the known fix.
TILE and SPLITS are the best of a small sweep there (16 x 512 against 32 x 256, 32 x 128, 64 x 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ._launch import on_triton

FUSED_MIN_ROWS = 128   # fewer rows: the reference is faster on an H200 (see the module docstring)
BLOCK = 1024     # tokens per step of the softmax and race passes
TILE = 512       # tokens per step of a search pass (each compared with SPLITS thresholds)
SPLITS = 16      # thresholds per search pass


@triton.jit
def _scaled(row_ptr, start, vocab, temperature, BLOCK: tl.constexpr):
    ids = start + tl.arange(0, BLOCK)
    live = ids < vocab
    x = tl.load(row_ptr + ids, mask=live, other=-float("inf"))
    return x / temperature, ids, live


@triton.jit
def _probs(row_ptr, start, vocab, temperature, z_max, total, BLOCK: tl.constexpr):
    z, ids, live = _scaled(row_ptr, start, vocab, temperature, BLOCK)
    p = tl.exp(z - z_max) / total
    return p, p.to(tl.int32, bitcast=True), ids, live


@triton.jit
def _softmax_stats(row_ptr, vocab, temperature, BLOCK: tl.constexpr):
    z_max = tl.full([BLOCK], -float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        z, _, _ = _scaled(row_ptr, start, vocab, temperature, BLOCK)
        z_max = tl.maximum(z_max, z)
    row_max = tl.max(z_max, 0)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        z, _, _ = _scaled(row_ptr, start, vocab, temperature, BLOCK)
        total += tl.exp(z - row_max)
    return row_max, tl.sum(total, 0)


@triton.jit
def _above(row_ptr, vocab, temperature, z_max, total, thresholds, base, TILE: tl.constexpr,
           SPLITS: tl.constexpr):
    """Per threshold, the number and probability mass of tokens whose bits exceed it; and the mass
    of those above `base`."""
    count = tl.zeros([TILE, SPLITS], tl.int32)
    mass = tl.zeros([TILE, SPLITS], tl.float32)
    base_mass = tl.zeros([TILE], tl.float32)
    for start in range(0, vocab, TILE):
        p, bits, _, _ = _probs(row_ptr, start, vocab, temperature, z_max, total, TILE)
        over = bits[:, None] > thresholds[None, :]
        count += over.to(tl.int32)
        mass += tl.where(over, p[:, None], 0.0)
        base_mass += tl.where(bits > base, p, 0.0)
    return tl.sum(count, 0), tl.sum(mass, 0), tl.sum(base_mass, 0)


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
def _top_k_cut(row_ptr, vocab, temperature, z_max, total, top_k, top_bits, TILE: tl.constexpr,
               SPLITS: tl.constexpr):
    """(bits of the k-th largest probability, how many of its ties to keep); (-1, 0) when off."""
    on = top_k < vocab
    lo = tl.where(on, 0, -1)
    hi = tl.where(on, top_bits, -1)
    count_at_hi = tl.zeros([], tl.int32)
    while lo < hi:
        thresholds, step = _thresholds(lo, hi, SPLITS)
        count, _, _ = _above(row_ptr, vocab, temperature, z_max, total, thresholds, -1, TILE, SPLITS)
        lo, hi, count_at_hi = _narrow(lo, hi, step, count < top_k, count, count_at_hi, SPLITS)
    return hi, tl.where(on, top_k - count_at_hi, 0).to(tl.int32)


@triton.jit
def _top_p_cut(row_ptr, vocab, temperature, z_max, total, top_p, k_bits, k_ties, top_bits, TILE: tl.constexpr,
               SPLITS: tl.constexpr):
    """(bits of the last value top-p keeps, the mass above it, the mass limit); (-1, 0, inf) when
    off. Starts below k_bits (where the mass is >= the limit), so a search runs at least one pass."""
    on = top_p < 1.0
    lo = tl.where(on, k_bits - 1, -1)
    hi = tl.where(on, top_bits, -1)
    k_tie_mass = tl.where(k_bits >= 0, k_ties.to(tl.float32) * k_bits.to(tl.float32, bitcast=True), 0.0)
    limit = tl.full([], float("inf"), tl.float32)
    mass_at_hi = tl.zeros([], tl.float32)
    while lo < hi:
        thresholds, step = _thresholds(lo, hi, SPLITS)
        _, mass, kept_above = _above(row_ptr, vocab, temperature, z_max, total, thresholds, k_bits, TILE, SPLITS)
        limit = top_p * (kept_above + k_tie_mass)
        lo, hi, mass_at_hi = _narrow(lo, hi, step, mass < limit, mass, mass_at_hi, SPLITS)
    return hi, mass_at_hi, limit


@triton.jit
def _tie_ranks(ties, seen):
    """Ranks among the boundary's ties in id order (counting `seen` earlier ones), and the new count."""
    as_int = ties.to(tl.int32)
    return seen + tl.cumsum(as_int, 0) - as_int, seen + tl.sum(as_int, 0)


@triton.jit
def _race(row_ptr, noise_ptr, vocab, temperature, z_max, total, k_bits, k_ties, p_bits, p_mass, p_limit, floor,
          BLOCK: tl.constexpr):
    p_value = tl.where(p_bits >= 0, p_bits.to(tl.float32, bitcast=True), 0.0)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    k_seen = tl.zeros([], tl.int32)
    p_seen = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        p, bits, ids, live = _probs(row_ptr, start, vocab, temperature, z_max, total, BLOCK)
        k_tie = live & (bits == k_bits)
        k_rank, k_seen = _tie_ranks(k_tie, k_seen)
        p_tie = live & (bits == p_bits)
        p_rank, p_seen = _tie_ranks(p_tie, p_seen)
        keep = (bits > k_bits) | (k_tie & (k_rank < k_ties))
        keep &= (bits > p_bits) | (p_tie & (p_mass + p_rank.to(tl.float32) * p_value < p_limit))
        keep &= p >= floor
        noise = tl.load(noise_ptr + ids, mask=live, other=1.0)
        score = tl.where(live, tl.where(keep, p, 0.0) / noise, -1.0)
        better = score > best            # strict: an earlier (lower) id keeps its place on a tie
        best = tl.where(better, score, best)
        best_id = tl.where(better, ids, best_id)
    winner = tl.max(best, 0)
    return tl.min(tl.where(best == winner, best_id, vocab), 0)


@triton.jit
def _sample_race_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, noise_ptr, out_ptr, vocab,
                        logits_stride, noise_stride, BLOCK: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    temperature = tl.load(temperature_ptr + row)
    z_max, total = _softmax_stats(row_ptr, vocab, temperature, BLOCK)
    p_max = 1.0 / total            # exp(0) / total: the most likely token's probability, bit for bit
    top_bits = p_max.to(tl.int32, bitcast=True)
    k_bits, k_ties = _top_k_cut(row_ptr, vocab, temperature, z_max, total, tl.load(top_k_ptr + row), top_bits,
                                TILE, SPLITS)
    p_bits, p_mass, p_limit = _top_p_cut(row_ptr, vocab, temperature, z_max, total, tl.load(top_p_ptr + row),
                                         k_bits, k_ties, top_bits, TILE, SPLITS)
    floor = tl.load(min_p_ptr + row) * p_max
    token = _race(row_ptr, noise_ptr + row * noise_stride, vocab, temperature, z_max, total, k_bits, k_ties,
                  p_bits, p_mass, p_limit, floor, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_race_fused(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                      noise: Tensor, num_candidates: int) -> Tensor:
    """Same contract as `reference.sample_race` (float32 logits and noise with unit-stride rows; the
    kernel needs no `num_candidates` hint). Below `FUSED_MIN_ROWS` rows the reference is faster and
    serves the call."""
    num_rows, vocab_size = logits.shape
    if (not on_triton(logits) or num_rows < max(FUSED_MIN_ROWS, 1) or logits.dtype != torch.float32
            or noise.dtype != torch.float32 or logits.stride(-1) != 1 or noise.stride(-1) != 1):
        return reference.sample_race(logits, temperature, top_k, top_p, min_p, noise, num_candidates)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    _sample_race_kernel[(num_rows,)](
        logits, temperature.float().contiguous(), top_k.contiguous(), top_p.float().contiguous(),
        min_p.float().contiguous(), noise, out, vocab_size, logits.stride(0), noise.stride(0),
        BLOCK=BLOCK, TILE=TILE, SPLITS=SPLITS, num_warps=8)
    return out
