"""Worker: executes one engine step in the order of DESIGN.md §3.

`execute_model_step` always (1) launches the forward of step N, (2) post-processes step N−1 (only
now waiting for its sampling), (3) launches sampling of step N, (4) runs the `pre_sampler_sync` hook,
then post-processes N at once (prefill steps, or ZOS off) or keeps it for the next call (ZOS decode).
ZOS is off in this version, so step N is always post-processed in the same call; the N / N−1 split is
already in place so ZOS slots in without a rewrite.

Grammar rows (DESIGN.md §9): a row whose request `needs_previous_result` gets its token mask from a
grammar state that must already hold every earlier token of the request (checked when the mask is
filled: `StaleGrammarError`). The worker honours the flag by never keeping a step with such a row in
flight: it is post-processed in the same call even when `keep_in_flight` is asked for, so the engine
advances the grammar before it schedules the request again.

Non-finite logits: a row whose raw logits hold NaN or +inf, are all -inf, or are too large for any
temperature (`Sampler`'s `finite_rows`) comes back with error `NON_FINITE_LOGITS`, and the engine fails
its request. The flag travels to the host in the same copy as the sampled token ids, so checking costs
no extra synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .grammar_backend import GrammarState
from .model_runner import ModelRunner, StepBatch
from .sampler import Sampler, SamplerOutput, logprob_dicts
from .sampling_batch import RequestRng, SamplingBatch, banned_token_ids, build_sampling_batch
from .sampling_params import SamplingParams
from .token_bitmask import fill_token_bitmask

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
    needs_previous_result: bool = False      # post-process this row's step before scheduling it again


@dataclass(frozen=True, slots=True)
class StepRows:
    """What the sampler needs to know about every row of one step, one entry per row in logits-row
    order (per-row sequences rather than one object per row: the engine fills them in a few passes)."""

    params: Sequence[SamplingParams]
    rngs: Sequence[RequestRng | None]
    num_output_tokens: Sequence[int]
    grammars: Sequence[GrammarState | None] | None = None   # None = no row is constrained
    needs_previous_result: bool = False     # some row's step must be post-processed before its next one

    @classmethod
    def from_rows(cls, rows: Sequence[RowParams]) -> StepRows:
        """The step's rows from one `RowParams` per row."""
        grammars = [r.grammar for r in rows]
        return cls([r.params for r in rows], [r.rng for r in rows], [r.num_output_tokens for r in rows],
                   grammars if any(g is not None for g in grammars) else None,
                   any(r.needs_previous_result for r in rows))


@dataclass(frozen=True, slots=True)
class _InFlight:
    seq_ids: tuple[str, ...]
    batch: SamplingBatch
    sampled: SamplerOutput
    readback: torch.Tensor             # [2, num_seqs] int64: token ids, then 1 = finite logits / 0 = not
    dead_rows: dict[int, str]          # row -> why its grammar allowed no token
    needs_previous_result: bool        # some row's request needs this step before its next one


class Worker:
    """Runs forwards and sampling for the engine; keeps at most one step in flight."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self.runner = runner
        self.sampler = sampler
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self._pending: _InFlight | None = None
        self.pre_sampler_sync_hooks: list[Callable[[], None]] = []

    def execute_model_step(
        self, step: StepBatch | None, row_params: Callable[[tuple[str, ...]], StepRows], *,
        keep_in_flight: bool = False,
    ) -> list[SampledStep]:
        """Run one step; returns the steps whose post-processing completed during this call (oldest first).

        `row_params(step.sample_seq_ids)` gives the rows' sampling parameters (called once a step)."""
        logits = self.runner.forward(step) if step is not None else None          # (1) launch forward N
        done = self._post_process(self._pending)                                   # (2) post-process N−1
        self._pending = None
        current = self._launch_sampling(step, logits, row_params)                  # (3) sample N
        for hook in self.pre_sampler_sync_hooks:                                   # (4) pre_sampler_sync
            hook()
        if keep_in_flight and current is not None and not current.needs_previous_result:
            self._pending = current
        else:
            done += self._post_process(current)
        return done

    def discard_in_flight(self) -> None:
        """Forget the step kept in flight, unprocessed (after a fault: its requests are failed)."""
        self._pending = None

    def flush(self) -> list[SampledStep]:
        """Post-process the step still in flight (none while ZOS is off)."""
        done = self._post_process(self._pending)
        self._pending = None
        return done

    def _launch_sampling(
        self, step: StepBatch | None, logits: torch.Tensor | None,
        row_params: Callable[[tuple[str, ...]], StepRows],
    ) -> _InFlight | None:
        if step is None or logits is None or not step.sample_seq_ids:
            return None
        rows = row_params(step.sample_seq_ids)
        num_output_tokens = rows.num_output_tokens
        masks = None
        if rows.grammars is not None:
            banned = [banned_token_ids(p, num_out, self.eos_token_ids, self.vocab_size) if g is not None else ()
                      for p, num_out, g in zip(rows.params, num_output_tokens, rows.grammars)]
            masks = fill_token_bitmask(list(rows.grammars), list(num_output_tokens), banned, self.vocab_size)
        batch = build_sampling_batch(
            rows.params, rngs=rows.rngs, num_output_tokens=num_output_tokens,
            eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size, device=logits.device,
            token_bitmask=None if masks is None else masks.bitmask, bitmask_rows=() if masks is None else masks.rows,
        )
        sampled = self.sampler(logits.float(), batch)
        readback = torch.stack((sampled.token_ids, sampled.finite_rows.to(torch.int64)))
        dead_rows = {} if masks is None else dict(zip(masks.dead_rows, masks.dead_reasons))
        return _InFlight(step.sample_seq_ids, batch, sampled, readback, dead_rows, rows.needs_previous_result)

    @staticmethod
    def _post_process(flight: _InFlight | None) -> list[SampledStep]:
        if flight is None:
            return []
        token_ids, finite = flight.readback.tolist()     # the step's one wait for the device
        logprobs = logprob_dicts(flight.sampled, flight.batch, token_ids)
        errors = dict(flight.dead_rows)
        if 0 in finite:
            for row, is_finite in enumerate(finite):
                if not is_finite:
                    errors.setdefault(row, NON_FINITE_LOGITS)
        for row in errors:
            logprobs[row] = None
        return [SampledStep(flight.seq_ids, token_ids, logprobs, errors)]
