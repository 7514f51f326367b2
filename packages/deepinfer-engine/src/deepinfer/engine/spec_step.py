"""Speculative decode steps with the DSpark draft head (DESIGN.md §6, docs/spec.md).

With `EngineArgs.speculative_decoding` the scheduler reserves k + 1 positions per decode row
(nextn = k) and asks `DraftGate` how many of them each row feeds. A speculative decode step runs
synchronously (ZOS off: every row's last token is on the host):

1. draft: `DSparkDraft.propose` from each drafting row's anchor (its last token, at position
   seq_len − k − 1); the rings hold the target's features of every committed position, written by
   earlier forwards.
2. verify forward (`ModelRunner.verify_forward`): rows [anchor, drafts[:q − 1]] in one varlen batch,
   logits of every row; it also writes the target features of those positions into the rings. Ring
   rows past the accepted run are overwritten by the next step before any draft reads them, and the
   scheduler gives the unused reserved positions back: nothing is copied back.
3. drafting rows: `deepinfer.spec.verify` (greedy: exact match; temperature > 0: rejection sampling
   with noise keyed by (seed, output position)). Rows that may not draft (`may_draft`: structured
   output, logit controls, top-k / top-p / min-p, min_tokens still banning EOS,
   DEEPINFER_SAMPLER_FORCE_TOPK) feed q = 1 and are sampled by the engine's `SamplingStage` as in a
   plain step.
4. commit: per row, `Request.add_token` token by token, so stop strings, EOS, stop ids and max_tokens
   end the run exactly at the token that ends the request; then one `Scheduler.append_decode_tokens`
   with the number of tokens kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deepinfer.model import ConfigError, DSparkDraft, ForwardBatch, WeightError, num_stages_in
from deepinfer.sched import DecodeBatch, Scheduler
from deepinfer.spec import (
    DraftSampler,
    FixedVerifyPolicy,
    ForwardRuntimeEstimator,
    SamplerRuntimeEstimator,
    VarlenVerifyPolicy,
    VerifyInput,
    cuda_graph_sizes,
    gather_verify_logits,
    profile_step_times,
    seed_to_int64,
    verify,
)

from .engine_args import EngineArgs, InvalidEngineArgs
from .env import EngineEnv, env_var_name
from .model_runner import ModelRunner
from .request import Request
from .sampler import MAX_LOGIT_MAGNITUDE
from .sampling_stage import NON_FINITE_LOGITS, SamplingStage, StepRows
from .staging import to_device


@dataclass(frozen=True, slots=True)
class SpeculativeStats:
    """Counts of speculative decoding since the engine started (all 0 with it off).

    Attributes:
        spec_verify_steps: decode steps that ran a verify forward.
        spec_verify_rows: request rows verified by `deepinfer.spec.verify` over those steps.
        spec_draft_tokens: drafts fed to the verify forwards (sum of query_len − 1 over those rows).
        spec_accepted_tokens: drafts accepted (before a stop or max_tokens cut the run).
    """

    spec_verify_steps: int = 0
    spec_verify_rows: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified row and step: accepted drafts + the target's own token (0 before any)."""
        if not self.spec_verify_rows:
            return 0.0
        return (self.spec_accepted_tokens + self.spec_verify_rows) / self.spec_verify_rows


