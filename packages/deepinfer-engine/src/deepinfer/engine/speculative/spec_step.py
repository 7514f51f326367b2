"""Speculative decode steps with the DSpark draft head (docs/design.md §7, docs/spec.md).

With `EngineArgs.num_speculative_tokens` = k > 0 the scheduler reserves k + 1 positions per decode
row (nextn = k) and asks `DraftGate` how many of them each row feeds. `SpeculativeDecoder` is the
`steps.Step` of decode steps: `launch` (1–2 below), `sample` (3, on the device) and `commit` (4, on
the host). With ZOS off the engine runs them back to back; with ZOS on it commits step N while step
N + 1 runs: N + 1 was launched before N's tokens reached the host, so a row with a step in flight
(`DecodeBatch.in_flight`) takes its anchor and its place on the device (`ModelRunner.row_tokens` /
`row_emitted`: the in-flight step emitted 1 … k + 1 tokens of the k + 1 positions reserved for it;
the scheduler had placed N + 1 after all of them, so its positions move back by the difference).

1. draft: `DSparkDraft.propose` from each drafting row's anchor (its last token, at position
   seq_len − k − 1 minus that difference); the rings hold the target's features of every committed
   position, written by earlier forwards.
2. verify forward (`ModelRunner.verify_forward`): rows [anchor, drafts[:q − 1]] in one varlen batch,
   logits of every row; it also writes the target features of those positions into the rings. Ring
   rows past the accepted run are overwritten by the next step before any draft reads them, and the
   scheduler gives the unused reserved positions back: nothing is copied back.
3. drafting rows: `deepinfer.spec.verify` (greedy: exact match; temperature > 0: rejection sampling
   with noise keyed by (seed, output position)); a structured-output row verifies against the target
   masked at each position by its grammar after the drafts before it (`_grammar_masks`: the matcher
   accepts them one by one, then rolls back). Rows that may not draft (`may_draft`: logit controls,
   top-k / top-p / min-p, min_tokens still banning EOS, DEEPINFER_SAMPLER_FORCE_TOPK) feed q = 1 and
   are sampled by the engine's `SamplingStage` as in a plain step, as are rows the varlen policy
   gave q = 1 (their draft walk is not run).
4. commit: per row, `Request.add_token` token by token, so stop strings, EOS, stop ids and max_tokens
   end the run exactly at the token that ends the request; then one `Scheduler.append_decode_tokens`
   with the number of tokens kept. Under ZOS a request's end is seen one step late: the step in flight
   ran its row too, and those tokens are dropped (as a plain ZOS step's one token is).

Under ZOS the varlen policy splits step N + 1's verify lengths on the host from the confidences of
step N − 1 (the last one read); the seed recomputes the split on the device from step N's.

The varlen policy's estimators learn from real steps: each step's draft walk, verify forward and
verification + sampling are timed on the device's own timeline (`_Stopwatch`: CUDA events, read once
they have happened — at the step's commit or a later one, never a wait of their own; the host clock
on the CPU, where the work runs synchronously), with ZOS on and off alike, and fed to
`DraftRuntimeEstimator.observe` (drafting rows), `ForwardRuntimeEstimator.observe` (total query
tokens) and `SamplerRuntimeEstimator.observe` (rows).

Lockstep ranks (DP attention + EP MoE, `spec_lockstep.SpecLockstep`) agree on each decode step's
verify size after the vote: a rank pads its verify forward to it, and a rank without decode rows
runs a dummy verify forward of it (`idle_verify`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from deepinfer.model import ConfigError, DSparkDraft, WeightError, num_stages_in
from deepinfer.sched import DecodeBatch, SchedulerOutput
from deepinfer.spec import (
    DraftSampler,
    FixedVerifyPolicy,
    VarlenVerifyPolicy,
    VerifyInput,
    gather_verify_logits,
    query_lens_by_confidence,
    seed_to_int64,
    verify,
)

from ..config.engine_args import EngineArgs, InvalidEngineArgs
from ..config.env import EngineEnv, env_var_name
from ..core.plain_step import PlainStep, StepHost
from ..core.request import Request
from ..core.steps import Changed, Launched
from ..device.staging import to_device, to_host
from ..device.sync_guard import forbid_cuda_sync
from ..sampling.sampler import MAX_LOGIT_MAGNITUDE
from ..sampling.sampling_stage import NON_FINITE_LOGITS, InFlightSampling
from ..sampling.token_bitmask import allocate_token_bitmask, apply_token_bitmask, unpack_token_bitmask
from .draft_graphs import (
    ANCHOR,
    FIRST,
    IN_FLIGHT,
    OUTPUTS,
    POSITION,
    QUERY_LEN,
    ROW,
    SEED,
    SLOT,
    DraftGraphs,
    DraftWalk,
)
from .draft_graphs import STAGED_ROWS as DRAFT_STAGED_ROWS
from .spec_dummy import DummySpecSteps
from .spec_lockstep import SpecLockstep
from .varlen_profile import varlen_policy
from .verify_tails import VerifyTails


@dataclass(frozen=True, slots=True)
class SpeculativeStats:
    """Counts of speculative decoding since the engine started (all 0 with it off).

    Attributes:
        spec_verify_steps: decode steps that ran a verify forward.
        spec_verify_rows: request rows verified by `deepinfer.spec.verify` over those steps.
        spec_draft_tokens: drafts fed to the verify forwards (sum of query_len − 1 over those rows).
        spec_accepted_tokens: drafts accepted (before a stop or max_tokens cut the run).
        spec_draft_ms / spec_verify_ms / spec_sample_ms: the device time of every speculative decode
            step's draft walk, verify forward and verification + sampling (`_Stopwatch`; a step
            counts once its marks have been read, at its commit or a later one).
    """

    spec_verify_steps: int = 0
    spec_verify_rows: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_ms: float = 0.0
    spec_verify_ms: float = 0.0
    spec_sample_ms: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified row and step: accepted drafts + the target's own token (0 before any)."""
        if not self.spec_verify_rows:
            return 0.0
        return (self.spec_accepted_tokens + self.spec_verify_rows) / self.spec_verify_rows


