"""The sampling stage of an engine step: launch sampling over a forward's logits, collect it later.

The engine's step (`LLMEngine.step`, `steps.Step`, docs/design.md §2) launches the forward of step N,
commits step N − 1, then calls `SamplingStage.launch` for step N. `launch` takes
every host decision first (grammar masks, the `SamplingBatch`), queues the sampler on the device and
starts copying the sampled tokens (and any logprobs) back to pinned host memory without waiting;
`collect` waits for that copy only, so under ZOS the device is already running step N + 1's forward
when the host reads step N's tokens.

Grammar rows: a row's token mask is filled from its grammar state at launch, which must already hold
every earlier token of the request (checked: `StaleGrammarError`). The engine's order guarantees it:
step N − 1 is post-processed (its tokens fed to the grammars) before step N's sampling is launched,
with ZOS too.

Non-finite logits: a row whose raw logits hold NaN or +inf, are all -inf, or are too large for any
temperature (`Sampler`'s `finite_rows`) comes back with error `NON_FINITE_LOGITS`, and the engine fails
its request. The flag travels to the host in the same copy as the sampled token ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..device.staging import to_host
from ..device.sync_guard import forbid_cuda_sync
from .grammar_backend import GrammarState
from .logit_controls import TokenHistory, build_logit_controls
from .sampler import Sampler, SamplerOutput, logprob_dicts
from .sampling_batch import RequestRng, SamplingBatch, banned_token_ids, build_sampling_batch
from .sampling_params import SamplingParams
from .token_bitmask import StepBitmask, fill_token_bitmask

NON_FINITE_LOGITS = "non-finite logits"     # SampledToken.error of a row whose logits are unusable


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One sequence's sampled token of a step, with the logprobs it asked for."""

    seq_id: str
    token_id: int
    logprobs: dict[int, float] | None
    error: str | None = None   # why this row failed (its grammar allowed no token, NON_FINITE_LOGITS):
                               # discard token_id and logprobs (None then)


@dataclass(frozen=True, slots=True)
class SampledStep:
    """The sampled tokens of one step, one entry per row in logits-row order (per-row lists rather
    than one object per token: the engine walks them in one loop)."""

    seq_ids: tuple[str, ...]
    token_ids: list[int]                        # meaningless for the rows in errors
    logprobs: list[dict[int, float] | None]     # the asked-for logprobs; None where none were asked or errors
    errors: dict[int, str]                      # row -> why it failed (its grammar allowed no token,
                                                # NON_FINITE_LOGITS); usually empty
    ranks: list[int] | None = None              # the sampled tokens' ranks (`SamplerOutput.ranks`) when
                                                # some row asked for logprobs
    token_array: np.ndarray | None = None       # [num_rows] int64, token_ids as an array (None: not kept)

    def tokens(self) -> list[SampledToken]:
        """The same, one `SampledToken` per row."""
        return [SampledToken(seq_id, token_id, logprobs, self.errors.get(row))
                for row, (seq_id, token_id, logprobs) in enumerate(zip(self.seq_ids, self.token_ids, self.logprobs))]


@dataclass(frozen=True, slots=True)
class RowParams:
    """What the sampler needs to know about one row's request."""

    params: SamplingParams
    rng: RequestRng | None
    num_output_tokens: int
    grammar: GrammarState | None = None      # the request's grammar state (structured output)


@dataclass(frozen=True, slots=True)
class StepRows:
    """What the sampler needs to know about every row of one step, one entry per row in logits-row
    order (per-row sequences rather than one object per row: the engine fills them in a few passes)."""

    params: Sequence[SamplingParams]
    rngs: Sequence[RequestRng | None]
    num_output_tokens: Sequence[int]
    grammars: Sequence[GrammarState | None] | None = None   # None = no row is constrained
    history_slots: Sequence[int | None] | None = None   # TokenHistory row of each row; None = no row has one
    bad_word_ids: Sequence[Sequence[Sequence[int]]] | None = None   # tokenized bad words; None = none
    controlled: bool = False     # some row has penalties, logit_bias, allowed_token_ids or bad_words

    @classmethod
    def from_rows(cls, rows: Sequence[RowParams]) -> StepRows:
        """The step's rows from one `RowParams` per row."""
        grammars = [r.grammar for r in rows]
        return cls([r.params for r in rows], [r.rng for r in rows], [r.num_output_tokens for r in rows],
                   grammars if any(g is not None for g in grammars) else None)


