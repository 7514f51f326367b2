"""What the sampler needs to know about each row: `SamplingBatch`, built on the host from the rows'
`SamplingParams`, and the per-request generator `RequestRng`.

Every decision that depends on the batch's composition (which rows are greedy, seeded, banned,
grammar-constrained) is taken here, on the host, and carried as index tensors, so the sampler's hot
path makes no host-device synchronisation.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..device.staging import to_device
from .logit_controls import LogitControls
from .sampling_params import MAX_SEED, SamplingParams
from .token_bitmask import bitmask_width


class InvalidSamplingBatch(ValueError):
    """A sampling batch or the logits given to the sampler are inconsistent; the message says which."""


class RequestRng:
    """The random state of one seeded request, kept by the engine for the request's whole life.

    The noise of output token i is drawn from the generator seeded with a mix of (seed, i)
    (`generator_for`): a seeded request's tokens depend only on its seed, its position and its
    logits, not on draws that were thrown away (a ZOS step past the request's end, a preempted step
    that is recomputed) nor on the rest of the batch.
    """

    __slots__ = ("seed", "generator", "num_draws")

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise InvalidSamplingBatch(f"seed={seed!r} must be an int in [0, 2**64 - 1]")
        self.seed = seed
        self.generator = torch.Generator(device=device)
        self.num_draws = 0

    @classmethod
    def for_params(cls, params: SamplingParams, device: torch.device | str = "cpu") -> RequestRng | None:
        """The generator state for a new request: a `RequestRng` if params.seed is set, else None."""
        return None if params.seed is None else cls(params.seed, device)

    def generator_for(self, position: int) -> torch.Generator:
        """The generator, seeded for the draw of output token `position` (>= 0); counts the draw."""
        self.generator.manual_seed(_splitmix64((self.seed + _GOLDEN * (position + 1)) & _MASK64))
        self.num_draws += 1
        return self.generator


_MASK64 = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a bijective mix of a 64-bit integer."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device.

    Rows are split on the host into greedy rows and random (sampled) rows; the per-row parameters
    below exist for the random rows only, in `random_rows` order. Build it with
    `build_sampling_batch`.
    """

    num_seqs: int
    vocab_size: int
    greedy_rows: Tensor          # [num_greedy] int64, row indices into the logits
    random_rows: Tensor          # [num_random] int64, row indices into the logits
    temperature: Tensor          # [num_random] float32 in [1e-5, 1e4] (SamplingParams' bounds: normal floats)
    top_k: Tensor                # [num_random] int64 in [1, vocab_size]; vocab_size = off
    top_p: Tensor                # [num_random] float32 in [1e-20, 1]
    min_p: Tensor                # [num_random] float32, 0 or in [1e-20, 1]
    rngs: tuple[RequestRng | None, ...]   # [num_random]; None = the sampler's shared generator
    draw_positions: tuple[int, ...]       # [num_random] output position each random row samples
    unseeded_positions: Tensor   # [num_unseeded] int64, positions in random_rows whose rng is None
    banned_rows: Tensor          # [num_banned] int64 row index, pairs with banned_token_ids
    banned_token_ids: Tensor     # [num_banned] int64 token id that row must not sample (min_tokens)
    num_logprobs: tuple[int | None, ...]   # [num_seqs], SamplingParams.logprobs of each row
    use_top_k: bool              # some random row has top_k < vocab_size
    max_top_k: int               # largest top_k of the random rows (vocab_size if any is off)
    use_top_p: bool              # some random row has top_p < 1
    token_bitmask: Tensor | None = None   # [num_constrained, ceil(vocab_size / 32)] int32 grammar masks
    bitmask_rows: Tensor | None = None    # [num_constrained] int64, the logits row of each mask row;
                                          # None with a bitmask: every row, mask row i = logits row i
    controls: LogitControls | None = None  # penalties, logit_bias, allowed_token_ids, bad_words
    # Derived from num_logprobs once (the sampler and the read-back ask every step of a reused batch):
    wants_logprobs: bool = field(init=False)    # some row asked for logprobs
    num_top_logprobs: int = field(init=False)   # alternatives to return per row: the largest
                                                # SamplingParams.logprobs in the batch (0 = none)

    def __post_init__(self) -> None:
        asked = [n for n in self.num_logprobs if n is not None]
        object.__setattr__(self, "wants_logprobs", bool(asked))
        object.__setattr__(self, "num_top_logprobs", max(asked, default=0))
        num_random = self.random_rows.shape[0]
        if self.greedy_rows.shape[0] + num_random != self.num_seqs:
            raise InvalidSamplingBatch(
                f"num_greedy + num_random = {self.greedy_rows.shape[0]} + {num_random} must equal "
                f"num_seqs={self.num_seqs}"
            )
        for name in ("temperature", "top_k", "top_p", "min_p"):
            if getattr(self, name).shape != (num_random,):
                raise InvalidSamplingBatch(f"{name} must have shape [num_random={num_random}]")
        if len(self.rngs) != num_random or len(self.draw_positions) != num_random:
            raise InvalidSamplingBatch(f"len(rngs)={len(self.rngs)} and len(draw_positions)="
                                       f"{len(self.draw_positions)} must equal num_random={num_random}")
        if len(self.num_logprobs) != self.num_seqs:
            raise InvalidSamplingBatch(
                f"len(num_logprobs)={len(self.num_logprobs)} must equal num_seqs={self.num_seqs}"
            )
        if self.banned_rows.shape != self.banned_token_ids.shape:
            raise InvalidSamplingBatch("banned_rows and banned_token_ids must have the same shape")
        if self.token_bitmask is None and self.bitmask_rows is not None:
            raise InvalidSamplingBatch("bitmask_rows must be None without a token_bitmask")
        if self.token_bitmask is not None:
            num_rows = self.num_seqs if self.bitmask_rows is None else self.bitmask_rows.shape[0]
            shape = (num_rows, bitmask_width(self.vocab_size))
            if self.token_bitmask.dtype != torch.int32 or tuple(self.token_bitmask.shape) != shape:
                raise InvalidSamplingBatch(
                    f"token_bitmask must be int32 {list(shape)} (one row per bitmask_rows entry), "
                    f"got {self.token_bitmask.dtype} {list(self.token_bitmask.shape)}"
                )


