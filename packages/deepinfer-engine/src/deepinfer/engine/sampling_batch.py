"""What the sampler needs to know about each row: `SamplingBatch`, built on the host from the rows'
`SamplingParams`, and the per-request generator `RequestRng`.

Every decision that depends on the batch's composition (which rows are greedy, seeded, banned,
grammar-constrained) is taken here, on the host, and carried as index tensors, so the sampler's hot
path makes no host-device synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling_params import MAX_SEED, SamplingParams
from .token_bitmask import bitmask_width


class InvalidSamplingBatch(ValueError):
    """A sampling batch or the logits given to the sampler are inconsistent; the message says which."""


class RequestRng:
    """The random state of one seeded request, kept by the engine for the request's whole life.

    Seeded once with `seed`; only the sampler's draws for this request advance it (one draw of
    vocab_size exponentials per sampled non-greedy step; greedy steps draw nothing).
    """

    __slots__ = ("seed", "generator", "num_draws")

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise InvalidSamplingBatch(f"seed={seed!r} must be an int in [0, 2**64 - 1]")
        self.seed = seed
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.num_draws = 0

    @classmethod
    def for_params(cls, params: SamplingParams, device: torch.device | str = "cpu") -> RequestRng | None:
        """The generator state for a new request: a `RequestRng` if params.seed is set, else None."""
        return None if params.seed is None else cls(params.seed, device)


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

    def __post_init__(self) -> None:
        num_random = self.random_rows.shape[0]
        if self.greedy_rows.shape[0] + num_random != self.num_seqs:
            raise InvalidSamplingBatch(
                f"num_greedy + num_random = {self.greedy_rows.shape[0]} + {num_random} must equal "
                f"num_seqs={self.num_seqs}"
            )
        for name in ("temperature", "top_k", "top_p", "min_p"):
            if getattr(self, name).shape != (num_random,):
                raise InvalidSamplingBatch(f"{name} must have shape [num_random={num_random}]")
        if len(self.rngs) != num_random:
            raise InvalidSamplingBatch(f"len(rngs)={len(self.rngs)} must equal num_random={num_random}")
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

    @property
    def num_top_logprobs(self) -> int:
        """Alternatives to return per row: the largest SamplingParams.logprobs in the batch (0 = none)."""
        return max((n for n in self.num_logprobs if n is not None), default=0)


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
) -> SamplingBatch:
    """Turn the rows' `SamplingParams` into a `SamplingBatch` (host work, one small copy per tensor).

    Args:
        params: one SamplingParams per logits row.
        rngs: per row, the request's `RequestRng` (exactly when params[i].seed is set) else None.
        num_output_tokens: per row, output tokens the request already has (before this step); rows
            below their min_tokens get EOS (unless ignore_eos) and stop_token_ids banned.
        eos_token_ids: the model's EOS token ids.
        vocab_size: logits width; banned ids >= vocab_size cannot be sampled and are skipped.
        device: where the logits live.
        token_bitmask: None, or int32 [len(bitmask_rows), ceil(vocab_size / 32)] on the host: the
            grammar mask of each constrained row (`token_bitmask.fill_token_bitmask`).
        bitmask_rows: the logits row of each token_bitmask row.

    Raises:
        InvalidSamplingBatch: lengths differ, or rngs do not match the seeds.
    """
    num_seqs = len(params)
    if len(rngs) != num_seqs or len(num_output_tokens) != num_seqs:
        raise InvalidSamplingBatch(
            f"len(rngs)={len(rngs)} and len(num_output_tokens)={len(num_output_tokens)} must equal "
            f"len(params)={num_seqs}"
        )
    if vocab_size < 1:
        raise InvalidSamplingBatch(f"vocab_size={vocab_size} must be >= 1")
    # A few passes over the rows, each a comprehension: no per-row function call in the common case.
    mismatched = [row for row, (p, rng) in enumerate(zip(params, rngs)) if (rng is None) != (p.seed is None)]
    if mismatched:
        row = mismatched[0]
        raise InvalidSamplingBatch(f"rngs[{row}] must be a RequestRng exactly when params[{row}].seed is set")
    greedy = [p.is_greedy for p in params]
    greedy_rows = [row for row, is_greedy in enumerate(greedy) if is_greedy]
    random_rows = [row for row, is_greedy in enumerate(greedy) if not is_greedy] if len(greedy_rows) < num_seqs \
        else []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for row in [row for row, (p, num_out) in enumerate(zip(params, num_output_tokens)) if num_out < p.min_tokens]:
        kept = banned_token_ids(params[row], num_output_tokens[row], eos_token_ids, vocab_size)
        banned_rows += [row] * len(kept)
        banned_ids += kept
    chosen = [params[row] for row in random_rows]
    top_k = [p.top_k if 1 <= p.top_k < vocab_size else vocab_size for p in chosen]

    def ints(values: Sequence[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    def floats(values: Sequence[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return SamplingBatch(
        num_seqs=num_seqs,
        vocab_size=vocab_size,
        greedy_rows=ints(greedy_rows),
        random_rows=ints(random_rows),
        temperature=floats([p.temperature for p in chosen]),
        top_k=ints(top_k),
        top_p=floats([p.top_p for p in chosen]),
        min_p=floats([p.min_p for p in chosen]),
        rngs=tuple(rngs[row] for row in random_rows),
        unseeded_positions=ints([i for i, row in enumerate(random_rows) if rngs[row] is None]),
        banned_rows=ints(banned_rows),
        banned_token_ids=ints(banned_ids),
        num_logprobs=tuple(p.logprobs for p in params),
        use_top_k=any(k < vocab_size for k in top_k),
        max_top_k=max(top_k, default=vocab_size),
        use_top_p=any(p.top_p < 1 for p in chosen),
        token_bitmask=None if token_bitmask is None else token_bitmask.to(device, non_blocking=True),
        bitmask_rows=None if token_bitmask is None or list(bitmask_rows) == list(range(num_seqs))
        else ints(list(bitmask_rows)),
    )


def banned_token_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Sequence[int], vocab_size: int
) -> list[int]:
    """Ids a row may not sample now, ascending: EOS (unless ignore_eos) and stop_token_ids while the
    request has fewer than min_tokens outputs; ids >= vocab_size are left out."""
    if num_output_tokens >= params.min_tokens:
        return []
    banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return sorted(t for t in banned if t < vocab_size)