def attach_draft_head(model: torch.nn.Module, args: EngineArgs, env: EngineEnv) -> DSparkDraft:
    """Build the checkpoint's DSpark draft head and attach it to `model` (its forward then captures
    the target features and its cache spec gains the draft rings), for args.num_speculative_tokens > 0.

    k = args.num_speculative_tokens.

    Raises:
        InvalidEngineArgs: the checkpoint has no `mtp.*` tensors or no DSpark config, the draft
            weights do not fit, or DEEPINFER_MAX_BACKTRACKING_TOKENS < k + 1 (each names the field).
    """
    asked = f"num_speculative_tokens={args.num_speculative_tokens}"
    if num_stages_in(model.draft_weights) == 0:
        raise InvalidEngineArgs(f"{asked} needs the checkpoint's DSpark draft head, but it has no mtp.* tensors "
                                "(mtp.0.* … in model.safetensors or mtp.safetensors)", "num_speculative_tokens")
    if model.cfg.dspark_block_size is None:
        raise InvalidEngineArgs(f"{asked} needs a config with the DSpark fields (dspark_block_size, "
                                "dspark_noise_token_id, ...)", "num_speculative_tokens")
    k = args.num_speculative_tokens
    if env.max_backtracking_tokens < k + 1:
        raise InvalidEngineArgs(f"{env_var_name('max_backtracking_tokens')}={env.max_backtracking_tokens} must be "
                                f">= num_speculative_tokens + 1 = {k + 1} (spare draft ring rows)",
                                "num_speculative_tokens")
    try:
        draft = DSparkDraft.from_model(model, expert_dtype=args.expert_dtype, block_size=k)
    except (ConfigError, WeightError) as err:
        raise InvalidEngineArgs(f"{asked}: {err}", "num_speculative_tokens") from None
    model.attach_draft(draft)
    return draft


def may_draft(req: Request, force_top_k: int | None) -> bool:
    """Whether `req`'s next tokens can come from `deepinfer.spec.verify` (which samples from the raw
    distribution at temperature T, masked by the request's grammar if it has one): no logit controls,
    no token banned by min_tokens, and greedy or temperature-only sampling."""
    params = req.params
    if req.controlled or req.num_output_tokens < params.min_tokens:
        return False
    return params.is_greedy or (force_top_k is None and params.top_k <= 0 and params.top_p >= 1.0
                                and params.min_p == 0)


class DraftGate:
    """The scheduler's `VerifyLengthPolicy`: rows that may not draft feed 1 token; the others get
    the verify policy's lengths (fixed: all k drafts; varlen: chosen by expected throughput)."""

    def __init__(self, inner: FixedVerifyPolicy | VarlenVerifyPolicy, lookup: Callable[[str], Request | None],
                 force_top_k: int | None) -> None:
        self.inner, self._lookup, self._force_top_k = inner, lookup, force_top_k

    def query_lens(self, seq_ids: tuple[str, ...], seq_lens: np.ndarray, max_query_len: int) -> np.ndarray:
        lookup, force_top_k = self._lookup, self._force_top_k
        drafting = [i for i, seq_id in enumerate(seq_ids)
                    if (req := lookup(seq_id)) is not None and may_draft(req, force_top_k)]
        lens = np.ones(len(seq_ids), dtype=np.int32)
        if drafting:
            lens[drafting] = self.inner.query_lens(tuple(seq_ids[i] for i in drafting), seq_lens[drafting],
                                                   max_query_len)
        return lens


