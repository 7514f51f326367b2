"""Verify-length policies (docs/design.md §7.2): how many drafts each decode sequence verifies.

Both classes satisfy deepinfer.sched's `VerifyLengthPolicy` Protocol structurally
(`query_lens(seq_ids, seq_lens, max_query_len) -> [num_seqs] ints in [1, max_query_len]`); this
package never imports the scheduler.

Varlen: every request's drafts become candidates valued by the cumulative product of their
acceptance probabilities (so a request's own candidates come in order, a prefix); candidates are
sorted by value and added one by one to the "golden tokens only" step; each total query length is
scored by expected tokens / (forward ms at its graph size + sampler ms + the draft walk's ms for the
rows given a draft), and the best one wins. A row given none is a plain decode row: it runs no draft
walk, so where drafting does not pay the step costs what a plain decode step does. The confidences
are scaled by how far they have over- or under-stated acceptance so far (`AcceptanceCalibration`):
an overconfident head would otherwise buy drafts that are not accepted.

Re-probing: a request's estimate is its confidences of the last step it drafted, and a row given no
draft runs no draft walk, so nothing would ever refresh a low estimate (nor the calibration, once no
row drafts): one bad stretch (say the first drafts after an unusual prompt) would end speculation for
the request's lifetime. So a row the policy has kept plain for `reprobe_after` steps in a row is given
one draft (the cheapest walk: it refreshes the confidences of all its drafts and feeds the
calibration); while probes keep finding drafting not worth it, the wait doubles, up to
`max_reprobe_after` steps, so a request that truly cannot draft pays for at most one probe in that
many steps.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .estimators import DraftRuntimeEstimator, ForwardRuntimeEstimator, SamplerRuntimeEstimator


@dataclass(frozen=True, slots=True)
class VarlenPlan:
    """The chosen step: total query tokens, each sequence's query length, the expected throughput."""

    total_q: int
    query_lens: np.ndarray      # [num_seqs] int32, golden token + drafts, in [1, max_query_len]
    expected_tokens: float
    expected_ms: float


def choose_query_lens(acceptance: Sequence[Sequence[float]], max_query_len: int,
                      forward: ForwardRuntimeEstimator, sampler: SamplerRuntimeEstimator,
                      draft: DraftRuntimeEstimator | None = None, acceptance_scale: float = 1.0) -> VarlenPlan:
    """Greedy choice of total_q by expected throughput.

    Args:
        acceptance: per sequence, the estimated probability that each successive draft is accepted
            given the previous ones were (e.g. the drafter's confidences); missing entries count 0.
        max_query_len: golden token + drafts available per sequence (nextn + 1).
        forward / sampler: ms of the verify forward by total query tokens, of the sampling by sequences.
        draft: ms of the draft walk by the number of rows given at least one draft (None: free).
        acceptance_scale: multiplies every draft's probability of being reached and accepted (the
            cumulative products; capped at 1): `AcceptanceCalibration.factor`.
    Returns:
        the plan maximising expected tokens per ms (ties: the shorter step); all ones (no row drafts)
        when no draft pays for its share of the forward and of the draft walk.
    """
    num_seqs = len(acceptance)
    if num_seqs == 0:
        return VarlenPlan(0, np.zeros(0, dtype=np.int32), 0.0, 0.0)
    num_drafts = max_query_len - 1
    rates = np.zeros((num_seqs, num_drafts))
    for i, given in enumerate(acceptance):
        r = np.clip(np.asarray(given, dtype=np.float64)[:num_drafts], 0.0, 1.0)
        rates[i, :len(r)] = r
    values = np.minimum(np.cumprod(rates, axis=1) * max(acceptance_scale, 0.0), 1.0).ravel()   # row-major: a
    # request's own in order
    order = np.argsort(-values, kind="stable")
    row_of = order // max(num_drafts, 1)
    # a row's first draft comes before its others (stable sort of non-increasing cumulative products),
    # so the rows drafting among the first n candidates are those whose first draft is among them
    first_draft = np.zeros(len(order), dtype=np.int64)
    first_draft[np.unique(row_of, return_index=True)[1]] = 1
    # candidate n = 0 (golden tokens only) … len(order), scored all at once
    tokens = num_seqs + np.concatenate(([0.0], np.cumsum(values[order])))
    ms = forward.estimate_ms_many(num_seqs + np.arange(len(order) + 1)) + sampler.estimate_ms(num_seqs)
    if draft is not None:
        ms = ms + draft.estimate_ms_many(np.concatenate(([0], np.cumsum(first_draft))))
    rate = np.divide(tokens, ms, out=np.zeros_like(tokens), where=ms > 0)
    best_n = int(np.argmax(rate))                # the first of equal rates: the shorter step
    lens = np.ones(num_seqs, dtype=np.int32)
    if best_n:
        np.add.at(lens, row_of[:best_n], 1)
    return VarlenPlan(num_seqs + best_n, lens, float(tokens[best_n]), float(ms[best_n]))


