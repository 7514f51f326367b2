"""PlainStep: the `steps.Step` of prefill steps and of decode steps of one token per row.

launch: the model batch (`ModelRunner.prepare`, under the sync guard when the handle may stay in
flight) and the forward; a prefill step whose requests asked for prompt logprobs runs with every
row's logits and takes them here. sample: the rows' requests (a prefilled group of n samples gets n
rows of its sample 0's logits), their sampling parameters (`step_rows`) and `SamplingStage.launch`;
the sampled tokens stay on the device for the next step's input (`ModelRunner.record_sampled`).
commit: `SamplingStage.collect`, then per row the request's stop checks, finishing and reporting,
and the tokens of the rows that go on to the scheduler in one call.

Steady decode steps (decode_rows.py): while a decode step has the same rows as the previous one (the
scheduler's `DecodeBatch.rows_generation` is unchanged) and none is constrained or controlled, the
rows' sampling parameters are reused and the commit takes the tokens that cannot end their request
in bulk.

Parallel samples (n > 1): sample 0 is prefilled; its prefill row is sampled n times (one row per
sample, each with its own seed), then the sequence is forked for samples 1..n − 1 before their first
tokens are appended (`_fork`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Protocol

import numpy as np
import torch

from deepinfer.sched import BranchId, EngineType, Scheduler, SchedulerOutput, StepKind

from ..config.engine_args import EngineArgs
from ..device.staging import to_device
from ..device.sync_guard import forbid_cuda_sync
from ..sampling.grammar_backend import GrammarState
from ..sampling.grammar_compiler import GrammarCompilePool
from ..sampling.sampler import logprobs_of
from ..sampling.sampling_stage import InFlightSampling, SampledStep, SamplingStage, StepRows
from .decode_rows import SteadyRows
from .model_runner import ModelRunner, StepBatch
from .outputs import FINISH_LENGTH, FINISH_PREFILLED, FINISH_STOP
from .request import Request
from .steps import Changed, Launched

# A PROMPT engine's request that took its first token: handed on (those that ended at it too, with no KV)
_HANDED_OVER = (FINISH_PREFILLED, FINISH_STOP, FINISH_LENGTH)


class StepHost(Protocol):
    """What a step reads of its engine (`LLMEngine`); the scheduler is looked up at each use (a fault
    in `schedule()` replaces it)."""

    args: EngineArgs
    runner: ModelRunner
    sampling: SamplingStage
    grammars: GrammarCompilePool | None
    scheduler: Scheduler
    _seqs: dict[str, Request]

    def _seq(self, seq_id: str) -> Request | None: ...

    def pe_prepare_save_kvcache(self, seq_ids: Sequence[str]) -> None: ...

    def pe_do_save_kvcache(self, seq_ids: Sequence[str]) -> None: ...

    def send_processed_prompts(self, out: SchedulerOutput) -> None: ...


@dataclass(slots=True, eq=False)
class PlainLaunched(Launched):
    """A plain step between its launch and its commit.

    Attributes:
        batch: the model batch (`ModelRunner.prepare`).
        logits: [rows to sample, vocab] float32 of the forward; None once sampled.
        guarded: launched to stay in flight (its sampling runs under the sync guard too).
        sampling: the launched sampling (None before `sample`, or with nothing to sample).
        steady_generation: the rows generation of the `SteadyRows` its parameters came from (None:
            built for this step).
    """

    batch: StepBatch = field(kw_only=True)
    logits: torch.Tensor | None = None
    guarded: bool = False
    sampling: InFlightSampling | None = None
    steady_generation: int | None = None


class PlainStep:
    """The plain `steps.Step` (module docstring) of `host`'s steps."""

    def __init__(self, host: StepHost) -> None:
        self._host = host
        # The last decode step's rows, reused while the next steps have the same ones (decode_rows.py)
        self.steady: SteadyRows | None = None

    def forget_rows(self) -> None:
        """A new scheduler: nothing of the last decode step's rows carries over."""
        self.steady = None

    # ------------------------------------------------------------------ launch

    def launch(self, out: SchedulerOutput, *, guarded: bool) -> PlainLaunched | None:
        runner = self._host.runner
        wanting = self._wanting_prompt_logprobs(out)
        with forbid_cuda_sync(runner.device, enabled=guarded):
            batch = runner.prepare(out, all_logits_for=wanting) if wanting else runner.prepare(out)
        if batch is None:
            return None
        with forbid_cuda_sync(runner.device, enabled=guarded and runner.replays_graph(batch)):
            if not batch.prompt_spans:
                logits = runner.forward(batch)
            else:                            # a prefill step: never launched under the guard
                logits, all_logits = runner.forward_all(batch)
                self._add_prompt_logprobs(batch.prompt_spans, all_logits)
        return PlainLaunched(out, batch=batch, logits=logits, guarded=guarded)

    def _wanting_prompt_logprobs(self, out: SchedulerOutput) -> frozenset[str]:
        """Sequences of a prefill step whose prompt logprobs are not all in yet."""
        if out.kind is not StepKind.PREFILL:
            return frozenset()
        seq = self._host._seq
        return frozenset(chunk.seq_id for chunk in out.prefill
                         if (req := seq(chunk.seq_id)) is not None and req.prompt_logprobs is not None
                         and req.num_prompt_logprobs < req.num_prompt_tokens)

    def _add_prompt_logprobs(self, spans: tuple[tuple[str, int, int, int], ...], logits: torch.Tensor) -> None:
        """Prompt logprobs from a prefill step's every-row logits: the row at position p gives the
        logprob of prompt token p + 1 (a recomputed chunk adds nothing: those are in already)."""
        for seq_id, first_row, num_rows, start in spans:
            req = self._host._seq(seq_id)
            if req is None or req.finished or req.prompt_logprobs is None:
                continue
            low, high = max(req.num_prompt_logprobs, start + 1), min(req.num_prompt_tokens, start + num_rows + 1)
            if low >= high or low != req.num_prompt_logprobs:
                continue
            rows = logits[first_row + low - 1 - start:first_row + high - 1 - start]
            req.add_prompt_logprobs(*logprobs_of(rows, req.token_ids[low:high], req.params.prompt_logprobs or 0))

    # ------------------------------------------------------------------ sample

    def sample(self, handle: PlainLaunched) -> None:
        batch, logits, out = handle.batch, handle.logits, handle.out
        handle.logits = None
        seq_ids = batch.sample_seq_ids
        if not seq_ids or logits is None:
            return
        decode = out.decode if out.kind is StepKind.DECODE else None
        reqs = self._requests(seq_ids, None if decode is None else self._steady_of(decode.rows_generation))
        if out.kind is StepKind.PREFILL and any(r.unforked for r in reqs):
            logits, reqs = self._rows_per_sample(logits, reqs)   # n rows for a prefilled group
            seq_ids = tuple(r.seq_id for r in reqs)
        rows = self.step_rows(reqs, decode.rows_generation if decode is not None else None)
        host = self._host
        sampling = host.sampling.launch(seq_ids, logits, rows, guarded=handle.guarded)
        host.runner.record_sampled(batch, sampling.token_ids)
        handle.reqs, handle.sampling = reqs, sampling
        handle.steady_generation = None if self.steady is None else self.steady.generation

    def _steady_of(self, generation: int) -> SteadyRows | None:
        """The steady rows when decode rows of this generation are theirs, else None."""
        steady = self.steady
        return steady if steady is not None and steady.generation == generation else None

    def _requests(self, seq_ids: tuple[str, ...], steady: SteadyRows | None) -> list[Request]:
        """The request of each row (the steady rows' when the step has them)."""
        return steady.reqs if steady is not None else self.requests_of(seq_ids)

    def requests_of(self, seq_ids: tuple[str, ...]) -> list[Request]:
        """The request running as each of these scheduler sequences.

        Raises:
            KeyError: no request runs as one of them.
        """
        seqs = self._host._seqs
        try:
            return list(map(seqs.__getitem__, seq_ids))     # the common case: no fork branch id
        except KeyError:
            pass
        reqs: list[Request] = []
        for seq_id in seq_ids:
            req = self._host._seq(seq_id)
            if req is None:
                raise KeyError(f"no request runs as scheduler sequence {seq_id!r}")
            reqs.append(req)
        return reqs

    def _rows_per_sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, list[Request]]:
        """A prefill step's logits with the row of each group's sample 0 repeated for its other samples
        (a host decision: prefill steps are never launched under the sync guard)."""
        rows: list[int] = []
        expanded: list[Request] = []
        for row, req in enumerate(reqs):
            for sample in (req, *req.unforked):
                rows.append(row)
                expanded.append(sample)
        return logits.index_select(0, to_device(np.array(rows, dtype=np.int64), logits.device)), expanded

    def step_rows(self, reqs: list[Request], decode_generation: int | None = None) -> StepRows:
        """The sampling parameters of a step's rows, a few passes over its requests (no object per row).
        A request that ended since the step was scheduled samples unconstrained (its token is dropped).
        A row that needs a TokenHistory row gets one at its request's first sampled row, from the host's
        tokens (then complete: it is a prefill row, never one launched before the previous step is read).
        A decode step (`decode_generation`: its rows generation) of the same rows as the last one, none
        constrained or controlled, reuses its parameter lists (and so `SamplingStage` its
        `SamplingBatch`): `SteadyRows`."""
        steady = None if decode_generation is None else self._steady_of(decode_generation)
        if steady is not None:
            return steady.step_rows()
        self.steady = None
        controlled = any(r.controlled for r in reqs)
        if controlled:
            self._acquire_history_rows(reqs)
        rows = StepRows([r.params for r in reqs], [r.rng for r in reqs],
                        [len(r.token_ids) - r.num_prompt_tokens for r in reqs], self._grammars(reqs),
                        history_slots=[r.history_slot for r in reqs] if controlled else None,
                        bad_word_ids=[r.bad_word_ids for r in reqs] if controlled else None, controlled=controlled)
        if decode_generation is not None and rows.grammars is None and not controlled:   # nothing per row
            self.steady = SteadyRows(decode_generation, reqs, rows)                      # changes while it runs
        return rows

    def _grammars(self, reqs: list[Request]) -> list[GrammarState | None] | None:
        """Each row's grammar state (None for rows of requests ended since); None when no row has one."""
        if self._host.grammars is None:
            return None
        grammars = [None if r.finished else r.grammar for r in reqs]
        return grammars if any(g is not None for g in grammars) else None

    def _acquire_history_rows(self, reqs: list[Request]) -> None:
        """A TokenHistory row for each live request that needs one and has none yet."""
        history = self._host.sampling.history
        if history is None:
            raise RuntimeError("rows with logit controls need the sampling stage's TokenHistory")
        for r in reqs:
            if r.needs_history and r.history_slot is None and not r.finished:
                r.history_slot = history.acquire(r.prompt_token_ids, r.output_token_ids)

    # ------------------------------------------------------------------ commit

    def commit(self, handle: PlainLaunched, *, rows_unchanged: bool = False) -> Changed:
        changed: Changed = {}
        if handle.sampling is not None:
            self._post_process(handle, self._host.sampling.collect(handle.sampling), changed,
                               rows_unchanged=rows_unchanged)
        return changed

    def _post_process(self, handle: PlainLaunched, sampled: SampledStep, changed: Changed, *,
                      rows_unchanged: bool = False) -> None:
        """Take a step's sampled tokens. `rows_unchanged`: the caller knows that no request of this
        (decode) step has ended since it was launched."""
        steady, token_array, decode = self.steady, sampled.token_array, handle.out.decode
        if steady is not None and handle.steady_generation == steady.generation:
            if not (sampled.errors or handle.preempted or handle.recomputed or token_array is None or decode is None
                    or self._host.args.engine_type is EngineType.PROMPT):
                self._post_process_steady(handle, sampled, token_array, decode.seq_ids, changed, steady,
                                          rows_unchanged)
                return
            self.steady = None           # its output counts would go stale: rebuilt at the next launch
        continuing_ids: list[str] = []
        continuing_tokens: list[int] = []
        for req in handle.reqs:
            if req.unforked and not req.finished:
                self._fork(req)
        handed: list[str] = []
        self._post_process_rows(handle, sampled, range(len(handle.reqs)), changed, continuing_ids,
                                continuing_tokens, handed)
        self._record_tokens(handle.out.kind, continuing_ids, continuing_tokens)
        if handed:
            self._hand_over(handle.out, handed)

    def _hand_over(self, out: SchedulerOutput, seq_ids: list[str]) -> None:
        """A PROMPT engine: copy out the KV and state of the sequences this step prefilled while the
        scheduler still holds them, finish them there, and send them on (`LLMEngine`'s hooks)."""
        host = self._host
        host.pe_prepare_save_kvcache(seq_ids)
        for seq_id in seq_ids:
            req = host._seq(seq_id)
            reason = None if req is None else req.finish_reason
            host.scheduler.finish_seq(seq_id, FINISH_PREFILLED if reason is None else reason)
        host.pe_do_save_kvcache(seq_ids)
        host.send_processed_prompts(out)

    def _post_process_steady(self, handle: PlainLaunched, sampled: SampledStep, token_array: np.ndarray,
                             seq_ids: tuple[str, ...], changed: Changed, steady: SteadyRows,
                             rows_unchanged: bool) -> None:
        """A decode step of `steady`'s rows (`seq_ids`; `token_array` = sampled.token_array): the tokens
        that cannot end their request go in, in bulk (`SteadyRows.take_tokens`); the other rows go
        through `_post_process_rows`."""
        per_row = steady.take_tokens(token_array, sampled.token_ids, maybe_ended=not rows_unchanged)
        if not len(per_row):
            self._host.scheduler.append_decode_tokens(seq_ids, token_array[:, None], steady.ones)
            return
        continuing_ids: list[str] = []
        continuing_tokens: list[int] = []
        self._post_process_rows(handle, sampled, per_row.tolist(), changed, continuing_ids, continuing_tokens)
        steady.resync(per_row)
        if len(per_row) == len(seq_ids):        # every row went one by one (per-step output kinds)
            self._record_tokens(StepKind.DECODE, continuing_ids, continuing_tokens)
            return
        keep = np.ones(len(seq_ids), dtype=np.bool_)
        keep[per_row] = False
        kept_ids = [*compress(seq_ids, keep.tolist()), *continuing_ids]
        kept_tokens = np.concatenate([token_array[keep], np.array(continuing_tokens, dtype=np.int64)])
        self._record_tokens(StepKind.DECODE, kept_ids, kept_tokens.tolist())

    def _post_process_rows(self, handle: PlainLaunched, sampled: SampledStep, rows: Iterable[int],
                           changed: Changed, continuing_ids: list[str], continuing_tokens: list[int],
                           handed: list[str] | None = None) -> None:
        """Take the sampled tokens of these rows (ascending) one by one: stop checks, finishing, and the
        ids and tokens of the rows that go on (appended to continuing_ids / continuing_tokens). A PROMPT
        engine's rows that took their first token (`handed`, a prefill step's) are finished in the
        scheduler by `_hand_over`, once their KV is copied out."""
        host = self._host
        prompt_engine = host.args.engine_type is EngineType.PROMPT
        errors, ranks = sampled.errors, sampled.ranks
        preempted = handle.preempted | handle.recomputed
        reqs, token_ids, logprob_rows = handle.reqs, sampled.token_ids, sampled.logprobs
        for row in rows:
            req, token_id = reqs[row], token_ids[row]
            seq_id = req.seq_id
            if req.finish_reason is not None or (preempted and seq_id in handle.recomputed):
                self._drop_token(req)
                continue
            error = errors.get(row) if errors else None
            if error is not None:
                req.fail(error)
            else:
                req.add_token(token_id, logprob_rows[row], None if ranks is None else ranks[row])
            if prompt_engine and req.finish_reason is None:
                req.hand_over()
            if preempted and seq_id in handle.preempted:
                req.preempt()       # the scheduler has already freed it
                changed[req.request_id] = req.owner
            elif handed is not None and prompt_engine and req.finish_reason in _HANDED_OVER:
                changed[req.request_id] = req.owner
                handed.append(seq_id)
            elif req.finish_reason is not None:
                changed[req.request_id] = req.owner
                host.scheduler.finish_seq(seq_id, req.finish_reason)
            else:
                if req.reports_each_step:     # a FINAL_ONLY request that goes on reports nothing
                    changed[req.request_id] = req.owner
                continuing_ids.append(seq_id)
                continuing_tokens.append(token_id)

    def _drop_token(self, req: Request) -> None:
        """A row whose request ended (or went to be recomputed) since its step was launched: its token
        is dropped, and taken out of the request's TokenHistory row if it was counted there."""
        history = self._host.sampling.history
        if history is not None and req.history_slot is not None and not req.finished:
            history.reset(req.history_slot, req.prompt_token_ids, req.output_token_ids)

    def _fork(self, req: Request) -> None:
        """Fork sample 0's just-prefilled sequence for the group's other samples (each branch reads its
        sample's token list, equal to sample 0's prompt: no token is sampled yet)."""
        samples, req.unforked = req.unforked, []
        branch_ids = self._host.scheduler.fork_seq(req.seq_id, len(samples),
                                                   branch_lists=[s.token_ids for s in samples])
        expected = tuple(BranchId(s.seq_id) for s in samples)
        if branch_ids != expected:     # the ids _check_ids_free reserved
            raise RuntimeError(f"fork of {req.seq_id!r} gave {branch_ids}, expected {expected}")

    def _record_tokens(self, kind: StepKind, seq_ids: list[str], token_ids: list[int]) -> None:
        """Hand the scheduler the tokens of sequences that go on (one batched call for decode)."""
        if not seq_ids:
            return
        scheduler = self._host.scheduler
        if kind is StepKind.DECODE:
            tokens = np.array(token_ids, dtype=np.int64)[:, None]
            scheduler.append_decode_tokens(tuple(seq_ids), tokens, np.ones(len(seq_ids), dtype=np.int64))
        else:
            for seq_id, token in zip(seq_ids, token_ids):
                scheduler.append_tokens(seq_id, [token])


__all__ = ["PlainLaunched", "PlainStep", "StepHost"]