@dataclass(frozen=True, slots=True)
class _RowTokens:
    """One row's tokens of a speculative step, in output order."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    ranks: list[int | None]
    error: str | None = None


class SpeculativeDecoder:
    """The `steps.Step` of speculative decode steps (module docstring).

    Args:
        draft: the attached draft head (`attach_draft_head`).
        host: the engine (its runner's cache holds the draft rings; its scheduler, sampling stage and
            requests are read at each step).
        plain: the engine's plain step: the sampling parameters of rows that do not draft.
        args / env: the engine's; varlen_verify measures the policy's curves here, at start-up
            (or loads them from DEEPINFER_VARLEN_PROFILE_CACHE: varlen_profile.py).
        lockstep: the DP + EP group this rank steps with (None: a rank of its own).
    """

    def __init__(self, draft: DSparkDraft, host: StepHost, plain: PlainStep, args: EngineArgs,
                 env: EngineEnv, lockstep: SpecLockstep | None = None) -> None:
        runner = host.runner
        self.draft, self.runner, self.k = draft, runner, draft.block_size
        self._host, self._plain = host, plain
        self._stopwatch = _Stopwatch(runner.device)
        self._force_top_k = env.sampler_force_topk
        self._noise = np.random.default_rng(args.seed)      # seeds of unseeded sampled rows, drawn per step
        self.lockstep = lockstep
        # the draft walk and the all-greedy verification on static buffers: CUDA graphs wherever the
        # verify forwards replay graphs
        self.draft_graphs = DraftGraphs(draft, runner, max_rows=args.max_num_seqs,
                                        interval=env.cudagraph_batch_size_interval, capture=runner.graphs is not None)
        self.tails = VerifyTails(runner, k=self.k, max_rows=args.max_num_seqs, capture=runner.graphs is not None)
        self.dummy = DummySpecSteps(draft, runner, self.draft_graphs)
        self.varlen: VarlenVerifyPolicy | None = None
        if args.varlen_verify:
            self.varlen = varlen_policy(self.dummy, runner, args, env, lockstep)     # curves cached in a file
        self._timings: list[SpecTimings] = []     # measured steps whose marks the device has not all passed
        self.gate = DraftGate(self.varlen or FixedVerifyPolicy(), host._seq, self._force_top_k)
        self._observed: set[str] = set()
        self._row_confidence = torch.full((0, self.k), -1.0, dtype=torch.float32, device=runner.device)
        self._counts = np.zeros(4, dtype=np.int64)           # SpeculativeStats' counts, in order
        self._measured_ms = np.zeros(3, dtype=np.float64)     # and its measured ms, in order

    @property
    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(*map(int, self._counts), *map(float, self._measured_ms))

    @torch.no_grad()
    def idle_verify(self) -> int:
        """A lockstep rank without decode rows while its peers decode: join the step's size agreement
        and run a dummy verify forward of that size (its MoE exchanges meet the peers'). Returns the
        size (0: no rank had decode rows, nothing ran)."""
        if self.lockstep is None:
            return 0
        size = self.lockstep.graph_size(0)
        if size:
            self.dummy.verify_forward(size)
        return size

    # ------------------------------------------------------------------ the Step protocol

    def launch(self, out: SchedulerOutput, *, guarded: bool) -> SpecLaunched | None:
        """Draft and launch the verify forward of decode step `out` (`launch_forward`)."""
        d = out.decode
        if d is None or not d.num_seqs:
            self.idle_verify()             # a lockstep rank's peers may verify: join them
            return None
        reqs = self._plain.requests_of(d.seq_ids)
        return SpecLaunched(out, reqs, work=self.launch_forward(d, reqs, guarded=guarded), guarded=guarded)

    def sample(self, handle: SpecLaunched) -> None:
        """Verify the drafting rows and sample the others (`launch_accept`)."""
        launched = handle.work
        if not isinstance(launched, SpecLaunch):
            raise RuntimeError("SpeculativeDecoder.sample: this step was sampled already")
        handle.work = self.launch_accept(launched, guarded=handle.guarded)   # drops the verify logits

    def commit(self, handle: SpecLaunched, *, rows_unchanged: bool = False) -> Changed:
        """Read the step's results and commit its tokens (`commit_flight`)."""
        flight = handle.work
        if not isinstance(flight, SpecFlight):
            raise RuntimeError("SpeculativeDecoder.commit: this step was not sampled")
        changed: Changed = {}
        self.commit_flight(flight, changed, preempted=handle.preempted, recomputed=handle.recomputed)
        return changed

    # ------------------------------------------------------------------ the phases

    def launch_forward(self, d: DecodeBatch, reqs: list[Request], *, guarded: bool = False) -> SpecLaunch:
        """Draft and launch the verify forward of decode step `d`, reading nothing from the device: ZOS
        launches it before the previous step's tokens are on the host. Rows whose step is in flight
        (`DecodeBatch.in_flight`) take their anchor from `ModelRunner.row_tokens` and their place from
        `row_emitted`: that step used row_emitted of the k + 1 positions the scheduler reserved for it.
        The draft walk runs on `DraftGraphs`' static buffers (one CUDA graph replay where captured);
        when every row drafts, it also gives the verify forward its tokens and moves. `guarded`: a ZOS
        launch: it runs under `forbid_cuda_sync`, the draft walk and the verify forward too when they
        replay CUDA graphs (eager, they run the model's eager kernels, whose CPU twins read the host)."""
        device, runner = self.runner.device, self.runner
        n = d.num_seqs
        # rows given drafts to verify (`DraftGate`: those that may draft, as the policy chose); a row the
        # policy gave q = 1 is sampled as a plain row, and its draft walk is not run
        drafting = np.flatnonzero(d.query_lens > 1)
        total_q = int(d.query_lens.sum())
        in_flight = bool(d.in_flight.any())             # ZOS: a step of some rows is in flight
        with forbid_cuda_sync(device, enabled=guarded):
            runner.ensure_rows(int(d.rows.max()) + 1)
        if self._all_static(d, reqs, drafting, in_flight):
            return self._launch_static(d, reqs, guarded)
        drafted_from = self._stopwatch.mark()
        drafted = self._draft(d, reqs, drafting, guarded) if len(drafting) else None
        verifying = None if drafted is None else drafted[1]
        with forbid_cuda_sync(device, enabled=guarded):
            if drafted is not None and len(drafting) == n:
                walk = drafted[0]
                tokens, shift = walk.tokens[:n], walk.shift[:n] if in_flight else None
                rows = self.draft_graphs.inputs[ROW, :n]
                flying = self.draft_graphs.inputs[IN_FLIGHT, :n] != 0 if in_flight else None
            else:
                tokens, shift, rows, flying = self._anchors(d, in_flight)
                if drafted is not None:
                    tokens[:, 1:].index_copy_(0, drafted[1].rows, drafted[0].tokens[:len(drafting), 1:])
            query_lens = None
            if flying is not None and self.varlen is not None and verifying is not None:
                query_lens = self._split_on_device(d, verifying, rows, flying, self.varlen)
        size = total_q if self.lockstep is None else self.lockstep.graph_size(total_q)   # the group's, >= own key
        with forbid_cuda_sync(device, enabled=guarded and runner.verify_replays_graph(size)):
            started = self._stopwatch.mark()
            logits = runner.verify_forward(d, tokens, shift, query_lens, graph_size=size)
            forwarded = self._stopwatch.mark()
        if query_lens is None:
            query_lens = to_device(d.query_lens.astype(np.int64), device)
        return SpecLaunch(d, reqs, drafting, rows, logits, tokens, verifying, query_lens,
                          (drafted_from, started, forwarded), size)

    def _all_static(self, d: DecodeBatch, reqs: list[Request], drafting: np.ndarray, in_flight: bool) -> bool:
        """Whether the whole step runs on static buffers (`_launch_static`): every row drafts, greedily,
        without a grammar or logprobs, the host's query lengths stand (ZOS + varlen splits them again on
        the device, after the layout is fixed), and the rank steps alone (a lockstep group pads its verify
        forward to the group's size)."""
        return (len(drafting) == d.num_seqs and not (in_flight and self.varlen is not None)
                and self.lockstep is None and self.tails.usable(d.rows)
                and all(r.params.is_greedy and r.grammar is None and r.params.logprobs is None for r in reqs))

    def _launch_static(self, d: DecodeBatch, reqs: list[Request], guarded: bool) -> SpecLaunch:
        """`launch_forward` of a step of greedy drafting rows, laid out on the host: the draft walk
        (`DraftGraphs`) writes the verify forward's tokens and positions, the verify forward
        (`ModelRunner.verify_forward_static`) and then `VerifyTails` (`launch_accept`) read them; on CUDA
        three graph replays and host-to-device copies, nothing else."""
        device, runner, n = self.runner.device, self.runner, d.num_seqs
        query_lens = d.query_lens.astype(np.int64)
        token_rows = np.repeat(np.arange(n), query_lens)
        starts = np.cumsum(query_lens) - query_lens
        columns = np.arange(len(token_rows)) - starts[token_rows]
        with forbid_cuda_sync(device, enabled=guarded):
            size = runner.stage_verify_static(d, token_rows)      # before the walk writes into its inputs
            self.tails.stage(token_rows, columns, d.rows, query_lens, size)
        drafted_from = self._stopwatch.mark()
        walk, verifying = self._draft(d, reqs, np.arange(n), guarded, starts, query_lens)
        with forbid_cuda_sync(device, enabled=guarded and runner.verify_replays_graph(len(token_rows))):
            started = self._stopwatch.mark()
            logits = runner.verify_forward_static(d, token_rows)
            forwarded = self._stopwatch.mark()
        rows = self.draft_graphs.inputs[ROW, :n]
        return SpecLaunch(d, reqs, np.arange(n), rows, logits, walk.tokens[:n], verifying,
                          to_device(query_lens, device), (drafted_from, started, forwarded), len(token_rows),
                          tail_size=size)

    def _anchors(self, d: DecodeBatch, in_flight: bool) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """Every row's anchor and move, for a step with rows that do not draft: ([num_seqs, k + 1] int64
        tokens with the anchors in column 0, [num_seqs] shift or None, [num_seqs] scheduler rows,
        [num_seqs] bool rows whose step is in flight or None), all on the device."""
        device, k, runner = self.runner.device, self.k, self.runner
        n = d.num_seqs
        host = np.empty((3 if in_flight else 2, n), dtype=np.int64)
        host[0] = d.last_token_ids
        host[1] = d.rows
        if in_flight:
            host[2] = d.in_flight
        staged = to_device(host, device)
        anchors, rows = staged[0], staged[1]
        shift = flying = None
        if in_flight:
            flying = staged[2] != 0
            emitted = torch.where(flying, runner.row_emitted.index_select(0, rows), 0)
            anchors = torch.where(flying, runner.row_tokens.index_select(0, rows), anchors)
            shift = torch.where(flying, k + 1 - emitted, 0)
        tokens = torch.zeros((n, k + 1), dtype=torch.int64, device=device)
        tokens[:, 0] = anchors
        return tokens, shift, rows, flying

    def _split_on_device(self, d: DecodeBatch, v: _Verifying, rows: Tensor, in_flight: Tensor,
                         varlen: VarlenVerifyPolicy) -> Tensor:
        """docs/design.md §7.5, under ZOS: the drafting rows' total query tokens stay the host's choice (it
        picked the graph, from the confidences of the last step read), split again on the device by
        the confidences of the step in flight (`query_lens_by_confidence`); a row whose last step did
        not draft, or is not in flight, keeps its host estimate. Returns [num_seqs] int64 query lengths
        (1 for rows that do not draft)."""
        k, device = self.k, self.runner.device
        estimates = np.array([varlen.rates(r.seq_id, k) for r in v.reqs], dtype=np.float32).reshape(-1, k)
        sub_rows = v.rows
        self._ensure_confidence_rows(self.runner.row_tokens.shape[0])
        latest = self._row_confidence.index_select(0, rows.index_select(0, sub_rows))
        fresh = in_flight.index_select(0, sub_rows)[:, None] & (latest[:, :1] >= 0)
        confidence = torch.where(fresh, latest, to_device(estimates, device))
        split = query_lens_by_confidence(confidence, int(d.query_lens[v.rows_host].sum()))
        return torch.ones(d.num_seqs, dtype=torch.int64, device=device).index_copy_(0, sub_rows, split)

    def _ensure_confidence_rows(self, num_rows: int) -> None:
        """Grow `_row_confidence` ([rows, k] float32: the drafts' confidences of each scheduler row's
        last step, −1 where it did not draft) to num_rows rows (device-side copy, no wait)."""
        if num_rows > self._row_confidence.shape[0]:
            grown = torch.full((num_rows, self.k), -1.0, dtype=torch.float32, device=self.runner.device)
            grown[: self._row_confidence.shape[0]] = self._row_confidence
            self._row_confidence = grown

    def _draft(self, d: DecodeBatch, reqs: list[Request], drafting: np.ndarray, guarded: bool,
               first: np.ndarray | None = None, query_lens: np.ndarray | None = None) -> tuple[DraftWalk, _Verifying]:
        """The draft walk of the drafting rows (`drafting`, rows of the step) on `DraftGraphs`; with
        `first` / `query_lens` (every row drafts) it also writes the verify forward's inputs there."""
        k, device, graphs = self.k, self.runner.device, self.draft_graphs
        sub, m = [reqs[i] for i in drafting], len(drafting)
        host = np.empty((DRAFT_STAGED_ROWS, m), dtype=np.int64)
        host[ANCHOR] = d.last_token_ids[drafting]
        host[ROW] = d.rows[drafting]
        np.subtract(d.seq_lens[drafting], k + 1, out=host[POSITION])     # the anchor's place, nothing in flight
        host[OUTPUTS] = [r.num_output_tokens for r in sub]
        host[SLOT] = d.state_slots[drafting]
        host[IN_FLIGHT] = d.in_flight[drafting]
        host[SEED] = [seed_to_int64(r.rng.seed) if r.rng is not None else int(self._noise.integers(0, 2**63))
                      for r in sub]
        host[FIRST] = 0 if first is None else first
        host[QUERY_LEN] = 0 if query_lens is None else query_lens
        temperature = np.array([0.0 if r.params.is_greedy else r.params.temperature for r in sub], dtype=np.float32)
        with forbid_cuda_sync(device, enabled=guarded):
            size = graphs.stage(host, temperature)
        with forbid_cuda_sync(device, enabled=guarded and graphs.replays_graph(size)):
            walk = graphs.replay(size)
        with forbid_cuda_sync(device, enabled=guarded):
            sampler = DraftSampler(graphs.temperature[:m], graphs.inputs[SEED, :m], walk.output_positions[:m])
            drafts = walk.tokens[:m, 1:]
            sampled = any(not r.params.is_greedy for r in sub)
            constrained = [j for j, r in enumerate(sub) if r.grammar is not None]
            drafts_to_host = None
            if constrained:   # their masks need the drafts on the host: copied now, read after N − 1's commit
                drafts_to_host = to_host((drafts.index_select(0, to_device(np.array(constrained), device)),))
            verifying = _Verifying(sub, to_device(drafting, device), drafting, sampler,
                                   sampler.draft_probs(walk.logits[:m]) if sampled else None, walk.confidence[:m],
                                   constrained, drafts_to_host)
        return walk, verifying

    def launch_accept(self, launched: SpecLaunch, *, guarded: bool = False) -> SpecFlight:
        """Verify the drafting rows and sample the others on the device, keep each row's last token and
        count in the runner (for the next step, launched before this one is read), and start copying the
        results back. `guarded`: a ZOS launch (the plain rows' sampling runs under the sync guard)."""
        v = launched.verifying
        if launched.tail_size:
            if v is None:
                raise ValueError("a step verified by VerifyTails has drafting rows (SpecLaunch.verifying)")
            return self._accept_static(launched, v, guarded)
        d, reqs, device = launched.d, launched.reqs, self.runner.device
        results: tuple[Tensor, ...] = ()
        logprob_parts: tuple[Tensor, ...] = ()
        confidence: tuple[Tensor, ...] = ()
        wanted: list[int | None] = []
        dead: dict[int, str] = {}
        if v is not None:
            results, logprob_parts, confidence, dead = self._launch_verify(launched, v, guarded)
            wanted = [r.params.logprobs for r in v.reqs]
        drafted = set(launched.drafting.tolist())
        plain = [i for i in range(d.num_seqs) if i not in drafted]
        flight = None
        if plain:
            sub = [reqs[i] for i in plain]
            plain_index = to_device(np.array(plain, dtype=np.int64), device)
            with forbid_cuda_sync(device, enabled=guarded):
                first_rows = torch.cumsum(launched.query_lens, 0) - launched.query_lens
                logits = launched.logits.index_select(0, first_rows.index_select(0, plain_index))
            flight = self._host.sampling.launch(tuple(r.seq_id for r in sub), logits, self._plain.step_rows(sub),
                                                guarded=guarded)
            plain_rows = launched.rows.index_select(0, plain_index)
            self.runner.record_emitted(plain_rows, flight.token_ids, torch.ones_like(flight.token_ids))
            if self.varlen is not None:
                self._ensure_confidence_rows(self.runner.row_tokens.shape[0])
                self._row_confidence.index_fill_(0, plain_rows, -1.0)
        sampled = self._stopwatch.mark()            # before the copy back, whose event the commit waits for
        host, done = to_host(results + logprob_parts + confidence)
        num_parts = len(logprob_parts)
        timings = SpecTimings((*launched.marks, sampled), len(launched.drafting), launched.size, d.num_seqs)
        return SpecFlight(reqs, launched.drafting, plain, host[0] if host else None, host[1:1 + num_parts],
                          host[-1] if confidence else None, done, flight, wanted, dead, timings)

    def _accept_static(self, launched: SpecLaunch, v: _Verifying, guarded: bool) -> SpecFlight:
        """`launch_accept` of a `_launch_static` step (`v`: its drafting rows, every row): `VerifyTails`
        verifies every row and records its last token and count (a CUDA graph replay on CUDA), then the
        results start for the host."""
        d, device = launched.d, self.runner.device
        n = d.num_seqs
        with forbid_cuda_sync(device, enabled=guarded):
            results = self.tails.replay(launched.tail_size, launched.logits)[:n]
            confidence: tuple[Tensor, ...] = ()
            if self.varlen is not None:
                self._ensure_confidence_rows(self.runner.row_tokens.shape[0])
                self._row_confidence.index_copy_(0, launched.rows, v.confidence.float())
                confidence = (v.confidence,)
            sampled = self._stopwatch.mark()        # before the copy back, whose event the commit waits for
            host, done = to_host((results,) + confidence)
        timings = SpecTimings((*launched.marks, sampled), n, launched.size, n)
        return SpecFlight(launched.reqs, launched.drafting, [], host[0], (), host[1] if confidence else None, done,
                          None, [None] * n, {}, timings)

    def _launch_verify(self, launched: SpecLaunch, v: _Verifying, guarded: bool
                       ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...], dict[int, str]]:
        """Verify the drafting rows on the device and keep their last token and count in the runner;
        returns the tensors to copy back: ([m, k + 4] results,), `_logprob_tensors`' parts, (confidences,)
        under the varlen policy (else ()), and the rows failed by their grammar (index into v.reqs ->
        why). Rows with a grammar verify against the target masked by it (`_grammar_masks`)."""
        device, k = self.runner.device, self.k
        masks, dead = (None, {}) if v.drafts_to_host is None else self._grammar_masks(v, v.drafts_to_host)
        mask_words = None if masks is None else masks.numpy()         # host memory: no device read
        with forbid_cuda_sync(device, enabled=guarded):
            query_lens = launched.query_lens
            target = gather_verify_logits(launched.logits, query_lens, k + 1).index_select(0, v.rows)  # [m, k + 1, V]
            processed = None
            if masks is not None:
                positions = np.array(v.constrained, dtype=np.int64)[:, None] * (k + 1) + np.arange(k + 1)
                flat = target.reshape(-1, target.shape[-1])
                processed = apply_token_bitmask(flat, to_device(mask_words, device),
                                                to_device(positions.reshape(-1), device)).view(target.shape)
            num_drafts = query_lens.index_select(0, v.rows) - 1
            result = verify(VerifyInput(target, launched.tokens.index_select(0, v.rows)[:, 1:], num_drafts,
                                        v.sampler.temperature, v.draft_probs, v.sampler.seeds,
                                        v.sampler.output_positions, processed))
            finite = (target.logsumexp(dim=-1).abs() <= MAX_LOGIT_MAGNITUDE).all(dim=-1)
            step_rows = launched.rows.index_select(0, v.rows)
            self.runner.record_emitted(step_rows, result.output_ids.gather(1, result.num_accepted[:, None])[:, 0],
                                       result.num_accepted + 1)
            if self.varlen is not None:
                self._ensure_confidence_rows(self.runner.row_tokens.shape[0])
                self._row_confidence.index_copy_(0, step_rows, v.confidence.float())
            results = torch.cat((result.output_ids, result.num_accepted[:, None], finite[:, None].long(),
                                 num_drafts[:, None]), dim=1)
            logprob_parts = _logprob_tensors(target, result.output_ids, result.logprobs,
                                             [r.params.logprobs for r in v.reqs])
        return (results,), logprob_parts, (v.confidence,) if self.varlen is not None else (), dead

    def _grammar_masks(self, v: _Verifying, drafts_to_host: tuple[tuple[Tensor, ...], torch.cuda.Event | None]
                       ) -> tuple[Tensor, dict[int, str]]:
        """The token masks of the rows with a grammar at each of their k + 1 positions (host work): the
        mask at position j is the grammar's after the row's drafts before j, which the matcher accepts
        one by one and then rolls back (their tokens go in at the commit). Past a draft the grammar
        rejects, or past its end, positions stay open: the verification stops there anyway (the masked
        target never equals a rejected draft). Waits for the drafts' copy (queued before the verify
        forward, so not for the forward).

        Returns:
            ([len(v.constrained) · (k + 1), ceil(vocab / 32)] int32 bitmask, position by position; the
            rows whose grammar allows no token at all (index into v.reqs -> why)).
        """
        k = self.k
        (drafts,), done = drafts_to_host
        if done is not None:
            done.synchronize()
        vocab = self.runner.model.cfg.vocab_size
        masks = allocate_token_bitmask(len(v.constrained) * (k + 1), vocab)
        masks.fill_(-1)                                                  # open: every token allowed
        dead: dict[int, str] = {}
        for i, (j, row_drafts) in enumerate(zip(v.constrained, drafts.tolist())):
            req = v.reqs[j]
            grammar = None if req.finished else req.grammar
            if grammar is None:
                continue                  # ended since it was scheduled: its tokens are dropped
            num_outputs = req.num_output_tokens
            advanced = 0
            for position in range(k + 1):
                if position and grammar.is_terminated:
                    break                 # nothing follows the grammar's end: the rest stays open
                grammar.fill_bitmask(masks, i * (k + 1) + position, expected_num_tokens=num_outputs + advanced)
                if position == k or grammar.accept_tokens(row_drafts[position:position + 1]) == 0:
                    break
                advanced += 1
            grammar.rollback(advanced)
            if not unpack_token_bitmask(masks[i * (k + 1):i * (k + 1) + 1], vocab).any():
                dead[j] = f"grammar dead end after {num_outputs} output tokens: no token is allowed"
        return masks, dead

    def commit_flight(self, flight: SpecFlight, changed: Changed, *, preempted: Collection[str] = (),
                      recomputed: Collection[str] = ()) -> None:
        """Read a launched step's results (waiting only for their copy) and commit its tokens.

        Args:
            preempted / recomputed: ZOS: ids of rows preempted for good / for recompute since the step
                was scheduled (`LLMEngine`'s in-flight step): the first still take their tokens and then
                finish as "preempted"; the second drop theirs.
        """
        rows: list[_RowTokens | None] = [None] * len(flight.reqs)
        if flight.results is not None:
            if flight.done is not None:
                flight.done.synchronize()
            for i, row in zip(flight.drafting.tolist(), self._verified_rows(flight, flight.results)):
                rows[i] = row
        if flight.sampling is not None:
            sampled = self._host.sampling.collect(flight.sampling)
            for j, i in enumerate(flight.plain):
                rank = None if sampled.ranks is None else sampled.ranks[j]
                rows[i] = _RowTokens([sampled.token_ids[j]], [sampled.logprobs[j]], [rank], sampled.errors.get(j))
        self._observe_times(flight)
        self._commit(flight.reqs, rows, changed, preempted, recomputed)

    def _observe_times(self, flight: SpecFlight) -> None:
        """Count (`SpeculativeStats`) and feed the varlen policy's estimators the measured draft walk,
        verify forward and verification + sampling times of every step whose marks the device has
        passed (this one's, read now that its results are on the host, or a later commit's: never a
        wait of their own)."""
        self._timings.append(flight.timings)
        pending: list[SpecTimings] = []
        varlen = self.varlen
        for timings in self._timings:
            times = self._stopwatch.phases_ms(timings.marks)
            if times is None:
                pending.append(timings)
                continue
            draft_ms, forward_ms, sampler_ms = times
            self._measured_ms += times
            if varlen is None:
                continue
            if timings.num_drafting and varlen.draft is not None:
                varlen.draft.observe(timings.num_drafting, draft_ms)
            varlen.forward.observe(timings.total_q, forward_ms)
            varlen.sampler.observe(timings.num_rows, sampler_ms)
        self._timings = pending[-8:]        # a mark the device never reaches (a failed step) is not kept forever

    def _verified_rows(self, flight: SpecFlight, results: Tensor) -> list[_RowTokens]:
        """The drafting rows' tokens, logprobs and errors from the host copies (`results`: flight.results)."""
        k, varlen = self.k, self.varlen
        host = results.numpy()
        entries = _logprob_entries(host[:, :k + 1], flight.logprob_parts, flight.wanted)
        confidence = None if flight.confidence is None or varlen is None else flight.confidence.numpy()
        reqs = [flight.reqs[i] for i in flight.drafting.tolist()]
        out = []
        for j, req in enumerate(reqs):
            num_out = int(host[j, k + 1]) + 1
            logprobs: list[dict[int, float] | None] = [None] * num_out
            ranks: list[int | None] = [None] * num_out
            if entries is not None:
                logprobs, ranks = entries[j]
            error = flight.dead.get(j) or (None if host[j, k + 2] else NON_FINITE_LOGITS)
            out.append(_RowTokens(host[j, :num_out].tolist(), logprobs[:num_out], ranks[:num_out], error))
            if confidence is not None and varlen is not None:
                varlen.observe(req.seq_id, confidence[j])
        if confidence is not None and varlen is not None:
            # how far the confidences over- or under-stated acceptance: the drafts they predicted accepted
            # (cumulative products over the drafts fed) against those accepted
            fed = np.arange(k) < host[:, k + 3, None]
            predicted = (np.cumprod(np.clip(confidence, 0.0, 1.0), axis=1) * fed).sum(axis=1)
            for expected, accepted, drafts in zip(predicted.tolist(), host[:, k + 1].tolist(), host[:, k + 3].tolist()):
                if drafts:
                    varlen.calibration.observe(expected, accepted)
            live = {r.seq_id for r in reqs}
            for seq_id in self._observed - live:
                varlen.forget(seq_id)
            self._observed = live
        self._counts += (1, len(reqs), int(host[:, k + 3].sum()), int(host[:, k + 1].sum()))
        return out

    def _commit(self, reqs: list[Request], rows: Sequence[_RowTokens | None], changed: Changed,
                preempted: Collection[str], recomputed: Collection[str]) -> None:
        """Feed each row's tokens to its request until it ends, then tell the scheduler what was kept.
        A row whose request ended (or went to be recomputed) since the step was launched drops its
        tokens; a row preempted for good takes them and finishes as "preempted"."""
        sampling, scheduler = self._host.sampling, self._host.scheduler
        seq_ids: list[str] = []
        kept_tokens: list[list[int]] = []
        for req, row in zip(reqs, rows):
            if row is None:
                continue
            if req.finished or req.seq_id in recomputed:
                if sampling.history is not None and req.history_slot is not None and not req.finished:
                    # its token was counted: take it out
                    sampling.history.reset(req.history_slot, req.prompt_token_ids, req.output_token_ids)
                continue
            kept: list[int] = []
            if row.error is not None:
                req.fail(row.error)
            else:
                for token_id, logprobs, rank in zip(row.token_ids, row.logprobs, row.ranks):
                    req.add_token(token_id, logprobs, rank)
                    kept.append(token_id)
                    if req.finished:
                        break
            if req.seq_id in preempted:
                req.preempt()               # the scheduler has already freed it
                changed[req.request_id] = req.owner
                continue
            if req.finished:
                changed[req.request_id] = req.owner
                scheduler.finish_seq(req.seq_id, req.finish_reason)
                continue
            if req.reports_each_step:
                changed[req.request_id] = req.owner
            seq_ids.append(req.seq_id)
            kept_tokens.append(kept)
        if seq_ids:
            tokens = np.zeros((len(seq_ids), self.k + 1), dtype=np.int64)
            for i, kept in enumerate(kept_tokens):
                tokens[i, :len(kept)] = kept
            scheduler.append_decode_tokens(tuple(seq_ids), tokens,
                                           np.array([len(kept) for kept in kept_tokens], dtype=np.int64))


