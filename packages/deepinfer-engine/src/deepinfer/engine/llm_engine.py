"""LLMEngine: requests in, one scheduler step + one model step per `step()`, outputs out.

One step (docs/design.md §2), owned here: schedule → apply the cache ops → (1) launch the forward of step
N → (2) collect and post-process step N − 1 if it is still in flight → (3) launch sampling of step N
→ (4) pre_sampler_sync (grammar pump) → post-process step N at once, or, for a ZOS decode step, keep it
in flight for the next call.

ZOS (docs/design.md §6, `EngineArgs.zero_overhead_scheduling`): the host schedules and launches decode step
N + 1 before it has read step N's tokens; the runner feeds N's sampled tokens to N + 1 on the device.
A request's end (EOS, stop string, max_tokens) is therefore seen one step late: its row of step N + 1
runs, and its token is dropped; the scheduler gives back that step's reservation when the request is
finished. A sequence preempted for recompute while a step of it is in flight has that step's token
dropped too (the recompute produces it again: a seeded request's noise is keyed by position).
Structured-output rows need no special case: step N's tokens reach the grammars in (2), before step
N + 1's masks are filled in (3). Each ZOS launch runs under `forbid_cuda_sync`. Penalties and bad
words read the tokens sampled so far from a `TokenHistory` on the device, which the sampler updates
itself (a token dropped for recompute is taken out again by rebuilding the row from the host).

Parallel samples (SamplingParams.n > 1, `ParallelRequest`): in-flight rows and scheduler sequences
are samples (`Request` objects, `_seqs` by sequence id); `_requests` holds what is reported (a
`Request`, or the `ParallelRequest` of its samples). Sample 0 is prefilled; its prefill row is
sampled n times (one row per sample, each with its own seed), then the sequence is forked for
samples 1..n − 1 before their first tokens are appended. A sample's row is dropped once it ends, like
any request's; the request is reported finished when every sample is.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from deepinfer.cache import BlockManager
from deepinfer.model import (
    ConfigError,
    DeepseekV4Config,
    DeepseekV41Config,
    ExpertSlots,
    WeightError,
    apply_expert_parallel,
    load_model,
)
from deepinfer.sched import (
    EngineType,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepKind,
    StepVoteGroup,
)

from .decode_rows import SteadyRows
from .engine_args import EngineArgs, InvalidEngineArgs
from .env import EngineEnv, read_env
from .grammar_compiler import GrammarCompilePool
from .intake import RequestIntake
from .logit_controls import TokenHistory
from .model_runner import ModelRunner, default_block_size, state_slot_bytes
from .outputs import (
    FINISH_PREFILLED,
    OutputKind,
    RequestOutput,
)
from .prefix_caching import num_prefix_snapshots, prefix_cache_key, record_cached_tokens
from .request import ParallelRequest, Request
from .sampler import Sampler, logprobs_of
from .sampling_stage import InFlightSampling, SampledStep, SamplingStage, StepRows
from .spec_step import SpecFlight, SpeculativeDecoder, SpeculativeStats, attach_draft_head
from .staging import to_device
from .sync_guard import forbid_cuda_sync
from .tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


# With nothing to run but requests waiting for their grammar, `step()` waits this long for a compile.
IDLE_GRAMMAR_WAIT_S = 0.05


@dataclass(frozen=True, slots=True)
class _InFlightStep:
    """A launched step whose sampled tokens are not post-processed yet.

    Attributes:
        out: the scheduler's output for the step.
        reqs: the request of each sampled row, in row order (objects, not ids: an id may be reused by a
            new request before this step is post-processed).
        sampling: the launched sampling (None for a speculative step).
        recomputed: ids of rows preempted for recompute since the step was scheduled: their token is
            dropped (the recompute samples it again).
        preempted: ids of rows preempted for good since the step was scheduled (the scheduler has
            freed them): their token still counts, then the request finishes as "preempted", as it
            would have with the step post-processed before the preemption.
        spec: a speculative decode step's launched verification (spec_step.py); None for plain steps.
    """

    out: SchedulerOutput
    reqs: list[Request]
    sampling: InFlightSampling | None
    recomputed: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    spec: SpecFlight | None = None


def _zos_with_drafts(args: EngineArgs) -> bool:
    """Whether speculative decode steps run under ZOS: on CUDA only when zero_overhead_scheduling=True
    asks for it (not yet run on a GPU)."""
    return torch.device(args.device).type != "cuda" or args.zero_overhead_scheduling is True


@dataclass(frozen=True, slots=True)
class ExpertParallelSetup:
    """An expert-parallel rank's share of the routed experts, for `LLMEngine(expert_parallel=...)`.

    Attributes:
        group: the EP process group (every rank of it builds its engine with the same slots).
        rank: this rank's index in `group`.
        slots: one placement per MoE layer, in `deepinfer.model.moe_layers` order.
    """

    group: dist.ProcessGroup
    rank: int
    slots: tuple[ExpertSlots, ...]


def resolve_model_dir(model: str | None) -> Path:
    """The model folder: `model`, or the embedded default shipped with deepinfer-model."""
    if model is None:
        try:
            from deepinfer.model import embedded_model_dir
        except ImportError:
            raise InvalidEngineArgs("model=None needs the embedded default model, which this "
                                    "deepinfer-model has not shipped; pass model=<folder>") from None
        return Path(embedded_model_dir())
    path = Path(model)
    try:
        is_dir = path.is_dir()
    except OSError as error:          # a name too long for the file system, a permission fault, ...
        raise InvalidEngineArgs(f"model={_shortened(model)} cannot be a folder: {error.strerror}") from None
    if not is_dir:
        raise InvalidEngineArgs(f"model={_shortened(model)} is not a folder (expected config.json + model.safetensors)")
    return path


def _shortened(text: str, limit: int = 200) -> str:
    """repr(text), cut to about `limit` characters with its length said when longer."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _check_v41_options(cfg: object, args: EngineArgs) -> None:
    """Refuse the DeepSeek-V4.1-only options for a model without the layers they act on."""
    if args.engram_on_host and not getattr(cfg, "engram_layer_ids", ()):
        raise InvalidEngineArgs("engram_on_host=True needs a model with Engram layers (DeepSeek-V4.1); this "
                                "model has none", "engram_on_host")
    if args.yoco_prefill_truncation_mode != "off" and not isinstance(cfg, DeepseekV41Config):
        raise InvalidEngineArgs(f"yoco_prefill_truncation_mode={args.yoco_prefill_truncation_mode!r} needs a "
                                "DeepSeek-V4.1 model (its KV-source / consumer layers); use 'off' for this model",
                                "yoco_prefill_truncation_mode")