def drafting_can_pay(max_num_seqs: int, max_query_len: int, forward: ForwardRuntimeEstimator,
                     sampler: SamplerRuntimeEstimator, draft: DraftRuntimeEstimator | None = None) -> bool:
    """Whether drafting pays at any batch size, even with every draft accepted: `choose_query_lens`
    with acceptance 1 gives some row a draft at 1, 2, 4, … or max_num_seqs sequences. False means
    speculative decoding can only lose on this device (say, a CPU whose forward time grows with
    every query token): decode plainly."""
    counts = sorted({*(1 << i for i in range(max(max_num_seqs, 1).bit_length())), max(max_num_seqs, 1)})
    perfect = [1.0] * (max_query_len - 1)
    return any(choose_query_lens([perfect] * n, max_query_len, forward, sampler, draft).total_q > n
               for n in counts if n <= max_num_seqs)


class AcceptanceCalibration:
    """How far the drafter's confidences over- or under-state acceptance: the drafts accepted over the
    number the confidences predicted (the sum of their cumulative products over the drafts verified),
    over the last `window` verified rows, starting from `prior_rows` rows of `prior_expected` predicted
    and as many accepted (a factor of 1 until rows say otherwise)."""

    def __init__(self, *, window: int = 1000, prior_rows: int = 8, prior_expected: float = 1.0) -> None:
        self._rows: deque[tuple[float, int]] = deque(maxlen=window)
        self._prior = prior_rows * prior_expected
        self._expected = self._accepted = 0.0

    def observe(self, expected: float, accepted: int) -> None:
        """One verified row: the accepted drafts its confidences predicted, and those accepted."""
        if len(self._rows) == self._rows.maxlen:
            old_expected, old_accepted = self._rows[0]
            self._expected -= old_expected
            self._accepted -= old_accepted
        self._rows.append((expected, accepted))
        self._expected += expected
        self._accepted += accepted

    @property
    def factor(self) -> float:
        """Accepted / predicted over the window, the prior included (> 0)."""
        return (self._prior + max(self._accepted, 0.0)) / (self._prior + max(self._expected, 0.0))