@dataclass(frozen=True, slots=True)
class SpecLaunch:
    """A speculative decode step between its verify forward and its verification."""

    d: DecodeBatch
    reqs: list[Request]
    drafting: np.ndarray           # [m] int64 rows that drafted, ascending
    rows: Tensor                   # [num_seqs] int64 scheduler row of each row (device)
    logits: Tensor                 # [sum(query_lens), vocab] float32 of the verify forward
    tokens: Tensor                 # [num_seqs, k + 1] int64 anchor and drafts (device)
    verifying: _Verifying | None   # the drafting rows' sampler, q and confidences; None when m = 0
    query_lens: Tensor             # [num_seqs] int64 query length of each row (device): d.query_lens, or
                                   # their split on the device under ZOS + varlen
    marks: tuple[_Mark, _Mark, _Mark]   # `_Stopwatch` marks before the draft walk, before and after the
                                        # verify forward
    size: int                      # tokens the verify forward ran: total query tokens, padded to the
                                   # lockstep group's size
    tail_size: int = 0             # > 0: verified by `VerifyTails` at this size (`_launch_static`); 0: outside


@dataclass(frozen=True, slots=True)
class SpecFlight:
    """A launched speculative decode step whose results are on their way to the host (`commit`).

    Attributes:
        reqs: the request of each row, in row order.
        drafting: [m] int64 rows verified by `deepinfer.spec.verify`, ascending; plain: the other rows,
            sampled by the engine's `SamplingStage` (`sampling`, None when there are none).
        results / logprob_parts / confidence: host copies (pinned on CUDA) of the drafting rows' [m, k + 4]
            int64 (output ids, accepted count, 1 = finite logits, drafts fed), of `_logprob_tensors`' parts
            (empty when no row asked for logprobs) and of their confidences [m, k] float32 (varlen policy
            only, else None); results is None when m = 0.
        done: the CUDA event after the copies (None on the CPU).
        wanted: SamplingParams.logprobs of each drafting row.
        dead: drafting rows (index among them) whose grammar allows no token -> why (they fail).
        timings: the step's marks, for the varlen policy's estimators.
    """

    reqs: list[Request]
    drafting: np.ndarray
    plain: list[int]
    results: Tensor | None
    logprob_parts: tuple[Tensor, ...]
    confidence: Tensor | None
    done: torch.cuda.Event | None
    sampling: InFlightSampling | None
    wanted: list[int | None]
    dead: dict[int, str]
    timings: SpecTimings