def build_sampling_batch(
    params: Sequence[SamplingParams],
    *,
    rngs: Sequence[RequestRng | None],
    num_output_tokens: Sequence[int],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device | str = "cpu",
    token_bitmask: Tensor | None = None,
    bitmask_rows: Sequence[int] = (),
    controls: LogitControls | None = None,
) -> SamplingBatch:
    """Turn the rows' `SamplingParams` into a `SamplingBatch` (host work, one small copy per tensor).

    Args:
        params: one SamplingParams per logits row.
        rngs: per row, the request's `RequestRng` (exactly when params[i].seed is set) else None.
        num_output_tokens: per row, output tokens the request already has (before this step); rows
            below their min_tokens get EOS (unless ignore_eos) and stop_token_ids banned.
        eos_token_ids: the model's EOS token ids.
        vocab_size: logits width; banned ids >= vocab_size cannot be sampled and are skipped.
        device: where the logits live (str or torch.device).
        token_bitmask: None, or int32 [len(bitmask_rows), ceil(vocab_size / 32)] on the host: the
            grammar mask of each constrained row (`token_bitmask.fill_token_bitmask`).
        bitmask_rows: the logits row of each token_bitmask row.
        controls: the rows' penalties, biases and bans (`logit_controls.build_logit_controls`), or None.

    Raises:
        InvalidSamplingBatch: lengths differ, or rngs do not match the seeds.
    """
    device = torch.device(device)
    num_seqs = len(params)
    _check_rows(params, rngs, num_output_tokens, vocab_size)
    # A few passes over the rows, each a comprehension: no per-row function call in the common case.
    greedy_rows, random_rows = _greedy_and_random_rows(params)
    banned_rows, banned_ids = _min_tokens_bans(params, num_output_tokens, eos_token_ids, vocab_size)
    chosen = [params[row] for row in random_rows]
    top_k = [p.top_k if 1 <= p.top_k < vocab_size else vocab_size for p in chosen]
    unseeded = [i for i, row in enumerate(random_rows) if rngs[row] is None]
    masked = _masked_rows(token_bitmask, bitmask_rows, num_seqs)
    masked_rows = masked or []
    # Every index and parameter tensor travels in two host-to-device copies (one int64, one float32),
    # staged in pinned memory on CUDA: no copy synchronises, and a step pays two copies, not ten.
    int_parts = (greedy_rows, random_rows, top_k, unseeded, banned_rows, banned_ids, masked_rows)
    ints = to_device(np.fromiter(itertools.chain.from_iterable(int_parts), dtype=np.int64,
                                 count=sum(map(len, int_parts))), device)
    num_random = len(chosen)
    floats = to_device(np.array([p.temperature for p in chosen] + [p.top_p for p in chosen]
                                + [p.min_p for p in chosen], dtype=np.float32), device)
    greedy_t, random_t, top_k_t, unseeded_t, banned_rows_t, banned_ids_t, masked_rows_t = \
        torch.split(ints, [len(part) for part in int_parts])
    return SamplingBatch(
        num_seqs=num_seqs,
        vocab_size=vocab_size,
        greedy_rows=greedy_t,
        random_rows=random_t,
        temperature=floats[:num_random],
        top_k=top_k_t,
        top_p=floats[num_random:2 * num_random],
        min_p=floats[2 * num_random:],
        rngs=tuple(rngs[row] for row in random_rows),
        draw_positions=tuple(num_output_tokens[row] for row in random_rows),
        unseeded_positions=unseeded_t,
        banned_rows=banned_rows_t,
        banned_token_ids=banned_ids_t,
        num_logprobs=tuple(p.logprobs for p in params),
        use_top_k=any(k < vocab_size for k in top_k),
        max_top_k=max(top_k, default=vocab_size),
        use_top_p=any(p.top_p < 1 for p in chosen),
        token_bitmask=None if token_bitmask is None else to_device(token_bitmask, device),
        bitmask_rows=None if masked is None else masked_rows_t,
        controls=controls,
    )