@dataclass(frozen=True, slots=True)
class InFlightSampling:
    """A launched sampling whose results are still on their way to the host.

    Attributes:
        seq_ids: the rows' sequences, in logits-row order.
        token_ids: [num_rows] int64 sampled ids on the device (ZOS feeds them to the next forward).
        batch: the rows' sampling parameters.
        readback: host copies being filled (pinned on CUDA): [2, num_rows] int64 (token ids, then 1 =
            finite logits / 0 = not; a third row, the sampled tokens' ranks, when some row asked for
            logprobs), then, when some row asked for logprobs, the sampled tokens'
            logprobs [num_rows] and the top ids / logprobs [num_rows, k] (k > 0 only).
        done: the CUDA event after the copies (None on the CPU: nothing to wait for).
        dead_rows: row -> why its grammar allowed no token.
    """

    seq_ids: tuple[str, ...]
    token_ids: Tensor
    batch: SamplingBatch
    readback: tuple[Tensor, ...]
    done: torch.cuda.Event | None
    dead_rows: dict[int, str]


class SamplingStage:
    """Samples one token per logits row and brings the results back to the host asynchronously.

    Args:
        sampler: the token sampler.
        eos_token_ids: the model's EOS ids (banned below a row's min_tokens).
        vocab_size: logits width.
        sync_guard: wrap the launch of guarded steps in `forbid_cuda_sync`.
        history: the token history of penalised rows (`StepRows.history_slots` index it).
    """

    def __init__(self, sampler: Sampler, eos_token_ids: Sequence[int], vocab_size: int, *,
                 sync_guard: bool = True, history: TokenHistory | None = None) -> None:
        self.sampler = sampler
        self.history = history
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.sync_guard = sync_guard
        self._reusable: _ReusableBatch | None = None

    def _batch(self, rows: StepRows, device: torch.device, masks: StepBitmask | None) -> SamplingBatch:
        """The step's `SamplingBatch`: the previous step's again when its rows have the same parameters,
        generators and device, and none of them is constrained or banned (the steady decode step: no
        host work per row beyond two list comparisons, no host-to-device copy), else a new one."""
        params, rngs, num_out = rows.params, rows.rngs, rows.num_output_tokens
        reusable = self._reusable
        if masks is not None or rows.controlled:
            self._reusable = None
        elif reusable is not None and reusable.fits(rows, device):
            return reusable.for_step(num_out)
        batch = build_sampling_batch(
            params, rngs=rngs, num_output_tokens=num_out,
            eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size, device=device,
            token_bitmask=None if masks is None else masks.bitmask,
            bitmask_rows=() if masks is None else masks.rows,
            controls=build_logit_controls(
                params, rows.history_slots or [None] * len(params), rows.bad_word_ids or [()] * len(params),
                self.history, self.vocab_size, device) if rows.controlled else None,
        )
        if masks is None and not rows.controlled and not batch.banned_rows.shape[0]:
            random_rows = [row for row, p in enumerate(params) if not p.is_greedy] if batch.rngs else []
            self._reusable = _ReusableBatch(batch, device, list(params), list(rngs), random_rows,
                                            max((p.min_tokens for p in params), default=0))
        return batch

    def launch(self, seq_ids: tuple[str, ...], logits: Tensor, rows: StepRows, *,
               guarded: bool = False) -> InFlightSampling:
        """Queue sampling of `logits` ([len(seq_ids), vocab] float32 or the model dtype) on its device and
        start the copy back; returns without waiting for the device.

        Args:
            guarded: a ZOS launch: the device work runs under `forbid_cuda_sync`.
        """
        num_output_tokens = rows.num_output_tokens
        masks = None
        if rows.grammars is not None:      # host work: the grammars fill their rows' masks
            banned = [banned_token_ids(p, num_out, self.eos_token_ids, self.vocab_size) if g is not None else ()
                      for p, num_out, g in zip(rows.params, num_output_tokens, rows.grammars)]
            masks = fill_token_bitmask(list(rows.grammars), list(num_output_tokens), banned, self.vocab_size)
        with forbid_cuda_sync(logits.device, enabled=guarded and self.sync_guard):
            batch = self._batch(rows, logits.device, masks)
            sampled = self.sampler(logits.float(), batch)
            readback, done = to_host(_readback_tensors(sampled, batch))
        dead_rows = {} if masks is None else dict(zip(masks.dead_rows, masks.dead_reasons))
        return InFlightSampling(seq_ids, sampled.token_ids, batch, readback, done, dead_rows)

    @staticmethod
    def collect(flight: InFlightSampling) -> SampledStep:
        """Wait for a launched sampling's copy back (only it, not later work) and return its tokens."""
        if flight.done is not None:
            flight.done.synchronize()
        ids_and_flags, *logprob_parts = flight.readback
        token_ids, finite, *rank_rows = ids_and_flags.tolist()
        sampled_logprobs, top_logprobs, top_ids = (*logprob_parts, None, None, None)[:3]
        host = SamplerOutput(ids_and_flags[0], sampled_logprobs, ids_and_flags[1] != 0, top_logprobs, top_ids)
        logprobs = logprob_dicts(host, flight.batch, token_ids)     # no logprob part: none was asked
        errors = dict(flight.dead_rows)
        if 0 in finite:
            for row, is_finite in enumerate(finite):
                if not is_finite:
                    errors.setdefault(row, NON_FINITE_LOGITS)
        for row in errors:
            logprobs[row] = None
        return SampledStep(flight.seq_ids, token_ids, logprobs, errors, rank_rows[0] if rank_rows else None,
                           ids_and_flags[0].numpy())


