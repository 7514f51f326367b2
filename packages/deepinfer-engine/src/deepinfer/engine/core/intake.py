"""Request intake of `LLMEngine`: checking, tokenizing and queueing requests, and aborting them.

`RequestIntake` is the part of `LLMEngine` that runs when a request arrives or is aborted, kept apart
from the step loop (llm_engine.py). It works on the engine's state, set up by `LLMEngine.__init__`:
the requests by id (`_requests`) and by scheduler sequence (`_seqs`), the scheduler, the tokenizer,
the grammar pool and the lock that serialises callers.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepinfer.model import CausalLM
from deepinfer.sched import EngineType, Scheduler, seq_key

from ..config.engine_args import EngineArgs
from ..sampling.grammar_backend import StructuredOutputUnavailable, XGrammarBackend
from ..sampling.grammar_compiler import GrammarCompilePool
from ..sampling.logit_controls import tokenize_bad_words
from ..sampling.sampling_params import InvalidSamplingParams, SamplingParams
from ..sampling.sampling_stage import SamplingStage
from ..text.text_checks import check_unicode
from ..text.tokenizer import Tokenizer, require_tokenizer
from .kv_handoff import KVTransfer
from .outputs import OutputKind
from .request import ParallelRequest, Request

PromptInput = str | dict[str, Any]
MAX_REQUEST_ID_LEN = 256
GRAMMAR_FAILED = "grammar compile failed"     # how the ignored_reason of a request whose grammar failed starts

def _checked_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id={request_id!r} must be a non-empty str of at most {MAX_REQUEST_ID_LEN} "
                         "characters")
    if seq_key(request_id) != request_id:          # spelled as a fork branch's id (`BranchId`)
        raise ValueError(f"request_id={request_id!r} must not start with '_' (reserved for fork branches)")
    return request_id



class RequestIntake:
    """add_request / prepare_request / enqueue / abort_request and their checks (a base of `LLMEngine`)."""

    args: EngineArgs
    model: CausalLM
    model_dir: Path
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    scheduler: Scheduler
    grammars: GrammarCompilePool | None
    sampling: SamplingStage
    _lock: threading.RLock
    _ids: itertools.count
    _requests: dict[str, Request | ParallelRequest]
    _seqs: dict[str, Request]
    _awaiting_grammar: dict[str, Request | ParallelRequest]
    _finished_between_steps: list[Request | ParallelRequest]
    kv_transfer: KVTransfer

    if TYPE_CHECKING:      # `pd_hooks.PrefillDecodeHooks`, the other base of `LLMEngine`
        def order_prefill(self, req: Request) -> None: ...

        def cancel_prefill(self, request_id: str) -> None: ...

    def add_request(self, request_id: str | None, prompt: PromptInput | Sequence[int],
                    params: SamplingParams | None = None, *,
                    output_kind: OutputKind = OutputKind.CUMULATIVE) -> str:
        """Queue a request; returns its id (a fresh one when request_id is None).

        Args:
            request_id: a non-empty str of at most MAX_REQUEST_ID_LEN characters, not starting with
                "_" (reserved for fork branches); None = the engine numbers it.
            prompt: text (needs a tokenizer), `{"prompt_token_ids": [...]}` (optionally with
                "prompt"), or a list of token ids.
            output_kind: which outputs `step()` returns for it (`OutputKind`: every step cumulative,
                every step what is new, or only the final one).
        Raises:
            ValueError: a bad or duplicate id, text without a tokenizer, token ids outside the
                vocabulary; for a COMPLETION engine, one without a prefill peer (its `KVTransfer`), or a
                request it cannot hand over (structured output, prompt logprobs, n > 1).
                InvalidSamplingParams (a ValueError): params.max_tokens above what the
                prompt leaves of max_model_len. A refused request leaves nothing behind.
            StructuredOutputUnavailable: params.structured without xgrammar, a tokenizer or an EOS id.
            An empty prompt or one longer than max_model_len is not an error: the request finishes
            as "ignored" with its reason at the next step; so does a grammar that fails to compile.
        """
        with self._lock:
            req = self.prepare_request(request_id, prompt, params, output_kind=output_kind)
            self.enqueue(req)
            return req.request_id

    def prepare_request(self, request_id: str | None, prompt: PromptInput | Sequence[int],
                        params: SamplingParams | None = None, *,
                        output_kind: OutputKind = OutputKind.CUMULATIVE) -> Request | ParallelRequest:
        """Check a request and build its state without queueing it (`add_request` = this + `enqueue`).

        Raises: as `add_request`; nothing is registered either way.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if self.args.engine_type is EngineType.COMPLETION:
            _check_prefillable(params, self.kv_transfer.prefills)
        with self._lock:
            request_id = str(next(self._ids)) if request_id is None else _checked_request_id(request_id)
            self._check_ids_free(request_id, params.n)
        text, token_ids = self.tokenize_prompt(prompt)
        vocab = self.model.cfg.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contain {bad[:3]}: ids must be in [0, {vocab})")
        _check_room(params, len(token_ids), self.max_model_len)
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; this model folder has no tokenizer.json")
        if params.structured is not None:
            self._grammar_pool()
        if not isinstance(output_kind, OutputKind):
            raise ValueError(f"output_kind={output_kind!r} must be an OutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        self._check_token_ids(params, vocab)
        bad_word_ids = self._tokenize_bad_words(params)
        if params.n > 1 and self.args.engine_type is not EngineType.NORMAL:
            raise ValueError(f"n={params.n} needs a NORMAL engine (a PROMPT engine hands one sequence over)")
        samples = [Request(request_id, text, token_ids, params, self.tokenizer, eos_token_ids=self.eos_token_ids,
                           max_model_len=self.max_model_len, device=self.args.device, output_kind=output_kind,
                           index=index, bad_word_ids=bad_word_ids) for index in range(params.n)]
        return samples[0] if params.n == 1 else ParallelRequest(samples)

    def _check_ids_free(self, request_id: str, num_samples: int) -> None:
        """Refuse an id in use by a request or a sample, or one whose samples' ids are."""
        taken = [i for i in [request_id] + [f"{request_id}.{k}" for k in range(1, num_samples)]
                 if i in self._requests or i in self._seqs]
        if taken:
            raise ValueError(f"request_id={request_id!r} is already in use" if taken[0] == request_id else
                             f"request_id={request_id!r} with n={num_samples}: its samples' ids {taken} are in use")

    @staticmethod
    def _check_token_ids(params: SamplingParams, vocab: int) -> None:
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias_pairs]),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidSamplingParams(f"{name} holds token ids {bad[:3]} outside the vocabulary [0, {vocab})")

    def _tokenize_bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer; this model folder has no tokenizer.json")
        return tokenize_bad_words(self.tokenizer, params.bad_words)

    def enqueue(self, req: Request | ParallelRequest) -> None:
        """Queue a request made by `prepare_request`.

        Raises:
            ValueError: its id is in use by now; nothing is registered then.
        """
        with self._lock:
            self._check_ids_free(req.request_id, len(req.samples))
            self._requests[req.request_id] = req
            self._seqs.update((sample.seq_id, sample) for sample in req.samples)
            try:
                if req.params.structured is not None:
                    self._awaiting_grammar[req.request_id] = req
                    self._grammar_pool().submit(req.request_id, req.params.structured)
                elif self.args.engine_type is EngineType.COMPLETION:
                    self.order_prefill(req.samples[0])       # admitted once its KV arrives (pd_hooks.py)
                else:
                    # sample 0's token list is the sequence's history (kept once: `Request`)
                    self.scheduler.add_seq(req.request_id, req.samples[0].token_ids, req.max_tokens,
                                           share_list=True, use_prefix_cache=req.params.prompt_logprobs is None)
            except BaseException:
                self._forget_request(req)
                self._awaiting_grammar.pop(req.request_id, None)
                raise

    def _forget_request(self, req: Request | ParallelRequest) -> None:
        """Drop a reported request and its samples (and their TokenHistory rows)."""
        self._requests.pop(req.request_id, None)
        for sample in req.samples:
            self._seqs.pop(sample.seq_id, None)
            if sample.history_slot is not None and self.sampling.history is not None:
                self.sampling.history.release(sample.history_slot)
                sample.history_slot = None

    def _seq(self, seq_id: str) -> Request | None:
        """The sample running as scheduler sequence `seq_id` (a fork branch's `BranchId` or its key)."""
        return self._seqs.get(seq_key(seq_id))

    def _grammar_pool(self) -> GrammarCompilePool:
        if self.grammars is None:
            if self.tokenizer is None:
                raise StructuredOutputUnavailable(
                    f"SamplingParams.structured needs a tokenizer; {str(self.model_dir)!r} has no tokenizer.json")
            backend = XGrammarBackend(self.tokenizer, self.model.cfg.vocab_size, self.eos_token_ids)
            self.grammars = GrammarCompilePool(backend)
        return self.grammars

    def _pump_grammars(self) -> None:
        """The pre_sampler_sync work: queue requests whose grammar compiled; fail those whose did not."""
        if self.grammars is None:
            return
        for done in self.grammars.pop_completed():
            req = self._awaiting_grammar.pop(done.request_id, None)
            if req is None or req.finished:          # aborted while compiling
                continue
            error = done.error
            if error is None:
                try:
                    for sample in req.samples:
                        sample.grammar = self.grammars.backend.new_state(done.compiled)
                except Exception as err:         # the request fails alone, not the step it is pumped in
                    error = f"its grammar could not start: {type(err).__name__}: {err}"
            if error is not None:
                req.ignore(f"{GRAMMAR_FAILED}: {error}")
                self._finished_between_steps.append(req)
            else:
                # Never recomputed (docs/design.md §3.3): a preemption finishes it.
                self.scheduler.add_seq(req.request_id, req.samples[0].token_ids, req.max_tokens, recomputable=False,
                                       share_list=True, use_prefix_cache=req.params.prompt_logprobs is None)

    def tokenize_prompt(self, prompt: PromptInput | Sequence[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) of a prompt in any accepted form.

        Raises:
            ValueError: malformed token ids, text with a lone surrogate; NoTokenizerError: text
                without a tokenizer.
        """
        if isinstance(prompt, str):
            check_unicode(prompt, "prompt")
            return prompt, require_tokenizer(self.tokenizer, self.model_dir).encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids' (a list of ints)")
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"a dict prompt's 'prompt' must be a str, got {type(text).__name__}")
        else:
            ids, text = prompt, None
        if isinstance(ids, str | bytes) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        return text, list(ids)

    def abort_request(self, request_id: str) -> None:
        """Abort a queued or running request; it finishes with reason "abort" (unknown ids are ignored)."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                return
            self.cancel_prefill(request_id)
            if self._awaiting_grammar.pop(request_id, None) is None:
                for sample in req.samples:
                    if not sample.finished:
                        self._forget_seq(sample.seq_id)
            elif self.grammars is not None:
                self.grammars.cancel(request_id)        # nobody else waiting: the compile is dropped
            req.abort()
            self._finished_between_steps.append(req)

    def _forget_seq(self, seq_id: str) -> None:
        """Tell the scheduler a sequence ends (frees its blocks and slot); one it already forgot is fine."""
        try:
            self.scheduler.abort_seq(seq_id)
        except KeyError:
            pass


def _check_prefillable(params: SamplingParams, prefills: bool) -> None:
    """What a COMPLETION engine refuses: everything without a prefill peer, and the requests a
    handoff does not carry yet (docs/design.md §15)."""
    if not prefills:
        raise ValueError("a COMPLETION engine takes requests only with a prefill peer (LLMEngine(kv_transfer=...), "
                         "`deepinfer serve --pd-role decode --pd-prefill-url URL`)")
    for name, value in (("structured", params.structured), ("prompt_logprobs", params.prompt_logprobs)):
        if value is not None:
            raise InvalidSamplingParams(f"{name} is not supported yet with prefill/decode disaggregation (the "
                                        "handoff does not carry a grammar state or prompt logprobs)")


def _check_room(params: SamplingParams, prompt_len: int, max_model_len: int) -> None:
    """Refuse max_tokens beyond what the prompt leaves of max_model_len (at least one token: the one
    sampled at the end of the prefill). A prompt longer than max_model_len is left to the scheduler,
    which finishes it as ignored."""
    room = max(1, max_model_len - prompt_len)
    if params.max_tokens is not None and prompt_len <= max_model_len and params.max_tokens > room:
        raise InvalidSamplingParams(f"max_tokens={params.max_tokens} exceeds the {room} tokens this request has "
                                    f"room for: max_model_len={max_model_len} minus its {prompt_len} prompt tokens")