def attach_draft_head(model: torch.nn.Module, args: EngineArgs, env: EngineEnv) -> DSparkDraft:
    """Build the checkpoint's DSpark draft head and attach it to `model` (its forward then captures
    the target features and its cache spec gains the draft rings).

    k = args.num_speculative_tokens, else DEEPINFER_USE_NEXTN_DECODE when > 0, else the model's
    dspark_block_size.

    Raises:
        InvalidEngineArgs: the checkpoint has no `mtp.*` tensors or no DSpark config, the draft
            weights do not fit, or DEEPINFER_MAX_BACKTRACKING_TOKENS < k + 1 (each names the field).
    """
    if num_stages_in(model.draft_weights) == 0:
        raise InvalidEngineArgs("speculative_decoding=True needs the checkpoint's DSpark draft head, but it has "
                                "no mtp.* tensors (draft weights)", "speculative_decoding")
    k = args.num_speculative_tokens or env.use_nextn_decode or model.cfg.dspark_block_size
    if k is None:
        raise InvalidEngineArgs("speculative_decoding=True needs a config with the DSpark fields "
                                "(dspark_block_size, dspark_noise_token_id, ...)", "speculative_decoding")
    if env.max_backtracking_tokens < k + 1:
        raise InvalidEngineArgs(f"{env_var_name('max_backtracking_tokens')}={env.max_backtracking_tokens} must be "
                                f">= num_speculative_tokens + 1 = {k + 1} (spare draft ring rows)",
                                "num_speculative_tokens")
    try:
        draft = DSparkDraft.from_model(model, expert_dtype=args.expert_dtype, block_size=k)
    except (ConfigError, WeightError) as err:
        raise InvalidEngineArgs(f"speculative_decoding=True: {err}", "speculative_decoding") from None
    model.attach_draft(draft)
    return draft