def _check_rows(params: Sequence[SamplingParams], rngs: Sequence[RequestRng | None], num_output_tokens: Sequence[int],
                vocab_size: int) -> None:
    num_seqs = len(params)
    if len(rngs) != num_seqs or len(num_output_tokens) != num_seqs:
        raise InvalidSamplingBatch(
            f"len(rngs)={len(rngs)} and len(num_output_tokens)={len(num_output_tokens)} must equal "
            f"len(params)={num_seqs}"
        )
    if vocab_size < 1:
        raise InvalidSamplingBatch(f"vocab_size={vocab_size} must be >= 1")
    mismatched = [row for row, (p, rng) in enumerate(zip(params, rngs)) if (rng is None) != (p.seed is None)]
    if mismatched:
        row = mismatched[0]
        raise InvalidSamplingBatch(f"rngs[{row}] must be a RequestRng exactly when params[{row}].seed is set")


def _masked_rows(token_bitmask: Tensor | None, bitmask_rows: Sequence[int], num_seqs: int) -> list[int] | None:
    """The rows the bitmask constrains, or None when there is no bitmask or it covers every row in order."""
    if token_bitmask is None or list(bitmask_rows) == list(range(num_seqs)):
        return None
    return list(bitmask_rows)


def _greedy_and_random_rows(params: Sequence[SamplingParams]) -> tuple[list[int], list[int]]:
    greedy = [p.is_greedy for p in params]
    greedy_rows = [row for row, is_greedy in enumerate(greedy) if is_greedy]
    if len(greedy_rows) == len(params):
        return greedy_rows, []
    return greedy_rows, [row for row, is_greedy in enumerate(greedy) if not is_greedy]


def _min_tokens_bans(params: Sequence[SamplingParams], num_output_tokens: Sequence[int], eos_token_ids: Sequence[int],
                     vocab_size: int) -> tuple[list[int], list[int]]:
    """(row, token id) pairs banned by min_tokens, as two lists."""
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for row in [row for row, (p, num_out) in enumerate(zip(params, num_output_tokens)) if num_out < p.min_tokens]:
        kept = banned_token_ids(params[row], num_output_tokens[row], eos_token_ids, vocab_size)
        banned_rows += [row] * len(kept)
        banned_ids += kept
    return banned_rows, banned_ids


def banned_token_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Sequence[int], vocab_size: int
) -> list[int]:
    """Ids a row may not sample now, ascending: EOS (unless ignore_eos) and stop_token_ids while the
    request has fewer than min_tokens outputs; ids >= vocab_size are left out."""
    if num_output_tokens >= params.min_tokens:
        return []
    banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return sorted(t for t in banned if t < vocab_size)