@dataclass(frozen=True, slots=True)
class SpecTimings:
    """The `_Stopwatch` marks of one speculative step: before the draft walk, before and after the verify
    forward, after the verification and sampling; what they measured: drafting rows (0: no walk ran),
    tokens of the verify forward, rows."""

    marks: tuple[_Mark, _Mark, _Mark, _Mark]
    num_drafting: int
    total_q: int
    num_rows: int


@dataclass(slots=True, eq=False)
class SpecLaunched(Launched):
    """A speculative decode step between its launch and its commit. `work`: its verify forward's
    outputs (`SpecLaunch`) until `sample`, then its results on their way to the host (`SpecFlight`);
    `guarded`: launched to stay in flight."""

    work: SpecLaunch | SpecFlight = field(kw_only=True)
    guarded: bool = False


class _Mark(Protocol):
    """A point on the device's timeline (`_Stopwatch.mark`); a `torch.cuda.Event` with timing on CUDA."""

    def query(self) -> bool:
        """Whether the device has passed it."""

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this mark to `end` (a later mark of the same stopwatch)."""


@dataclass(frozen=True, slots=True)
class _HostMark:
    """A `_Mark` on the host clock (CPU devices: their forwards and sampling run synchronously)."""

    seconds: float            # time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _HostMark) -> float:
        return (end.seconds - self.seconds) * 1e3


class _Stopwatch:
    """Marks on the device's timeline, read after the step's results are on the host: CUDA events
    with timing on CUDA (not read while the later one has not happened: never a wait), the host clock
    on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"

    def mark(self) -> _Mark:
        if not self._cuda:
            return _HostMark(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def phases_ms(self, marks: Sequence[_Mark]) -> tuple[float, ...] | None:
        """The milliseconds between each two consecutive marks; None while the device has not passed
        the last one."""
        if not marks[-1].query():
            return None
        return tuple(first.elapsed_time(second) for first, second in zip(marks, marks[1:]))


@dataclass(frozen=True, slots=True)
class _Verifying:
    """The drafting rows of a step, between the draft and the verification."""

    reqs: list[Request]
    rows: Tensor                   # [m] int64 their rows in the step (device)
    rows_host: np.ndarray          # the same rows, on the host
    sampler: DraftSampler          # temperature, seeds and first output positions of those rows
    draft_probs: Tensor | None     # [m, k, vocab] float32 q of the drafts; None when every row is greedy
    confidence: Tensor             # [m, k] float32 the draft head's acceptance estimates
    constrained: list[int]         # indices into reqs of the rows with a grammar
    drafts_to_host: tuple[tuple[Tensor, ...], torch.cuda.Event | None] | None   # their drafts [len, k]
                                   # being copied to the host (`to_host`); None without such rows


def _logprob_tensors(target: Tensor, output_ids: Tensor, logprobs: Tensor,
                     wanted: list[int | None]) -> tuple[Tensor, ...]:
    """What the verified rows' logprob entries need, on the device (empty when no row asked): the emitted
    tokens' ranks [m, k + 1] int64 and logprobs [m, k + 1] float32, then, when a row asked for
    alternatives, the top ids [m, k + 1, t] and their logprobs (t = the largest count asked)."""
    if all(w is None for w in wanted):
        return ()
    chosen = target.gather(-1, output_ids.clamp(min=0)[..., None])
    parts: tuple[Tensor, ...] = ((target > chosen).sum(dim=-1) + 1, logprobs.float())
    num_top = min(max(w or 0 for w in wanted), target.shape[-1])
    if num_top:
        top_logits, top = target.topk(num_top, dim=-1)
        parts += (top, top_logits - target.logsumexp(dim=-1, keepdim=True))
    return parts


def _logprob_entries(output_ids: np.ndarray, parts: tuple[Tensor, ...],
                     wanted: list[int | None]) -> list[tuple[list[dict[int, float] | None], list[int | None]]] | None:
    """Per verified row, the {token: logprob} of each emitted token plus its top alternatives (as many
    as the row's SamplingParams.logprobs; None where none were asked) and the token's rank; None when
    no row asked. `output_ids` [m, k + 1] and `_logprob_tensors`' parts, on the host."""
    if all(w is None for w in wanted):
        return None
    ranks, values = parts[0].tolist(), parts[1].tolist()
    top_ids, top_values = (parts[2].tolist(), parts[3].tolist()) if len(parts) >= 4 else (None, None)
    ids = output_ids.tolist()
    out: list[tuple[list[dict[int, float] | None], list[int | None]]] = []
    for j, w in enumerate(wanted):
        if w is None:
            out.append(([None] * len(ids[j]), [None] * len(ids[j])))
            continue
        entries: list[dict[int, float] | None] = []
        for step, token_id in enumerate(ids[j]):
            entry = {token_id: values[j][step]}
            if w and top_ids is not None and top_values is not None:
                for alt, value in zip(top_ids[j][step][:w], top_values[j][step][:w]):
                    entry.setdefault(alt, value)
            entries.append(entry)
        out.append((entries, list(ranks[j])))
    return out