def may_draft(req: Request, force_top_k: int | None) -> bool:
    """Whether `req`'s next tokens can come from `deepinfer.spec.verify` (which samples from the raw
    distribution at temperature T): no grammar, no logit controls, no token banned by min_tokens, and
    greedy or temperature-only sampling."""
    params = req.params
    if req.grammar is not None or req.controlled or req.num_output_tokens < params.min_tokens:
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
    """Runs the engine's speculative decode steps (module docstring).

    Args:
        draft: the attached draft head (`attach_draft_head`).
        runner: the model runner (its cache holds the draft rings).
        args / env: the engine's; verify_policy "varlen" measures the step-time curve here, at start-up.
        lookup: the engine's request of a scheduler sequence id.
    """

    def __init__(self, draft: DSparkDraft, runner: ModelRunner, args: EngineArgs, env: EngineEnv,
                 lookup: Callable[[str], Request | None]) -> None:
        self.draft, self.runner, self.k = draft, runner, draft.block_size
        self._force_top_k = env.sampler_force_topk
        self._noise = np.random.default_rng(args.seed)      # seeds of unseeded sampled rows, drawn per step
        self.varlen: VarlenVerifyPolicy | None = None
        if args.verify_policy == "varlen":
            sizes = cuda_graph_sizes(args.max_num_seqs * (self.k + 1), env.cudagraph_batch_size_interval)
            curve = profile_step_times(self._time_dummy_step, sizes)
            self.varlen = VarlenVerifyPolicy(ForwardRuntimeEstimator(curve, interval=env.cudagraph_batch_size_interval),
                                             SamplerRuntimeEstimator())
        self.gate = DraftGate(self.varlen or FixedVerifyPolicy(), lookup, self._force_top_k)
        self._observed: set[str] = set()
        self._counts = np.zeros(4, dtype=np.int64)           # SpeculativeStats' fields, in order

    @property
    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(*map(int, self._counts))

    @torch.no_grad()
    def _time_dummy_step(self, total_q: int) -> float:
        """ms of one verify forward of total_q tokens (rows of up to k + 1 in the dummy slot 0): the graph
        replay `verify_forward` runs for that many tokens, else an eager multi-token decode."""
        graphs = self.runner.graphs
        if graphs is not None and graphs.bucket(total_q) is not None:      # what verify_forward replays
            graphs.inputs.zero_()                   # every token: position 0 of the dummy slot 0, block 0
            graphs.block_tables.zero_()
            torch.cuda.synchronize(self.runner.device)
            started = time.perf_counter()
            graphs.replay(total_q)
            torch.cuda.synchronize(self.runner.device)
            return (time.perf_counter() - started) * 1e3
        width = self.k + 1
        num_rows = -(-total_q // width)
        batch = ForwardBatch.multi_decode(np.zeros(total_q, dtype=np.int64), np.arange(total_q) % width,
                                          np.arange(total_q) // width, np.zeros((num_rows, 1), dtype=np.int32),
                                          np.zeros(num_rows, dtype=np.int64), max_query_len=width,
                                          device=self.runner.device)
        cuda = self.runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.runner.device)
        started = time.perf_counter()
        self.runner.model(batch, self.runner.cache, self.runner.ops)
        if cuda:
            torch.cuda.synchronize(self.runner.device)
        return (time.perf_counter() - started) * 1e3

    def step(self, d: DecodeBatch, reqs: list[Request], sampling: SamplingStage,
             step_rows: Callable[[list[Request]], StepRows], scheduler: Scheduler,
             changed: dict[str, Request]) -> None:
        """Run one speculative decode step of `d` (its rows' requests `reqs`) and commit its tokens."""
        if not d.num_seqs:
            return
        if d.last_token_ids.min() < 0:
            raise RuntimeError("a speculative decode step needs every row's last token on the host (ZOS off)")
        started = time.perf_counter()
        device, k = self.runner.device, self.k
        drafting = np.array([i for i, r in enumerate(reqs) if may_draft(r, self._force_top_k)], dtype=np.int64)
        tokens = torch.zeros((d.num_seqs, k + 1), dtype=torch.int64, device=device)
        tokens[:, 0] = to_device(d.last_token_ids.astype(np.int64), device)
        verifying = None
        if len(drafting):
            verifying = self._draft(d, [reqs[i] for i in drafting], drafting, tokens)
        logits = self.runner.verify_forward(d, tokens)
        rows: list[_RowTokens | None] = [None] * d.num_seqs
        if verifying is not None:
            for i, row in zip(drafting.tolist(), self._verify(d, logits, drafting, tokens, verifying)):
                rows[i] = row
        plain = [i for i, row in enumerate(rows) if row is None]
        if plain:
            first_rows = np.cumsum(d.query_lens.astype(np.int64)) - d.query_lens
            sub = [reqs[i] for i in plain]
            flight = sampling.launch(tuple(r.seq_id for r in sub),
                                     logits.index_select(0, to_device(first_rows[plain], device)), step_rows(sub))
            sampled = sampling.collect(flight)
            for j, i in enumerate(plain):
                rank = None if sampled.ranks is None else sampled.ranks[j]
                rows[i] = _RowTokens([sampled.token_ids[j]], [sampled.logprobs[j]], [rank], sampled.errors.get(j))
        if self.varlen is not None:
            self.varlen.forward.observe(int(d.query_lens.sum()), (time.perf_counter() - started) * 1e3)
        self._commit(reqs, rows, scheduler, changed)

    def _draft(self, d: DecodeBatch, sub: list[Request], drafting: np.ndarray, tokens: Tensor) -> _Verifying:
        """Propose k drafts for the drafting rows into tokens[drafting, 1:]."""
        device = self.runner.device
        seeds = [seed_to_int64(r.rng.seed) if r.rng is not None else int(self._noise.integers(0, 2**63))
                 for r in sub]
        host = np.stack((np.array(seeds, dtype=np.int64), np.array([r.num_output_tokens for r in sub]),
                         d.seq_lens[drafting].astype(np.int64) - (self.k + 1), d.state_slots[drafting],
                         drafting))
        staged = to_device(host, device)
        temperature = torch.tensor([0.0 if r.params.is_greedy else r.params.temperature for r in sub],
                                   dtype=torch.float32, device=device)
        sampler = DraftSampler(temperature, staged[0], staged[1])
        prop = self.draft.propose(tokens[staged[4], 0], staged[2], staged[3], self.runner.cache, sample=sampler,
                                  ops=self.runner.ops)
        tokens[staged[4], 1:] = prop.token_ids
        sampled = any(not r.params.is_greedy for r in sub)
        return _Verifying(sub, staged[4], sampler, sampler.draft_probs(prop.logits) if sampled else None,
                          prop.confidence)

    def _verify(self, d: DecodeBatch, logits: Tensor, drafting: np.ndarray, tokens: Tensor,
                v: _Verifying) -> list[_RowTokens]:
        """Verify the drafting rows; their tokens, logprobs and errors on the host."""
        device, k = self.runner.device, self.k
        query_lens = to_device(d.query_lens.astype(np.int64), device)
        target = gather_verify_logits(logits, query_lens, k + 1).index_select(0, v.rows)     # [m, k + 1, V]
        num_drafts = query_lens.index_select(0, v.rows) - 1
        result = verify(VerifyInput(target, tokens.index_select(0, v.rows)[:, 1:], num_drafts, v.sampler.temperature,
                                    v.draft_probs, v.sampler.seeds, v.sampler.output_positions))
        finite = (target.logsumexp(dim=-1).abs() <= MAX_LOGIT_MAGNITUDE).all(dim=-1)
        host = torch.cat((result.output_ids, result.num_accepted[:, None], finite[:, None].long(),
                          num_drafts[:, None]), dim=1).cpu().numpy()
        wanted = [r.params.logprobs for r in v.reqs]
        entries = _logprob_entries(target, result.output_ids, result.logprobs, wanted)
        confidence = v.confidence.cpu().numpy() if self.varlen is not None else None
        out = []
        for j, req in enumerate(v.reqs):
            num_out = int(host[j, k + 1]) + 1
            row_ids = host[j, :num_out].tolist()
            logprobs, ranks = entries[j] if entries is not None else ([None] * num_out, [None] * num_out)
            error = None if host[j, k + 2] else NON_FINITE_LOGITS
            out.append(_RowTokens(row_ids, logprobs[:num_out], ranks[:num_out], error))
            if confidence is not None:
                self.varlen.observe(req.seq_id, confidence[j])
        if confidence is not None:
            live = {r.seq_id for r in v.reqs}
            for seq_id in self._observed - live:
                self.varlen.forget(seq_id)
            self._observed = live
        self._counts += (1, len(v.reqs), int(host[:, k + 3].sum()), int(host[:, k + 1].sum()))
        return out

    def _commit(self, reqs: list[Request], rows: Sequence[_RowTokens | None], scheduler: Scheduler,
                changed: dict[str, Request]) -> None:
        """Feed each row's tokens to its request until it ends, then tell the scheduler what was kept."""
        seq_ids: list[str] = []
        kept_tokens: list[list[int]] = []
        for req, row in zip(reqs, rows):
            if req.finished or row is None:
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
class _Verifying:
    """The drafting rows of a step, between the draft and the verification."""

    reqs: list[Request]
    rows: Tensor                   # [m] int64 their rows in the step (device)
    sampler: DraftSampler          # temperature, seeds and first output positions of those rows
    draft_probs: Tensor | None     # [m, k, vocab] float32 q of the drafts; None when every row is greedy
    confidence: Tensor             # [m, k] float32 the draft head's acceptance estimates


def _logprob_entries(target: Tensor, output_ids: Tensor, logprobs: Tensor,
                     wanted: list[int | None]) -> list[tuple[list[dict[int, float] | None], list[int | None]]] | None:
    """Per verified row, the {token: logprob} of each emitted token plus its top alternatives (as many
    as the row's SamplingParams.logprobs; None where none were asked) and the token's rank; None when
    no row asked. Reads the device (after the step's tokens, already read)."""
    if all(w is None for w in wanted):
        return None
    num_top = min(max(w or 0 for w in wanted), target.shape[-1])
    chosen = target.gather(-1, output_ids.clamp(min=0)[..., None])
    ranks = ((target > chosen).sum(dim=-1) + 1).tolist()
    values = logprobs.tolist()
    ids = output_ids.tolist()
    top_ids = top_values = None
    if num_top:
        top_logits, top = target.topk(num_top, dim=-1)
        top_values = (top_logits - target.logsumexp(dim=-1, keepdim=True)).tolist()
        top_ids = top.tolist()
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