@dataclass(frozen=True, slots=True)
class _ReusableBatch:
    """A `SamplingBatch` with what decides whether the next step may use it again."""

    batch: SamplingBatch
    device: torch.device
    params: list[SamplingParams]           # the rows' parameters, compared by identity first
    rngs: list[RequestRng | None]          # the rows' generators (the same requests when seeded)
    random_rows: list[int]                 # rows that draw noise (their draw positions move each step)
    max_min_tokens: int                    # no row is banned once every row has this many outputs

    def fits(self, rows: StepRows, device: torch.device) -> bool:
        """Whether a step of these rows (none constrained or controlled) may sample with `batch`: the
        same device, parameters and generators, and no row still banned by min_tokens."""
        return (self.device == device and self.params == rows.params and self.rngs == rows.rngs
                and min(rows.num_output_tokens, default=0) >= self.max_min_tokens)

    def for_step(self, num_output_tokens: Sequence[int]) -> SamplingBatch:
        """`batch` with the random rows' draw positions of this step."""
        if not self.batch.rngs:
            return self.batch
        return dataclasses.replace(self.batch, draw_positions=tuple(num_output_tokens[row]
                                                                    for row in self.random_rows))


def _readback_tensors(sampled: SamplerOutput, batch: SamplingBatch) -> tuple[Tensor, ...]:
    """What the host needs of a step's sampling: ids and finiteness, and logprobs when asked."""
    if not batch.wants_logprobs or sampled.ranks is None:
        return (torch.stack((sampled.token_ids, sampled.finite_rows.to(torch.int64))),)
    ids_and_flags = torch.stack((sampled.token_ids, sampled.finite_rows.to(torch.int64), sampled.ranks))
    if sampled.top_ids is None or sampled.top_logprobs is None:
        return ids_and_flags, sampled.logprobs
    return ids_and_flags, sampled.logprobs, sampled.top_logprobs, sampled.top_ids