class VarlenVerifyPolicy:
    """docs/design.md §7.2's varlen verify: per-request acceptance estimates in, query lengths out.

    The engine reports each request's latest draft confidences with `observe` (under ZOS: those of
    step N − 2 when choosing step N) and drops finished requests with `forget`; a request with no
    estimate yet uses `default_acceptance`, and `calibration` (fed each verified row by the engine)
    scales them by how far they have over- or under-stated acceptance. `draft`: the draft walk's cost
    (None: free).
    `plain_only`: drafting cannot pay on this device (`drafting_can_pay`): every row gets 1.
    `reprobe_after` / `max_reprobe_after`: a row kept plain this many steps in a row is given one draft
    (module docstring); each probe that does not bring drafting back doubles the wait, up to the max.

    Raises:
        ValueError: reprobe_after < 1 or max_reprobe_after < reprobe_after.
    """

    def __init__(self, forward: ForwardRuntimeEstimator, sampler: SamplerRuntimeEstimator, *,
                 draft: DraftRuntimeEstimator | None = None, default_acceptance: Sequence[float] = (0.8,),
                 plain_only: bool = False, reprobe_after: int = 8, max_reprobe_after: int = 256) -> None:
        if not 1 <= reprobe_after <= max_reprobe_after:
            raise ValueError(f"reprobe_after={reprobe_after} must be >= 1 and <= max_reprobe_after="
                             f"{max_reprobe_after}")
        self.forward, self.sampler, self.draft = forward, sampler, draft
        self.plain_only = plain_only
        self.calibration = AcceptanceCalibration()
        self._default = tuple(float(r) for r in default_acceptance)
        self._rates: dict[str, tuple[float, ...]] = {}
        self.reprobe_after, self.max_reprobe_after = reprobe_after, max_reprobe_after
        self._plain_steps: dict[str, int] = {}     # steps in a row the policy kept the row plain
        self._wait: dict[str, int] = {}            # plain steps before its next probe (absent: reprobe_after)
        self.last_plan: VarlenPlan | None = None

    def observe(self, seq_id: str, acceptance: Sequence[float]) -> None:
        """Per-draft acceptance probabilities of `seq_id`'s next drafts (e.g. sigmoid confidences)."""
        self._rates[seq_id] = tuple(float(r) for r in acceptance)

    def forget(self, seq_id: str) -> None:
        self._rates.pop(seq_id, None)
        self._plain_steps.pop(seq_id, None)
        self._wait.pop(seq_id, None)

    def rates(self, seq_id: str, num_drafts: int) -> tuple[float, ...]:
        """`seq_id`'s estimated acceptance of each of its next num_drafts drafts: the latest observed
        (0 past their end), else `default_acceptance` (its last value repeated past its end)."""
        rates = self._rates.get(seq_id)
        if rates is None:
            return (self._default + (self._default[-1],) * max(num_drafts - len(self._default), 0))[:num_drafts]
        return (rates + (0.0,) * max(num_drafts - len(rates), 0))[:num_drafts]

    def query_lens(self, seq_ids: tuple[str, ...], seq_lens: np.ndarray, max_query_len: int) -> np.ndarray:
        """Query lengths of one decode batch (the scheduler's VerifyLengthPolicy)."""
        if self.plain_only:
            return np.ones(len(seq_ids), dtype=np.int32)
        plan = choose_query_lens([self.rates(s, max_query_len - 1) for s in seq_ids], max_query_len,
                                 self.forward, self.sampler, self.draft, self.calibration.factor)
        if max_query_len > 1:
            plan = self._reprobe(seq_ids, plan)
        self.last_plan = plan
        return plan.query_lens

    def _reprobe(self, seq_ids: tuple[str, ...], plan: VarlenPlan) -> VarlenPlan:
        """Give one draft to each row kept plain for its wait (module docstring); count the others."""
        lens = plan.query_lens
        probes = []
        for i, seq_id in enumerate(seq_ids):
            if lens[i] > 1:                       # the policy drafts it again: waits back to the start
                self._wait.pop(seq_id, None)
                self._plain_steps[seq_id] = 0
                continue
            wait = self._wait.get(seq_id, self.reprobe_after)
            plain_steps = self._plain_steps.get(seq_id, 0) + 1
            if plain_steps >= wait:
                probes.append(i)
                self._wait[seq_id] = min(2 * wait, self.max_reprobe_after)
                plain_steps = 0
            self._plain_steps[seq_id] = plain_steps
        if not probes:
            return plan
        lens = lens.copy()
        lens[probes] = 2
        return dataclasses.replace(plan, total_q=int(lens.sum()), query_lens=lens)


class FixedVerifyPolicy:
    """Verify every draft: each sequence's query length is max_query_len."""

    def query_lens(self, seq_ids: tuple[str, ...], seq_lens: np.ndarray, max_query_len: int) -> np.ndarray:
        return np.full(len(seq_ids), max_query_len, dtype=np.int32)


def query_lens_by_confidence(confidence: Tensor, total_q: int) -> Tensor:
    """On the device: split a fixed total_q among sequences by their drafts' confidences (the ZOS
    path: total_q was fixed on the host from older estimates, the split uses the newest).

    Args:
        confidence: [num_seqs, num_drafts] float32 per-draft acceptance probabilities.
        total_q: total query tokens, in [num_seqs, num_seqs · (num_drafts + 1)] (host int).
    Returns:
        [num_seqs] int64 query lengths summing to total_q: 1 + the number of each sequence's drafts
        among the total_q − num_seqs highest cumulative products (ties: lower sequence, earlier draft).
    """
    num_seqs, num_drafts = confidence.shape
    extra = total_q - num_seqs
    if not 0 <= extra <= num_seqs * num_drafts:
        raise ValueError(f"total_q={total_q} outside [{num_seqs}, {num_seqs * (num_drafts + 1)}]")
    values = torch.cumprod(confidence.float().clamp(0, 1), dim=1).flatten()
    order = torch.sort(values, descending=True, stable=True).indices[:extra]
    counts = torch.zeros(num_seqs, dtype=torch.int64, device=confidence.device)
    counts.index_add_(0, order // max(num_drafts, 1), torch.ones_like(order))
    return counts + 1

