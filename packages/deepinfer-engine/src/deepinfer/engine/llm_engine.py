"""LLMEngine: requests in, one scheduler step + one model step per `step()`, outputs out.

One step (docs/design.md §2), read top to bottom in `step()`: schedule → the scheduler's news (ignored
and preempted sequences) → the cache ops → `steps.Step`'s phases: (1) launch the forward of step N,
(2) commit the steps still in flight, (3) launch N's sampling, (4) pre_sampler_sync (grammar pump),
then commit N at once, or keep it in flight. Plain steps are `plain_step.PlainStep`'s, speculative
decode steps `spec_step.SpeculativeDecoder`'s.

ZOS (docs/design.md §6, `EngineArgs.zero_overhead_scheduling`) is the depth of the queue of launched steps
(`steps.InFlightQueue`): with depth 1 the host schedules and launches decode step N + 1 before it has
read step N's tokens; the runner feeds N's sampled tokens to N + 1 on the device. A request's end
(EOS, stop string, max_tokens) is therefore seen one step late: its row of step N + 1 runs, and its
token is dropped; the scheduler gives back that step's reservation when the request is finished. A
sequence preempted for recompute while a step of it is in flight has that step's token dropped too
(the recompute produces it again: a seeded request's noise is keyed by position). Structured-output
rows need no special case: step N's tokens reach the grammars in (2), before step N + 1's masks are
filled in (3). Each ZOS launch runs under `forbid_cuda_sync`. Penalties and bad words read the tokens
sampled so far from a `TokenHistory` on the device, which the sampler updates itself (a token dropped
for recompute is taken out again by rebuilding the row from the host).

Parallel samples (SamplingParams.n > 1, `ParallelRequest`): in-flight rows and scheduler sequences
are samples (`Request` objects, `_seqs` by sequence id); `_requests` holds what is reported (a
`Request`, or the `ParallelRequest` of its samples). Sample 0 is prefilled; its prefill row is
sampled n times, then the sequence is forked for samples 1..n − 1 (`PlainStep`). A sample's row is
dropped once it ends, like any request's; the request is reported finished when every sample is.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from deepinfer.cache import BlockManager
from deepinfer.model import (
    ConfigError,
    DeepseekV4Config,
    DeepseekV41Config,
    DSparkDraft,
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
from deepinfer.spec import cuda_graph_key

from .config.engine_args import EngineArgs, InvalidEngineArgs
from .config.env import EngineEnv, read_env
from .core.intake import RequestIntake
from .core.kv_handoff import KVTransfer, NullKVTransfer
from .core.model_runner import ModelRunner, default_block_size, snapshot_bytes, state_slot_bytes
from .core.outputs import OutputKind, RequestOutput
from .core.pd_hooks import PrefillDecodeHooks
from .core.plain_step import PlainStep
from .core.prefix_caching import num_prefix_snapshots, prefix_cache_key, record_cached_tokens
from .core.request import ParallelRequest, Request
from .core.steps import Changed, HandleT, InFlightQueue, Step
from .sampling.grammar_compiler import GrammarCompilePool
from .sampling.logit_controls import TokenHistory
from .sampling.sampler import Sampler
from .sampling.sampling_stage import SamplingStage
from .speculative.spec_lockstep import SpecLockstep
from .speculative.spec_step import SpeculativeDecoder, SpeculativeStats, attach_draft_head
from .text.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


# With nothing to run but requests waiting for their grammar, `step()` waits this long for a compile.
IDLE_GRAMMAR_WAIT_S = 0.05


def max_decode_tokens(args: EngineArgs, env: EngineEnv) -> int:
    """The most tokens one rank feeds a decode forward: max_num_seqs, or under speculative decoding
    the largest verify graph size (max_num_seqs × (k + 1) rounded up to its key: lockstep ranks pad to it)."""
    if not args.num_speculative_tokens:
        return args.max_num_seqs
    return cuda_graph_key(args.max_num_seqs * (args.num_speculative_tokens + 1), env.cudagraph_batch_size_interval)


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


class LLMEngine(RequestIntake, PrefillDecodeHooks):
    """The engine of one DP rank: request intake (`add_request`, `prepare_request`, `enqueue`,
    `abort_request`) comes from `RequestIntake` (intake.py), the prefill/decode disaggregation hooks
    from `PrefillDecodeHooks` (pd_hooks.py), the step loop is here.

    Args:
        args: validated EngineArgs.
        env: engine environment (defaults: read once from os.environ).
        vote_group: the DP group the scheduler's step-kind vote runs over; None = a single rank.
        expert_parallel: this rank's share of the routed experts (`parallel.DPRank` builds it): a
            DeepSeek-V4 safetensors checkpoint loads its slots' experts alone (`experts_sharded`),
            other models whole; the exchange is attached (`apply_expert_parallel`, decode steps
            sized for max_num_seqs tokens per rank) before the decode CUDA graphs are captured, so
            they capture the fixed-capacity EP decode step.
        kv_transfer: how prefilled requests travel (docs/design.md §15): a PROMPT engine sends each
            prefilled request through it, a COMPLETION engine orders prefills and takes them from it
            (`deepinfer.engine.disagg` has the transports); None = `NullKVTransfer` (a COMPLETION
            engine then takes no request).

    Raises:
        InvalidEngineArgs: unknown model folder or inconsistent arguments.
        ValueError / ConnectionError: `kv_transfer.connect` refused the peer (another model) or could
            not reach it.
        ConfigError / WeightError: the model folder's config or weights are unusable.
    """

    def __init__(self, args: EngineArgs, *, env: EngineEnv | None = None,
                 vote_group: StepVoteGroup | None = None,
                 expert_parallel: ExpertParallelSetup | None = None, kv_transfer: KVTransfer | None = None) -> None:
        self.args = args = args.resolved()       # "auto" device / dtype, cache budget, HF repo id
        if args.data_parallel_size > 1:
            raise InvalidEngineArgs("LLMEngine runs one rank; data_parallel_size > 1 runs through LLM(...) "
                                    "(deepinfer.engine.parallel)", "data_parallel_size")
        self.env = env or read_env()
        self.model_dir = resolve_model_dir(args.model)
        cfg = DeepseekV4Config.from_model_dir(self.model_dir)
        _check_v41_options(cfg, args)
        draft = self._load_model(cfg, expert_parallel)
        self.tokenizer: Tokenizer | None = load_tokenizer(self.model_dir)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer and \
            self.tokenizer.eos_token_ids else cfg.eos_token_id
        self.max_model_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        if self.max_model_len > cfg.max_position_embeddings:
            raise InvalidEngineArgs(f"max_model_len={self.max_model_len} must be <= the model's "
                                    f"max_position_embeddings={cfg.max_position_embeddings}")
        budget_bytes = self._kv_budget_bytes()
        self._num_snapshots = self._prefix_snapshots(budget_bytes)
        self._sched_cfg, self._vote_group = self._scheduler_config(draft), vote_group
        self.runner = self._model_runner(draft, budget_bytes)
        self.sampling = SamplingStage(Sampler(seed=args.seed, force_top_k=self.env.sampler_force_topk,
                                              batch_invariant=args.batch_invariant),
                                      self.eos_token_ids, cfg.vocab_size, sync_guard=not self.env.disable_sync_guard,
                                      history=TokenHistory(cfg.vocab_size, self.runner.device))
        self._requests: dict[str, Request | ParallelRequest] = {}   # by request id: what is reported
        self._seqs: dict[str, Request] = {}        # by scheduler sequence key (`seq_key`): one per sample
        self._ids = itertools.count()
        # Structured output (docs/design.md §11): requests wait here, outside the scheduler, until the
        # pool has compiled their grammar; `_pump_grammars` (pre_sampler_sync) hands them over.
        self.grammars: GrammarCompilePool | None = None     # made at the first constrained request
        self._awaiting_grammar: dict[str, Request | ParallelRequest] = {}
        self._finished_between_steps: list[Request | ParallelRequest] = []   # reported by the next step()
        # The steps (steps.py): plain ones, and speculative decode steps with a draft head
        self.plain_step = PlainStep(self)
        self.spec = None if draft is None else SpeculativeDecoder(draft, self, self.plain_step, args, self.env,
                                                                  self._spec_lockstep(vote_group, expert_parallel))
        self.scheduler = self._new_scheduler()
        # One caller at a time: add_request / abort_request / step / has_unfinished_requests take it.
        self._lock = threading.RLock()
        self._in_step = False          # a step() is running (re-entry from it is refused)
        self.zos = args.zos
        self._in_flight = InFlightQueue(depth=1 if self.zos else 0)    # launched steps not committed yet
        self.last_step_kind: StepKind | None = None      # the kind of step the last step() scheduled
        self.kv_transfer: KVTransfer = NullKVTransfer() if kv_transfer is None else kv_transfer
        self.init_pd_split()

    def _load_model(self, cfg: DeepseekV4Config | DeepseekV41Config,
                    ep: ExpertParallelSetup | None) -> DSparkDraft | None:
        """Load the weights (an expert-parallel rank's experts alone, where the loader can: a V4
        safetensors checkpoint), attach the EP exchange, YOCO truncation and the draft head."""
        args, env = self.args, self.env
        started = time.perf_counter()
        local_experts = None if ep is None else [s.local_logical_ids(ep.rank).tolist() for s in ep.slots]
        self.experts_sharded = (ep is not None and args.load_format == "safetensors"
                                and type(cfg) is DeepseekV4Config)
        self.model = load_model(self.model_dir, dtype=args.torch_dtype, device=args.device,
                                kv_quant=args.kv_quant, expert_dtype=args.expert_dtype, cfg=cfg, progress=True,
                                load_format=args.load_format, seed=args.seed, engram_on_host=args.engram_on_host,
                                local_experts=local_experts if self.experts_sharded else None)
        if ep is not None:      # before the graphs are captured: they hold the EP decode exchange
            apply_expert_parallel(self.model, ep.group, ep.slots, loaded_sharded=self.experts_sharded,
                                  max_decode_tokens=max_decode_tokens(args, env))
        if args.yoco_prefill_truncation_mode != "off":
            self.model.set_prefill_truncation(args.yoco_prefill_truncation_mode, args.yoco_prefill_keep_tokens)
        draft = attach_draft_head(self.model, args, env) if args.num_speculative_tokens else None
        self.load_seconds = time.perf_counter() - started            # wall time of load_model
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        logger.info("loaded %s in %.2f s: %.1f MiB of weights on %s", self.model_dir, self.load_seconds,
                    self.weight_bytes / 2**20, args.device)
        return draft

    def _spec_lockstep(self, vote_group: StepVoteGroup | None,
                       ep: ExpertParallelSetup | None) -> SpecLockstep | None:
        """The group whose ranks run each speculative step's verify forward together: the EP group."""
        if ep is None or vote_group is None or vote_group.world_size == 1:
            return None
        return SpecLockstep(vote_group, ep.group, self.runner.device, self.env.cudagraph_batch_size_interval)

    def _prefix_snapshots(self, budget_bytes: int) -> int:
        """Prefix-cache state snapshots to keep (`num_prefix_snapshots`); 0 = prefix caching off."""
        args, env = self.args, self.env
        if not args.enable_prefix_caching or args.engine_type is EngineType.COMPLETION:
            return 0
        block_size = args.block_size or default_block_size(self.model)
        num_state_slots = BlockManager.for_state_slots(args.max_num_seqs, env.num_state_slots_ratio).num_blocks
        slot_bytes = state_slot_bytes(self.model, block_size, env.max_backtracking_tokens)
        one_snapshot = snapshot_bytes(self.model, block_size, env.max_backtracking_tokens)
        num = num_prefix_snapshots(args, slot_bytes, one_snapshot, num_state_slots, budget_bytes)
        if not num:
            logger.warning("prefix caching is off: a quarter of the %d B cache budget left by the state slots "
                           "holds no state snapshot (%d B each); set prefix_cache_snapshots to have some anyway",
                           budget_bytes, one_snapshot)
        return num

    def _scheduler_config(self, draft: DSparkDraft | None) -> SchedulerConfig:
        args, env = self.args, self.env
        return SchedulerConfig(
            block_size=args.block_size or default_block_size(self.model), max_model_len=self.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_prompts=args.max_num_prompts, prefill_max_sum_seqlen_k=args.prefill_max_sum_seqlen_k,
            nextn=0 if draft is None else draft.block_size, chunk_checkpoints=args.chunk_checkpoints,
            stop_preempted_request=args.stop_preempted_request, prefill_attempt_interval=env.prefill_attempt_interval,
            prefill_any_attempt_interval=env.prefill_any_attempt_interval, engine_type=args.engine_type,
            max_cache_usage_for_prefill=args.max_cache_usage_for_prefill,
            enable_prefix_caching=self._num_snapshots > 0, prefix_cache_key=prefix_cache_key(args, env),
        )

    def _model_runner(self, draft: DSparkDraft | None, budget_bytes: int) -> ModelRunner:
        """The runner and its cache memory; speculative verify steps (V4 and V4.1 alike) replay graphs
        keyed by total query tokens."""
        args, env, cfg = self.args, self.env, self._sched_cfg
        query_len = 1 if draft is None else draft.block_size + 1
        return ModelRunner(
            self.model, block_size=cfg.block_size, num_kv_blocks=args.num_kv_blocks,
            budget_bytes=budget_bytes,
            num_state_slots=BlockManager.for_state_slots(args.max_num_seqs, env.num_state_slots_ratio).num_blocks,
            max_backtracking=env.max_backtracking_tokens,
            graph_max_seqs=None if args.enforce_eager else args.max_num_seqs * query_len,
            graph_max_query_len=query_len, max_blocks_per_seq=cfg.max_blocks_per_seq,
            max_model_len=cfg.max_blocks_per_seq * cfg.block_size,
            graph_interval=env.cudagraph_batch_size_interval, batch_invariant=args.batch_invariant,
            num_snapshot_slots=self._num_snapshots, host_tier_bytes=int((args.prefix_cache_host_mb or 0) * 2**20),
            max_verify_tokens=0 if draft is None else args.max_num_seqs * query_len,
            emulate_graphs=env.emulate_cuda_graphs and not args.enforce_eager,
        )

    def _new_scheduler(self) -> Scheduler:
        """A scheduler over empty block managers: every KV block and state slot free."""
        slots = BlockManager.for_state_slots(self.args.max_num_seqs, self.env.num_state_slots_ratio)
        self.runner.forget_rows()         # the per-row buffers are keyed by the old scheduler's rows
        self.plain_step.forget_rows()
        # The paged KV pool of the current scheduler; read (num_free, usage) by AsyncLLM's stats.
        self.kv_blocks = BlockManager(self.runner.plan.num_kv_blocks)
        snapshots = BlockManager(self._num_snapshots + 1) if self._num_snapshots else None
        plan = self.runner.plan
        host_blocks = BlockManager(plan.num_host_blocks + 1) if plan.num_host_blocks else None
        host_snapshots = BlockManager(plan.num_host_snapshots + 1) if plan.num_host_blocks else None
        return Scheduler(self._sched_cfg, self.kv_blocks, slots, vote_group=self._vote_group,
                         verify_policy=None if self.spec is None else self.spec.gate, snapshot_slots=snapshots,
                         host_blocks=host_blocks, host_snapshots=host_snapshots)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (KV blocks and state snapshots); requests running now keep
        theirs. Returns False when prefix caching is off."""
        with self._lock:
            return self.scheduler.reset_prefix_cache()

    def stats(self) -> SpeculativeStats:
        """Speculative decoding counts so far (drafted and accepted tokens; all 0 with it off)."""
        return SpeculativeStats() if self.spec is None else self.spec.stats

    @property
    def num_in_flight(self) -> int:
        """Launched steps whose tokens are not committed yet (0 or 1: a ZOS decode step)."""
        return len(self._in_flight)

    def _kv_budget_bytes(self) -> int:
        """Cache byte budget (paged KV + state slots): a fraction of the GPU minus the weights, or
        kv_cache_memory_mb."""
        args = self.args
        if args.gpu_memory_utilization is None or torch.device(args.device).type != "cuda":
            if args.kv_cache_memory_mb is None:      # `EngineArgs.resolved()` sets it
                raise InvalidEngineArgs("kv_cache_memory_mb is unset: LLMEngine budgets the cache from "
                                        "EngineArgs.resolved()", "kv_cache_memory_mb")
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
            self._wait_for_grammars_when_idle()
            changed: Changed = {}
            self.take_transfers(changed)
            out = self._schedule(changed)
            if out is not None:
                self._take_scheduler_news(out, changed)
                self._run(out, changed)
            return self._report(changed)

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

    def _run(self, out: SchedulerOutput, changed: Changed) -> None:
        """One step by the `Step` that runs its kind: speculative decode steps with a draft head, else plain."""
        if self.spec is not None and out.kind is StepKind.DECODE:
            self._run_phases(self.spec, out, changed)
        else:
            self._run_phases(self.plain_step, out, changed)

    def _run_phases(self, step: Step[HandleT], out: SchedulerOutput, changed: Changed) -> None:
        """The phases of one step (module docstring); a failure fails the step's rows and those of the
        steps in flight."""
        queue = self._in_flight
        keep = queue.keeps(out)
        generation = None if out.decode is None else out.decode.rows_generation
        try:
            self.runner.apply_cache_ops(out)
            handle = step.launch(out, guarded=keep and self.sampling.sync_guard)    # (1) forward N
            queue.commit_down_to(0, changed, generation=generation)                # (2) commit N − 1
            if handle is not None:
                step.sample(handle)                                                # (3) sample N
            self._pump_grammars()                                                  # (4) pre_sampler_sync
            if handle is not None:
                queue.push(step, handle)
                queue.commit_down_to(queue.depth if keep else 0, changed)          # commit N, or keep it
        except Exception as err:
            self._fail_step(out, err, changed)

    def _wait_for_grammars_when_idle(self) -> None:
        """With nothing to run but requests waiting for their grammar, wait a little for a compile
        (do not spin)."""
        if self.grammars is not None and self._awaiting_grammar and not self.scheduler.has_unfinished():
            self.grammars.wait(IDLE_GRAMMAR_WAIT_S)

    def _schedule(self, changed: Changed) -> SchedulerOutput | None:
        """The scheduler's next step; None after a fault inside `schedule()`, whose scheduler state is
        suspect: every request it held fails (`_fail_all_scheduled`)."""
        try:
            out = self.scheduler.schedule()
        except Exception as err:
            self._fail_all_scheduled(err, changed)
            return None
        self.last_step_kind = out.kind
        return out

    def _take_scheduler_news(self, out: SchedulerOutput, changed: Changed) -> None:
        """Requests the scheduler ignored, and rows it preempted: those of a step in flight are
        marked on it (`InFlightQueue.mark_preempted`), the others for good finish now."""
        for ignored in out.ignored:
            req = self._seq(ignored.seq_id)
            if req is not None and not req.finished:
                req.ignore(str(ignored.reason.value))
                changed[req.request_id] = req.owner

        def preempt_now(seq_id: str) -> None:
            req = self._seq(seq_id)
            if req is not None:
                req.preempt()
                changed[req.request_id] = req.owner

        self._in_flight.mark_preempted(out, preempt_now)
        for chunk in out.prefill:
            if chunk.num_cached_tokens:
                record_cached_tokens(self._seq(chunk.seq_id), chunk.num_cached_tokens)
        num_recomputed = len(out.recomputed_seq_ids)
        if len(out.preempted_seq_ids) > num_recomputed:
            logger.warning("KV cache full: %d request(s) finished as 'preempted' (%d queued for recompute); "
                           "a client may retry them, or build the engine with stop_preempted_request=False "
                           "to recompute instead", len(out.preempted_seq_ids) - num_recomputed, num_recomputed)

    def _report(self, changed: Changed) -> list[RequestOutput]:
        """The outputs of the requests that changed (and of those finished between steps); finished
        requests are forgotten."""
        for req in self._finished_between_steps:
            changed[req.request_id] = req
        self._finished_between_steps.clear()
        if len(self._in_flight) and not self.scheduler.has_unfinished():
            self._in_flight.clear()        # every row of it belongs to a request that has ended
        final_only = OutputKind.FINAL_ONLY
        outputs = [r.to_output() for r in changed.values() if r.finished or r.output_kind is not final_only]
        for req in changed.values():
            if req.finished:
                self._forget_request(req)
        return outputs

    def _fail_step(self, out: SchedulerOutput, err: Exception, changed: Changed) -> None:
        """A fault in a step: its rows and those of the steps still in flight finish as "error"."""
        in_flight = self._in_flight.clear()
        self.scheduler.reset_prefix_cache()    # the step's cached blocks and snapshots may hold no KV
        step_ids = [chunk.seq_id for chunk in out.prefill] + list(out.decode.seq_ids if out.decode else ())
        failed = len(step_ids) + sum(len(handle.reqs) for handle in in_flight)
        logger.exception("step failed; its %d request(s) finish with reason 'error'", failed)
        for seq_id in step_ids:
            self._fail(seq_id, err, changed)
        for handle in in_flight:
            for req in handle.reqs:
                if not req.finished:
                    self._fail(req.seq_id, err, changed)

    def _fail(self, seq_id: str, err: BaseException, changed: Changed) -> None:
        """Finish one sequence's request as "error" because of `err` and free what it holds."""
        self._forget_seq(seq_id)
        req = self._seq(seq_id)
        if req is not None and not req.finished:
            req.fail(f"engine fault: {type(err).__name__}: {err}")
            changed[req.request_id] = req.owner

    def _fail_all_scheduled(self, err: BaseException, changed: Changed) -> None:
        """A fault inside `schedule()`: fail every request the scheduler held and start a fresh
        scheduler over empty block managers (requests still compiling their grammar are kept)."""
        logger.exception("scheduling failed; every scheduled request finishes with reason 'error'")
        self._in_flight.clear()
        for request_id, req in list(self._requests.items()):
            if request_id not in self._awaiting_grammar and not self._pd.holds(request_id) and not req.finished:
                req.fail(f"engine fault: {type(err).__name__}: {err}")
                changed[request_id] = req
        self.scheduler = self._new_scheduler()


__all__ = ["ConfigError", "LLMEngine", "WeightError", "resolve_model_dir"]