class LLMEngine(RequestIntake):
    """The engine of one DP rank: request intake (`add_request`, `prepare_request`, `enqueue`,
    `abort_request`) comes from `RequestIntake` (intake.py), the step loop is here.

    Args:
        args: validated EngineArgs.
        env: engine environment (defaults: read once from os.environ).
        vote_group: the DP group the scheduler's step-kind vote runs over; None = a single rank.
        expert_parallel: this rank's share of the routed experts (`parallel.DPRank` builds it): a
            DeepSeek-V4 safetensors checkpoint loads its slots' experts alone (`experts_sharded`),
            other models whole; the exchange is attached (`apply_expert_parallel`, decode steps
            sized for max_num_seqs tokens per rank) before the decode CUDA graphs are captured, so
            they capture the fixed-capacity EP decode step.

    Raises:
        InvalidEngineArgs: unknown model folder or inconsistent arguments.
        ConfigError / WeightError: the model folder's config or weights are unusable.
    """

    def __init__(self, args: EngineArgs, *, env: EngineEnv | None = None,
                 vote_group: StepVoteGroup | None = None,
                 expert_parallel: ExpertParallelSetup | None = None) -> None:
        self.args = args = args.resolved()       # "auto" device / dtype, cache budget, HF repo id
        if args.data_parallel_size > 1:
            raise InvalidEngineArgs("LLMEngine runs one rank; data_parallel_size > 1 runs through LLM(...) "
                                    "(deepinfer.engine.parallel)", "data_parallel_size")
        self.env = env or read_env()
        self.model_dir = resolve_model_dir(args.model)
        cfg = DeepseekV4Config.from_model_dir(self.model_dir)
        _check_v41_options(cfg, args)
        started = time.perf_counter()
        # an expert-parallel rank's experts alone, where the loader can (a V4 safetensors checkpoint)
        ep = expert_parallel
        local_experts = None if ep is None else [s.local_logical_ids(ep.rank).tolist() for s in ep.slots]
        self.experts_sharded = (ep is not None and args.load_format == "safetensors"
                                and type(cfg) is DeepseekV4Config)
        self.model = load_model(self.model_dir, dtype=args.torch_dtype, device=args.device,
                                kv_quant=args.kv_quant, expert_dtype=args.expert_dtype, cfg=cfg, progress=True,
                                load_format=args.load_format, seed=args.seed, engram_on_host=args.engram_on_host,
                                local_experts=local_experts if self.experts_sharded else None)
        if ep is not None:      # before the graphs are captured: they hold the EP decode exchange
            apply_expert_parallel(self.model, ep.group, ep.slots, loaded_sharded=self.experts_sharded,
                                  max_decode_tokens=args.max_num_seqs)
        if args.yoco_prefill_truncation_mode != "off":
            self.model.set_prefill_truncation(args.yoco_prefill_truncation_mode, args.yoco_prefill_keep_tokens)
        draft = attach_draft_head(self.model, args, self.env) if args.num_speculative_tokens else None
        self.load_seconds = time.perf_counter() - started            # wall time of load_model
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        logger.info("loaded %s in %.2f s: %.1f MiB of weights on %s", self.model_dir, self.load_seconds,
                    self.weight_bytes / 2**20, args.device)
        self.tokenizer: Tokenizer | None = load_tokenizer(self.model_dir)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer and \
            self.tokenizer.eos_token_ids else cfg.eos_token_id
        self.max_model_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        if self.max_model_len > cfg.max_position_embeddings:
            raise InvalidEngineArgs(f"max_model_len={self.max_model_len} must be <= the model's "
                                    f"max_position_embeddings={cfg.max_position_embeddings}")
        block_size = args.block_size or default_block_size(self.model)
        num_state_slots = BlockManager.for_state_slots(args.max_num_seqs, self.env.num_state_slots_ratio).num_blocks
        budget_bytes = self._kv_budget_bytes()
        self._num_snapshots = 0
        if args.enable_prefix_caching and args.engine_type is not EngineType.COMPLETION:
            slot_bytes = state_slot_bytes(self.model, block_size, self.env.max_backtracking_tokens)
            self._num_snapshots = num_prefix_snapshots(args, slot_bytes, num_state_slots, budget_bytes)
            if not self._num_snapshots:
                logger.warning("prefix caching is off: a quarter of the %d B cache budget left by the state slots "
                               "holds no state snapshot (%d B each); set prefix_cache_snapshots to have some anyway",
                               budget_bytes, slot_bytes)
        prefix_caching = self._num_snapshots > 0
        sched_cfg = SchedulerConfig(
            block_size=block_size, max_model_len=self.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_prompts=args.max_num_prompts,
            prefill_max_sum_seqlen_k=args.prefill_max_sum_seqlen_k, nextn=0 if draft is None else draft.block_size,
            chunk_checkpoints=args.chunk_checkpoints, stop_preempted_request=args.stop_preempted_request,
            prefill_attempt_interval=self.env.prefill_attempt_interval,
            prefill_any_attempt_interval=self.env.prefill_any_attempt_interval, engine_type=args.engine_type,
            max_cache_usage_for_prefill=args.max_cache_usage_for_prefill,
            enable_prefix_caching=prefix_caching, prefix_cache_key=prefix_cache_key(args, self.env),
        )
        # speculative: verify steps (V4 and V4.1 alike) replay graphs keyed by total query tokens
        query_len = 1 if draft is None else draft.block_size + 1
        self.runner = ModelRunner(
            self.model, block_size=block_size, num_kv_blocks=args.num_kv_blocks,
            budget_bytes=budget_bytes, num_state_slots=num_state_slots,
            max_backtracking=self.env.max_backtracking_tokens,
            graph_max_seqs=None if args.enforce_eager else args.max_num_seqs * query_len,
            graph_max_query_len=query_len,
            max_blocks_per_seq=sched_cfg.max_blocks_per_seq, max_model_len=sched_cfg.max_blocks_per_seq * block_size,
            graph_interval=self.env.cudagraph_batch_size_interval, batch_invariant=args.batch_invariant,
            num_snapshot_slots=self._num_snapshots,
        )
        self._sched_cfg, self._vote_group = sched_cfg, vote_group
        self.spec = None if draft is None else SpeculativeDecoder(draft, self.runner, args, self.env, self._seq)
        self.scheduler = self._new_scheduler()
        # One caller at a time: add_request / abort_request / step / has_unfinished_requests take it.
        self._lock = threading.RLock()
        self._in_step = False          # a step() is running (re-entry from it is refused)
        self.zos = args.zos and (draft is None or _zos_with_drafts(args))
        self.sampling = SamplingStage(Sampler(seed=args.seed, force_top_k=self.env.sampler_force_topk,
                                              batch_invariant=args.batch_invariant),
                                      self.eos_token_ids, cfg.vocab_size, sync_guard=not self.env.disable_sync_guard,
                                      history=TokenHistory(cfg.vocab_size, self.runner.device))
        self._in_flight: _InFlightStep | None = None    # a ZOS decode step launched by the last step()
        self.last_step_kind: StepKind | None = None      # the kind of step the last step() scheduled
        self._requests: dict[str, Request | ParallelRequest] = {}   # by request id: what is reported
        self._seqs: dict[str, Request] = {}        # by scheduler sequence id (no "_"): one per sample
        self._ids = itertools.count()
        # Structured output (docs/design.md §11): requests wait here, outside the scheduler, until the
        # pool has compiled their grammar; `_pump_grammars` (pre_sampler_sync) hands them over.
        self.grammars: GrammarCompilePool | None = None     # made at the first constrained request
        self._awaiting_grammar: dict[str, Request | ParallelRequest] = {}
        self._finished_between_steps: list[Request] = []   # reported by the next step()
        # The last decode step's rows, reused while the next steps have the same ones (decode_rows.py)
        self._steady: SteadyRows | None = None
        self.init_pd_split()

    def _new_scheduler(self) -> Scheduler:
        """A scheduler over empty block managers: every KV block and state slot free."""
        slots = BlockManager.for_state_slots(self.args.max_num_seqs, self.env.num_state_slots_ratio)
        self.runner.forget_rows()         # the per-row buffers are keyed by the old scheduler's rows
        self._steady = None
        # The paged KV pool of the current scheduler; read (num_free, usage) by AsyncLLM's stats.
        self.kv_blocks = BlockManager(self.runner.plan.num_kv_blocks)
        snapshots = BlockManager(self._num_snapshots + 1) if self._num_snapshots else None
        return Scheduler(self._sched_cfg, self.kv_blocks, slots, vote_group=self._vote_group,
                         verify_policy=None if self.spec is None else self.spec.gate, snapshot_slots=snapshots)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (KV blocks and state snapshots); requests running now keep
        theirs. Returns False when prefix caching is off."""
        with self._lock:
            return self.scheduler.reset_prefix_cache()

    def stats(self) -> SpeculativeStats:
        """Speculative decoding counts so far (drafted and accepted tokens; all 0 with it off)."""
        return SpeculativeStats() if self.spec is None else self.spec.stats

    def _kv_budget_bytes(self) -> int:
        """Cache byte budget (paged KV + state slots): a fraction of the GPU minus the weights, or
        kv_cache_memory_mb."""
        args = self.args
        if args.gpu_memory_utilization is None or torch.device(args.device).type != "cuda":
            return int(args.kv_cache_memory_mb * 2**20)
        device = torch.device(args.device)
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * args.gpu_memory_utilization) - torch.cuda.memory_allocated(device)
        if budget <= 0:
            raise InvalidEngineArgs(f"gpu_memory_utilization={args.gpu_memory_utilization} leaves no memory for the "
                                    f"KV cache: the weights already take {torch.cuda.memory_allocated(device)} B")
        return budget

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or a finished one (aborted, say) is not reported yet:
        `while engine.has_unfinished_requests(): engine.step()` sees every request's last output."""
        with self._lock:
            return (bool(self._finished_between_steps) or any(not r.finished for r in self._requests.values())
                    or self.scheduler.has_unfinished())

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the outputs of the requests that changed (as each asked:
        `OutputKind`; a FINAL_ONLY request only when it finishes).

        A fault inside the step (an exception from the model, the sampler or the bookkeeping) never
        escapes: the requests of that step finish with reason "error" (error_reason names the
        exception), their blocks and slots are freed, and the engine goes on serving the others.

        Raises:
            RuntimeError: called from inside a step of this engine (a callback it runs, on the same
                thread): the inner step would corrupt the outer one's requests; nothing is done.
        """
        with self._lock, self._not_reentered():
            if self.grammars is not None and self._awaiting_grammar and not self.scheduler.has_unfinished():
                self.grammars.wait(IDLE_GRAMMAR_WAIT_S)      # nothing else to run: do not spin
            changed: dict[str, Request] = {}
            try:
                out = self.scheduler.schedule()
            except Exception as err:       # the scheduler's state is suspect: every request it held fails
                self._fail_all_scheduled(err, changed)
            else:
                self.last_step_kind = out.kind
                self._run_step(out, changed)
            for req in self._finished_between_steps:
                changed[req.request_id] = req
            self._finished_between_steps.clear()
            if self._in_flight is not None and not self.scheduler.has_unfinished():
                self._in_flight = None        # every row of it belongs to a request that has ended
            final_only = OutputKind.FINAL_ONLY
            outputs = [r.to_output() for r in changed.values() if r.finished or r.output_kind is not final_only]
            for req in changed.values():
                if req.finished:
                    self._forget_request(req)
            return outputs

    @contextlib.contextmanager
    def _not_reentered(self) -> Iterator[None]:
        """Marks a step in progress; raises RuntimeError when one already is (with the lock held,
        only this thread can be in it: a re-entrant call)."""
        if self._in_step:
            raise RuntimeError("LLMEngine.step() was called from inside a step of the same engine (e.g. from a "
                               "tokenizer or logits callback); a step cannot run inside another")
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def _run_step(self, out: SchedulerOutput, changed: dict[str, Request]) -> None:
        previous, self._in_flight = self._in_flight, None
        for ignored in out.ignored:
            req = self._seq(ignored.seq_id)
            if req is not None and not req.finished:
                req.ignore(str(ignored.reason.value))
                changed[req.request_id] = req.owner
        recomputed = set(out.recomputed_seq_ids)
        in_flight = {r.seq_id for r in previous.reqs} if previous is not None and out.preempted_seq_ids else ()
        for seq_id in out.preempted_seq_ids:
            req = self._seq(seq_id)
            if seq_id in recomputed:
                if seq_id in in_flight:
                    previous.recomputed.add(seq_id)
            elif seq_id in in_flight:
                previous.preempted.add(seq_id)      # finished once its in-flight token is in, below
            elif req is not None:
                req.preempt()
                changed[req.request_id] = req.owner
        if len(out.preempted_seq_ids) > len(recomputed):
            logger.warning("KV cache full: %d request(s) finished as 'preempted' (%d queued for recompute); "
                           "a client may retry them, or build the engine with stop_preempted_request=False "
                           "to recompute instead", len(out.preempted_seq_ids) - len(recomputed), len(recomputed))
        for chunk in out.prefill:
            if chunk.num_cached_tokens:
                record_cached_tokens(self._seq(chunk.seq_id), chunk.num_cached_tokens)
        step_ids = [chunk.seq_id for chunk in out.prefill] + list(out.decode.seq_ids if out.decode else ())
        keep_in_flight = self.zos and out.kind is StepKind.DECODE
        guarded = keep_in_flight and self.sampling.sync_guard
        device = self.runner.device
        try:
            self.runner.apply_cache_ops(out)
            if self.spec is not None and out.kind is StepKind.DECODE and out.decode is not None:
                self._run_spec_step(out, previous, keep_in_flight, changed)
                return
            wanting = self._wanting_prompt_logprobs(out)
            with forbid_cuda_sync(device, enabled=guarded):
                step = self.runner.prepare(out, all_logits_for=wanting) if wanting else self.runner.prepare(out)
            logits = None
            if step is not None:                                                   # (1) forward N
                with forbid_cuda_sync(device, enabled=guarded and self.runner.replays_graph(step)):
                    if not step.prompt_spans:
                        logits = self.runner.forward(step)
                    else:                            # a prefill step: never launched under the guard
                        logits, all_logits = self.runner.forward_all(step)
                        self._add_prompt_logprobs(step.prompt_spans, all_logits)
            if previous is not None:                                               # (2) post-process N − 1
                done, previous = previous, None
                # The same decode tuple as N − 1's: no row of it changed since, so none of its
                # requests ended (every end drops its sequence from the scheduler).
                unchanged = out.decode is not None and done.out.decode is not None and \
                    out.decode.seq_ids is done.out.decode.seq_ids
                self._post_process_in_flight(done, changed, rows_unchanged=unchanged)
            current = None
            if step is not None and logits is not None and step.sample_seq_ids:    # (3) sample N
                seq_ids = step.sample_seq_ids
                steady = self._steady
                if steady is not None and steady.seq_ids is seq_ids:      # the same rows as the last step
                    reqs = steady.reqs
                else:
                    try:
                        reqs = list(map(self._seqs.__getitem__, seq_ids))     # the common case: no "_" id
                    except KeyError:
                        reqs = [self._seq(seq_id) for seq_id in seq_ids]
                if out.kind is StepKind.PREFILL and any(r.unforked for r in reqs):
                    logits, reqs = self._rows_per_sample(logits, reqs)   # n rows for a prefilled group
                    seq_ids = tuple(r.seq_id for r in reqs)
                rows = self._step_rows(reqs, seq_ids if out.kind is StepKind.DECODE else None)
                sampling = self.sampling.launch(seq_ids, logits, rows, guarded=guarded)
                self.runner.record_sampled(step, sampling.token_ids)
                current = _InFlightStep(out, reqs, sampling)
            self._pump_grammars()                                                  # (4) pre_sampler_sync
            if current is not None and keep_in_flight:
                self._in_flight = current
            elif current is not None:
                self._post_process(current, self.sampling.collect(current.sampling), changed)
        except Exception as err:
            failed = len(step_ids) + (len(previous.reqs) if previous is not None else 0)
            logger.exception("step failed; its %d request(s) finish with reason 'error'", failed)
            self._in_flight = None
            self.scheduler.reset_prefix_cache()    # the step's cached blocks and snapshots may hold no KV
            for seq_id in step_ids:
                self._fail(seq_id, err, changed)
            for req in previous.reqs if previous is not None else ():
                if not req.finished:
                    self._fail(req.seq_id, err, changed)

    def _run_spec_step(self, out: SchedulerOutput, previous: _InFlightStep | None, keep_in_flight: bool,
                       changed: dict[str, Request]) -> None:
        """A speculative decode step (spec_step.py), in the same phases as a plain one: (1) draft and
        launch the verify forward of N, (2) post-process N − 1, (3) launch the verification and the
        plain rows' sampling of N, (4) the grammar pump; then commit N, or keep it in flight (ZOS).
        On a failure the caller fails the step's rows and N − 1's."""
        spec, d = self.spec, out.decode
        if not d.num_seqs:
            return
        reqs = [self._seq(seq_id) for seq_id in d.seq_ids]
        guarded = keep_in_flight and self.sampling.sync_guard
        launched = spec.launch_forward(d, reqs, guarded=guarded)                   # (1)
        if previous is not None:                                                   # (2)
            self._post_process_in_flight(previous, changed)
        flight = spec.launch_accept(launched, self.sampling, self._step_rows, guarded=guarded)       # (3)
        self._pump_grammars()                                                      # (4)
        current = _InFlightStep(out, reqs, None, spec=flight)
        if keep_in_flight:
            self._in_flight = current
        else:
            self._post_process_in_flight(current, changed)

    def _post_process_in_flight(self, step: _InFlightStep, changed: dict[str, Request], *,
                                rows_unchanged: bool = False) -> None:
        """Read and take a launched step's tokens: a speculative step through `SpeculativeDecoder.commit`,
        a plain one through `_post_process`."""
        if step.spec is not None:
            self.spec.commit(step.spec, self.sampling, self.scheduler, changed, preempted=step.preempted,
                             recomputed=step.recomputed)
        else:
            self._post_process(step, self.sampling.collect(step.sampling), changed, rows_unchanged=rows_unchanged)

    def _wanting_prompt_logprobs(self, out: SchedulerOutput) -> frozenset[str]:
        """Sequences of a prefill step whose prompt logprobs are not all in yet."""
        if out.kind is not StepKind.PREFILL:
            return frozenset()
        return frozenset(chunk.seq_id for chunk in out.prefill
                         if (req := self._seq(chunk.seq_id)) is not None and req.prompt_logprobs is not None
                         and req.num_prompt_logprobs < req.num_prompt_tokens)

    def _add_prompt_logprobs(self, spans: tuple[tuple[str, int, int, int], ...], logits: torch.Tensor) -> None:
        """Prompt logprobs from a prefill step's every-row logits: the row at position p gives the
        logprob of prompt token p + 1 (a recomputed chunk adds nothing: those are in already)."""
        for seq_id, first_row, num_rows, start in spans:
            req = self._seq(seq_id)
            if req is None or req.finished or req.prompt_logprobs is None:
                continue
            low, high = max(req.num_prompt_logprobs, start + 1), min(req.num_prompt_tokens, start + num_rows + 1)
            if low >= high or low != req.num_prompt_logprobs:
                continue
            rows = logits[first_row + low - 1 - start:first_row + high - 1 - start]
            req.add_prompt_logprobs(*logprobs_of(rows, req.token_ids[low:high], req.params.prompt_logprobs or 0))

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

    def _fork(self, req: Request) -> None:
        """Fork sample 0's just-prefilled sequence for the group's other samples (each branch reads its
        sample's token list, equal to sample 0's prompt: no token is sampled yet)."""
        samples, req.unforked = req.unforked, []
        branch_ids = self.scheduler.fork_seq(req.seq_id, len(samples), branch_lists=[s.token_ids for s in samples])
        expected = tuple("_" + s.seq_id for s in samples)
        if branch_ids != expected:     # the ids _check_ids_free reserved
            raise RuntimeError(f"fork of {req.seq_id!r} gave {branch_ids}, expected {expected}")

    def _post_process(self, step: _InFlightStep, sampled: SampledStep, changed: dict[str, Request], *,
                      rows_unchanged: bool = False) -> None:
        """Take a step's sampled tokens. `rows_unchanged`: the caller knows that no request of this
        (decode) step has ended since it was launched."""
        steady = self._steady
        if steady is not None and step.reqs is steady.reqs:
            if not (sampled.errors or step.preempted or step.recomputed or sampled.token_array is None
                    or self.args.engine_type is EngineType.PROMPT):
                self._post_process_steady(step, sampled, changed, steady, rows_unchanged)
                return
            self._steady = None          # its output counts would go stale: rebuilt at the next launch
        continuing_ids: list[str] = []
        continuing_tokens: list[int] = []
        for req in step.reqs:
            if req.unforked and not req.finished:
                self._fork(req)
        self._post_process_rows(step, sampled, range(len(step.reqs)), changed, continuing_ids, continuing_tokens)
        self._record_tokens(step.out.kind, continuing_ids, continuing_tokens)
        prompt_engine = self.args.engine_type is EngineType.PROMPT
        handed = [r.request_id for r in changed.values() if isinstance(r, Request) and
                  r.finish_reason == FINISH_PREFILLED] if prompt_engine else None  # only a PROMPT engine hands over
        if handed:
            self.pe_prepare_save_kvcache(handed)
            self.pe_do_save_kvcache(handed)
            self.send_processed_prompts(step.out)

    def _post_process_steady(self, step: _InFlightStep, sampled: SampledStep, changed: dict[str, Request],
                             steady: SteadyRows, rows_unchanged: bool) -> None:
        """A decode step of `steady`'s rows: the tokens that cannot end their request go in, in bulk
        (`SteadyRows.take_tokens`); the other rows go through `_post_process_rows`."""
        per_row = steady.take_tokens(sampled.token_array, sampled.token_ids, maybe_ended=not rows_unchanged)
        seq_ids = step.out.decode.seq_ids
        if not len(per_row):
            self.scheduler.append_decode_tokens(seq_ids, sampled.token_array[:, None], steady.ones)
            return
        continuing_ids: list[str] = []
        continuing_tokens: list[int] = []
        self._post_process_rows(step, sampled, per_row.tolist(), changed, continuing_ids, continuing_tokens)
        steady.resync(per_row)
        if len(per_row) == len(seq_ids):        # every row went one by one (per-step output kinds)
            self._record_tokens(StepKind.DECODE, continuing_ids, continuing_tokens)
            return
        keep = np.ones(len(seq_ids), dtype=np.bool_)
        keep[per_row] = False
        kept_ids = [*compress(seq_ids, keep.tolist()), *continuing_ids]
        kept_tokens = np.concatenate([sampled.token_array[keep], np.array(continuing_tokens, dtype=np.int64)])
        self._record_tokens(StepKind.DECODE, kept_ids, kept_tokens.tolist())

    def _post_process_rows(self, step: _InFlightStep, sampled: SampledStep, rows: Iterable[int],
                           changed: dict[str, Request], continuing_ids: list[str],
                           continuing_tokens: list[int]) -> None:
        """Take the sampled tokens of these rows (ascending) one by one: stop checks, finishing, and the
        ids and tokens of the rows that go on (appended to continuing_ids / continuing_tokens)."""
        prompt_engine = self.args.engine_type is EngineType.PROMPT
        errors = sampled.errors
        preempted = step.preempted | step.recomputed
        ranks = sampled.ranks
        reqs, token_ids, logprob_rows = step.reqs, sampled.token_ids, sampled.logprobs
        for row in rows:
            req, token_id, logprobs = reqs[row], token_ids[row], logprob_rows[row]
            seq_id = req.seq_id
            if req.finish_reason is not None or (preempted and seq_id in step.recomputed):
                if req.history_slot is not None and not req.finished:     # its token was counted: take it out
                    self.sampling.history.reset(req.history_slot, req.prompt_token_ids, req.output_token_ids)
                continue            # ended (or to be recomputed) since the step was launched: token dropped
            error = errors.get(row) if errors else None
            if error is not None:
                req.fail(error)
            else:
                req.add_token(token_id, logprobs, None if ranks is None else ranks[row])
            if prompt_engine and req.finish_reason is None:
                req.hand_over()
            if preempted and seq_id in step.preempted:
                req.preempt()       # the scheduler has already freed it
                changed[req.request_id] = req.owner
                continue
            if req.finish_reason is not None:
                changed[req.request_id] = req.owner
                self.scheduler.finish_seq(seq_id, req.finish_reason)
                continue
            if req.reports_each_step:     # a FINAL_ONLY request that goes on reports nothing
                changed[req.request_id] = req.owner
            continuing_ids.append(seq_id)
            continuing_tokens.append(token_id)

    def _fail(self, seq_id: str, err: BaseException, changed: dict[str, Request]) -> None:
        """Finish one sequence's request as "error" because of `err` and free what it holds."""
        self._forget_seq(seq_id)
        req = self._seq(seq_id)
        if req is not None and not req.finished:
            req.fail(f"engine fault: {type(err).__name__}: {err}")
            changed[req.request_id] = req.owner

    def _fail_all_scheduled(self, err: BaseException, changed: dict[str, Request]) -> None:
        """A fault inside `schedule()`: fail every request the scheduler held and start a fresh
        scheduler over empty block managers (requests still compiling their grammar are kept)."""
        logger.exception("scheduling failed; every scheduled request finishes with reason 'error'")
        self._in_flight = None
        for request_id, req in list(self._requests.items()):
            if request_id not in self._awaiting_grammar and not req.finished:
                req.fail(f"engine fault: {type(err).__name__}: {err}")
                changed[request_id] = req
        self.scheduler = self._new_scheduler()

    def _record_tokens(self, kind: StepKind, seq_ids: list[str], token_ids: list[int]) -> None:
        """Hand the scheduler the tokens of sequences that go on (one batched call for decode)."""
        if not seq_ids:
            return
        if kind is StepKind.DECODE:
            tokens = np.array(token_ids, dtype=np.int64)[:, None]
            self.scheduler.append_decode_tokens(tuple(seq_ids), tokens, np.ones(len(seq_ids), dtype=np.int64))
        else:
            for seq_id, token in zip(seq_ids, token_ids):
                self.scheduler.append_tokens(seq_id, [token])

    def _step_rows(self, reqs: list[Request], decode_seq_ids: tuple[str, ...] | None = None) -> StepRows:
        """The sampling parameters of a step's rows, a few passes over its requests (no object per row).
        A request that ended since the step was scheduled samples unconstrained (its token is dropped).
        A row that needs a TokenHistory row gets one at its request's first sampled row, from the host's
        tokens (then complete: it is a prefill row, never one launched before the previous step is read).
        A step of the same requests as the previous one, none constrained or controlled, reuses its
        parameter lists (and so `SamplingStage` its `SamplingBatch`): `SteadyRows`, kept for a decode step
        (`decode_seq_ids`, its `DecodeBatch.seq_ids`)."""
        steady = self._steady
        if steady is not None and steady.reqs is reqs:     # the same rows as the last step (`_run_step`)
            return steady.step_rows()
        self._steady = None
        grammars = None if self.grammars is None else [None if r.finished else r.grammar for r in reqs]
        controlled = any(r.controlled for r in reqs)
        if controlled:
            history = self.sampling.history
            for r in reqs:
                if r.needs_history and r.history_slot is None and not r.finished:
                    r.history_slot = history.acquire(r.prompt_token_ids, r.output_token_ids)
        rows = StepRows([r.params for r in reqs], [r.rng for r in reqs],
                        [len(r.token_ids) - r.num_prompt_tokens for r in reqs],
                        grammars if grammars is not None and any(g is not None for g in grammars) else None,
                        history_slots=[r.history_slot for r in reqs] if controlled else None,
                        bad_word_ids=[r.bad_word_ids for r in reqs] if controlled else None, controlled=controlled)
        if decode_seq_ids is not None and rows.grammars is None and not controlled:   # nothing per row that
            self._steady = SteadyRows(decode_seq_ids, reqs, rows)                     # changes while it runs
        return rows

    # ------------------------------------------------------------------ disaggregation hooks
    # No-ops in NORMAL engines. A prefill/decode-disaggregated deployment overrides them
    # (docs/design.md §3.5): PROMPT engines save KV after prefill, COMPLETION engines load it.

    def init_pd_split(self) -> None:
        """Set up the prefill/decode transfer channels (no-op)."""

    def do_save_kvcache(self, seq_ids: Sequence[str]) -> None:
        """Save finished sequences' KV and the stored state region to a KV store (no-op)."""

    def pe_prepare_save_kvcache(self, seq_ids: Sequence[str]) -> None:
        """PROMPT engine: stage KV of just-prefilled sequences for saving (no-op)."""

    def pe_do_save_kvcache(self, seq_ids: Sequence[str]) -> None:
        """PROMPT engine: write staged KV out (no-op)."""

    def send_processed_prompts(self, out: SchedulerOutput) -> None:
        """PROMPT engine: hand prefilled sequences to a COMPLETION engine (no-op)."""

    def should_copy_state(self, seq_id: str) -> bool:
        """Whether a sequence's state slot must be copied with its KV (False: nothing to copy)."""
        return False


__all__ = ["ConfigError", "LLMEngine", "WeightError", "resolve_model_dir"]
