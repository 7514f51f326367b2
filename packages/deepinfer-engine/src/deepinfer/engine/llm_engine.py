"""LLMEngine: requests in, one scheduler step + one model step per `step()`, outputs out."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.cache import BlockManager
from deepinfer.model import ConfigError, DeepseekV4Config, WeightError, load_model
from deepinfer.sched import EngineType, FinishReason, Scheduler, SchedulerConfig, StepKind, StepVoteGroup

from .engine_args import EngineArgs, InvalidEngineArgs
from .env import EngineEnv, read_env
from .grammar_backend import StructuredOutputUnavailable, XGrammarBackend
from .grammar_compiler import GrammarCompilePool
from .model_runner import ModelRunner, default_block_size
from .outputs import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_PREEMPTED, FINISH_PREFILLED, RequestOutput
from .request import Request
from .sampler import Sampler
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer, load_tokenizer, require_tokenizer
from .worker import RowParams, Worker

logger = logging.getLogger(__name__)
PromptInput = str | dict[str, Any]
# What the scheduler is told when a request ends (it only frees the sequence's blocks and slot).
_SCHED_REASON = {FINISH_LENGTH: FinishReason.LENGTH, FINISH_ABORT: FinishReason.ABORT,
                 FINISH_PREEMPTED: FinishReason.PREEMPTED, FINISH_ERROR: FinishReason.ABORT}

# With nothing to run but requests waiting for their grammar, `step()` waits this long for a compile.
IDLE_GRAMMAR_WAIT_S = 0.05


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
    if not path.is_dir():
        raise InvalidEngineArgs(f"model={model!r} is not a folder (expected config.json + model.safetensors)")
    return path


class LLMEngine:
    """The engine of one DP rank.

    Args:
        args: validated EngineArgs.
        env: engine environment (defaults: read once from os.environ).
        vote_group: the DP group the scheduler's step-kind vote runs over; None = a single rank.

    Raises:
        InvalidEngineArgs: unknown model folder or inconsistent arguments.
        ConfigError / WeightError: the model folder's config or weights are unusable.
    """

    def __init__(self, args: EngineArgs, *, env: EngineEnv | None = None,
                 vote_group: StepVoteGroup | None = None) -> None:
        self.args = args
        self.env = env or read_env()
        self.model_dir = resolve_model_dir(args.model)
        cfg = DeepseekV4Config.from_model_dir(self.model_dir)
        started = time.perf_counter()
        self.model = load_model(self.model_dir, dtype=args.torch_dtype, device=args.device,
                                kv_quant=args.kv_quant, expert_dtype=args.expert_dtype, cfg=cfg)
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
        state_slots = BlockManager.for_state_slots(args.max_num_seqs, self.env.num_state_slots_ratio)
        sched_cfg = SchedulerConfig(
            block_size=block_size, max_model_len=self.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_prompts=args.max_num_prompts,
            prefill_max_sum_seqlen_k=args.prefill_max_sum_seqlen_k, nextn=0,
            chunk_checkpoints=args.chunk_checkpoints, stop_preempted_request=args.stop_preempted_request,
            prefill_attempt_interval=self.env.prefill_attempt_interval,
            prefill_any_attempt_interval=self.env.prefill_any_attempt_interval, engine_type=args.engine_type,
        )
        self.runner = ModelRunner(
            self.model, block_size=block_size, num_kv_blocks=args.num_kv_blocks,
            budget_bytes=self._kv_budget_bytes(), num_state_slots=state_slots.num_blocks,
            max_backtracking=self.env.max_backtracking_tokens,
            graph_max_seqs=None if args.enforce_eager else args.max_num_seqs,
            max_blocks_per_seq=sched_cfg.max_blocks_per_seq, max_model_len=sched_cfg.max_blocks_per_seq * block_size,
            graph_interval=self.env.cudagraph_batch_size_interval,
        )
        self.scheduler = Scheduler(sched_cfg, BlockManager(self.runner.plan.num_kv_blocks), state_slots,
                                   vote_group=vote_group)
        self.worker = Worker(self.runner, Sampler(seed=args.seed, force_top_k=self.env.sampler_force_topk),
                             self.eos_token_ids, cfg.vocab_size)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # Structured output (DESIGN.md §8): requests wait here, outside the scheduler, until the
        # pool has compiled their grammar; `_pump_grammars` (pre_sampler_sync) hands them over.
        self.grammars: GrammarCompilePool | None = None     # made at the first constrained request
        self._awaiting_grammar: dict[str, Request] = {}
        self._finished_between_steps: list[Request] = []   # reported by the next step()
        self.worker.pre_sampler_sync_hooks.append(self._pump_grammars)
        self.init_pd_split()

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

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str | None, prompt: PromptInput | Sequence[int],
                    params: SamplingParams | None = None) -> str:
        """Queue a request; returns its id (a fresh one when request_id is None).

        Args:
            prompt: text (needs a tokenizer), `{"prompt_token_ids": [...]}` (optionally with
                "prompt"), or a list of token ids.
        Raises:
            ValueError: duplicate id, text without a tokenizer, token ids outside the vocabulary, or a
                COMPLETION engine (it only takes requests handed over by a PROMPT engine).
            StructuredOutputUnavailable: params.structured without xgrammar, a tokenizer or an EOS id.
            An empty prompt or one longer than max_model_len is not an error: the request finishes
            as "ignored" with its reason at the next step; so does a grammar that fails to compile.
        """
        if self.args.engine_type is EngineType.COMPLETION:
            raise ValueError("a COMPLETION engine only decodes requests prefilled by a PROMPT engine; the KV "
                             "transfer that hands them over is not implemented, so it takes no add_request")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        vocab = self.model.cfg.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contain {bad[:3]}: ids must be in [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; this model folder has no tokenizer.json")
        grammars = self._grammar_pool() if params.structured is not None else None
        req = Request(request_id, text, token_ids, params, self.tokenizer, eos_token_ids=self.eos_token_ids,
                      max_model_len=self.max_model_len, device=self.args.device)
        self._requests[request_id] = req
        if grammars is not None and params.structured is not None:
            self._awaiting_grammar[request_id] = req
            grammars.submit(request_id, params.structured)
        else:
            self.scheduler.add_seq(request_id, token_ids, req.max_tokens)
        return request_id

    def _grammar_pool(self) -> GrammarCompilePool:
        if self.grammars is None:
            if self.tokenizer is None:
                raise StructuredOutputUnavailable(
                    f"SamplingParams.structured needs a tokenizer; {str(self.model_dir)!r} has no tokenizer.json")
            backend = XGrammarBackend(self.tokenizer, self.model.cfg.vocab_size, self.eos_token_ids)
            self.grammars = GrammarCompilePool(backend)
        return self.grammars

    def _pump_grammars(self) -> None:
        """pre_sampler_sync hook: queue requests whose grammar compiled; fail those whose did not."""
        if self.grammars is None:
            return
        for done in self.grammars.pop_completed():
            req = self._awaiting_grammar.pop(done.request_id, None)
            if req is None or req.finished:          # aborted while compiling
                continue
            if done.error is not None:
                req.ignore(f"grammar compile failed: {done.error}")
                self._finished_between_steps.append(req)
            else:
                req.grammar = self.grammars.backend.new_state(done.compiled)
                self.scheduler.add_seq(req.request_id, req.prompt_token_ids, req.max_tokens)

    def tokenize_prompt(self, prompt: PromptInput | Sequence[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) of a prompt in any accepted form.

        Raises:
            ValueError: malformed token ids; NoTokenizerError: text without a tokenizer.
        """
        if isinstance(prompt, str):
            return prompt, require_tokenizer(self.tokenizer, self.model_dir).encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids' (a list of ints)")
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        else:
            ids, text = prompt, None
        if isinstance(ids, str | bytes) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        return text, list(ids)

    def abort_request(self, request_id: str) -> None:
        """Abort a queued or running request; it finishes with reason "abort" (unknown ids are ignored)."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return
        if self._awaiting_grammar.pop(request_id, None) is None:
            self.scheduler.abort_seq(request_id)
        req.abort()
        self._finished_between_steps.append(req)

    def has_unfinished_requests(self) -> bool:
        return any(not r.finished for r in self._requests.values()) or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the outputs of every request that changed."""
        if self.grammars is not None and self._awaiting_grammar and not self.scheduler.has_unfinished():
            self.grammars.wait(IDLE_GRAMMAR_WAIT_S)      # nothing else to run: do not spin
        out = self.scheduler.schedule()
        changed: dict[str, Request] = {}
        for ignored in out.ignored:
            req = self._requests.get(ignored.seq_id)
            if req is not None and not req.finished:
                req.ignore(str(ignored.reason.value))
                changed[req.request_id] = req
        for seq_id in out.preempted_seq_ids:
            req = self._requests.get(seq_id)
            if req is not None and self.args.stop_preempted_request:
                req.preempt()
                changed[seq_id] = req
        self.runner.apply_cache_ops(out)
        step = self.runner.prepare(out)
        sampled = self.worker.execute_model_step(step, self._row_params)
        continuing: list[tuple[str, int]] = []
        for token in sampled:
            req = self._requests.get(token.seq_id)
            if req is None or req.finished:
                continue
            if token.error is not None:
                req.fail(token.error)
            else:
                req.add_token(token.token_id, token.logprobs)
            if not req.finished and self.args.engine_type is EngineType.PROMPT:
                req.hand_over()
            if req.finished:
                self.scheduler.finish_seq(token.seq_id, _SCHED_REASON.get(req.finish_reason, FinishReason.STOP))
            else:
                continuing.append((token.seq_id, token.token_id))
            changed[req.request_id] = req
        self._record_tokens(out.kind, continuing)
        handed = [r.request_id for r in changed.values() if r.finish_reason == FINISH_PREFILLED]
        if handed:
            self.pe_prepare_save_kvcache(handed)
            self.pe_do_save_kvcache(handed)
            self.send_processed_prompts(out)
        for req in self._finished_between_steps:
            changed[req.request_id] = req
        self._finished_between_steps.clear()
        outputs = [r.to_output() for r in changed.values()]
        for req in changed.values():
            if req.finished:
                del self._requests[req.request_id]
        return outputs

    def _record_tokens(self, kind: StepKind, continuing: list[tuple[str, int]]) -> None:
        """Hand the scheduler the tokens of sequences that go on (one batched call for decode)."""
        if not continuing:
            return
        if kind is StepKind.DECODE:
            ids = tuple(seq_id for seq_id, _ in continuing)
            tokens = np.array([[token] for _, token in continuing], dtype=np.int64)
            self.scheduler.append_decode_tokens(ids, tokens, np.ones(len(ids), dtype=np.int64))
        else:
            for seq_id, token in continuing:
                self.scheduler.append_tokens(seq_id, [token])

    def _row_params(self, seq_id: str) -> RowParams:
        req = self._requests[seq_id]
        return RowParams(req.params, req.rng, len(req.output_token_ids), req.grammar, req.needs_previous_result)

    # ------------------------------------------------------------------ disaggregation hooks
    # No-ops in NORMAL engines. A prefill/decode-disaggregated deployment overrides them
    # (DESIGN.md §8): PROMPT engines save KV after prefill, COMPLETION engines load it.

    def init_pd_split(self) -> None:
        """Set up the prefill/decode transfer channels (no-op)."""

    def do_save_kvcache(self, seq_ids: Sequence[str]) -> None:
        """Save finished sequences' KV and the stored state region to a KV store (no-op)."""

    def pe_prepare_save_kvcache(self, seq_ids: Sequence[str]) -> None:
        """PROMPT engine: stage KV of just-prefilled sequences for saving (no-op)."""

    def pe_do_save_kvcache(self, seq_ids: Sequence[str]) -> None:
        """PROMPT engine: write staged KV out (no-op)."""

    def send_processed_prompts(self, out: Any) -> None:
        """PROMPT engine: hand prefilled sequences to a COMPLETION engine (no-op)."""

    def should_copy_state(self, seq_id: str) -> bool:
        """Whether a sequence's state slot must be copied with its KV (False: nothing to copy)."""
        return False


__all__ = ["ConfigError", "LLMEngine", "WeightError", "resolve_model_dir"]
