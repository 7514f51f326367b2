"""Per-request state inside the engine: outputs so far, detokenization and stop conditions."""

from __future__ import annotations

from deepinfer.sched import FinishReason, TokenLog

from ..sampling.grammar_backend import GrammarState
from ..sampling.sampling_batch import RequestRng
from ..sampling.sampling_params import MAX_SEED, SamplingParams
from ..text.detokenizer import IncrementalDetokenizer, StopStringChecker
from ..text.tokenizer import Tokenizer
from .outputs import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_IGNORED,
    FINISH_LENGTH,
    FINISH_PREEMPTED,
    FINISH_PREFILLED,
    FINISH_STOP,
    CompletionOutput,
    Logprob,
    OutputKind,
    RequestOutput,
    logprob_entries,
    running_output,
)


class Request:
    """One request's mutable state; only the engine touches it.

    Stop conditions, checked after each sampled token in this order: a stop string in the text
    (once min_tokens outputs exist), EOS (unless ignore_eos), a stop token id, then the length
    limits (max_tokens, or max_model_len counting the prompt).

    A structured-output request gets its `grammar` state from the engine once compiled; every token
    is first fed to it, and a token the grammar rejects fails the request ("error").

    A request with n > 1 samples is a `ParallelRequest` of n of these: sample `index` runs as the
    scheduler sequence `seq_id` (the request id for sample 0, which is prefilled; f"{request_id}.{index}"
    for the others, forked from it once its prompt is in), seeded with seed + index. Until the fork,
    sample 0 holds the others in `unforked`, and they end with it if it ends first.

    The token history is kept once: `token_ids` (the prompt, then each kept output token) is a
    `deepinfer.sched.TokenLog`, which the scheduler reads in place (`Scheduler.add_seq(...,
    share_list=True)`, `fork_seq`'s branch_lists) and the detokenizer reads its outputs from. The
    request is its one writer (`add_token`; `SteadyRows.take_tokens` appends the tokens of a steady
    decode step in bulk on its behalf), and only tokens the request keeps, before they are handed to
    the scheduler; a ZOS step's token dropped for an ended or recomputed request never reaches it.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        *,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        device: str,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        index: int = 0,
        bad_word_ids: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.seq_id = request_id if index == 0 else f"{request_id}.{index}"   # the scheduler's id
        self.owner: Request | ParallelRequest = self          # what the engine reports: self or the group
        self.unforked: list[Request] = []                     # sample 0 of a group, until the fork
        self.prompt = prompt
        self.token_ids = TokenLog(prompt_token_ids)           # prompt + outputs: the one copy (class doc)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0          # prompt tokens its first prefill took from the prefix cache
        self.params = params
        self.rng = None if params.seed is None else RequestRng((params.seed + index) & MAX_SEED, device)
        # Logit controls (`logit_controls`): the tokenized bad words, and the TokenHistory row the
        # engine hands out at the first sampled row of a request with a penalty or a multi-token bad word.
        self.bad_word_ids = bad_word_ids
        self.needs_history = params.uses_penalties or any(len(word) > 1 for word in bad_word_ids)
        self.controlled = self.needs_history or bool(bad_word_ids) or bool(params.logit_bias) or \
            params.allowed_token_ids is not None
        self.history_slot: int | None = None
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                            token_ids=self.token_ids, start=self.num_prompt_tokens) \
            if tokenizer is not None else None
        self.stops = StopStringChecker(params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        # The ids that end the request once min_tokens outputs exist: EOS first (its stop_reason is None)
        self.stop_token_ids = frozenset(self.eos_token_ids) | frozenset(params.stop_token_ids)
        self.max_model_len = max_model_len
        room = max(1, max_model_len - len(prompt_token_ids))
        self._max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.output_kind = output_kind
        self.reports_each_step = output_kind is not OutputKind.FINAL_ONLY   # an output at every new token
        # Text is needed every step for stop strings and for per-step outputs; otherwise the tokens
        # are detokenized in one call when the request finishes.
        self._text_each_step = bool(params.stop) or output_kind is not OutputKind.FINAL_ONLY
        self.min_tokens = params.min_tokens
        self._num_reported = (0, 0)      # (tokens, characters) already in DELTA outputs
        # The released text, = self.stops.text, kept from the deltas (no join per step); without stop
        # strings the checker would release every delta as is, so it is skipped.
        self._text = ""
        self._prompt_out: list[int] | None = None   # the prompt list every output of this request shares
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.logprob_entries: list[dict[int, Logprob]] | None = [] if params.logprob_entries else None
        # A decode token of this request needs no per-row work unless it may end the request (no text,
        # logprobs or output per step): `SteadyRows.take_tokens` appends it in bulk.
        self.plain_decode = not self._text_each_step and self.logprobs is None
        self._decode_token = None if tokenizer is None else tokenizer.decode_token
        # SamplingParams.prompt_logprobs: filled as the prompt's chunks are prefilled (sample 0 only)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = \
            [None] if params.prompt_logprobs is not None and index == 0 else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.ignored_reason: str | None = None
        self.error_reason: str | None = None
        self.grammar: GrammarState | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt's token ids (`token_ids[:num_prompt_tokens]`)."""
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the output token ids so far (`token_ids[num_prompt_tokens:]`)."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: SamplingParams.max_tokens, capped by max_model_len − prompt."""
        return self._max_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt positions whose logprobs are in (the first one, None, included)."""
        return 0 if self.prompt_logprobs is None else len(self.prompt_logprobs)

    def add_prompt_logprobs(self, entries: list[dict[int, float]], ranks: list[int]) -> None:
        """The logprobs of the next len(entries) prompt tokens (each entry holds the prompt token)."""
        assert self.prompt_logprobs is not None
        start = len(self.prompt_logprobs)
        for position, (entry, rank) in enumerate(zip(entries, ranks), start):
            self.prompt_logprobs.append(logprob_entries(entry, self.token_ids[position], rank,
                                                        self._decode_token))

    def add_token(self, token_id: int, logprobs: dict[int, float] | None, rank: int | None = None) -> None:
        """Record one sampled token (with its logprobs and their rank, when asked for) and decide whether
        the request is done."""
        if self.grammar is not None and self.grammar.accept_tokens([token_id]) != 1:
            self.fail(f"grammar rejected token {token_id} after {self.num_output_tokens} output tokens")
            return
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
            if self.logprob_entries is not None:
                self.logprob_entries.append(logprob_entries(logprobs, token_id, rank, self._decode_token))
        num_out = len(self.token_ids) - self.num_prompt_tokens
        may_stop = num_out >= self.min_tokens
        if self._text_each_step and self.detok is not None:
            delta = self.detok.update()
            if not self.params.stop:
                self._text += delta
            else:
                update = self.stops.add(delta, allow_stop=may_stop)
                self._text += update.delta
                if update.stopped:
                    self._finish(FINISH_STOP, update.stop_str)
                    return
        if may_stop and token_id in self.stop_token_ids:
            self._finish(FINISH_STOP, None if token_id in self.eos_token_ids else token_id)
        elif num_out >= self._max_tokens:
            self._finish(FINISH_LENGTH, None)

    def abort(self) -> None:
        self._finish(FINISH_ABORT, None)

    def hand_over(self) -> None:
        """PROMPT engine: prefill done, first token sampled; the request goes on elsewhere."""
        self._finish(FINISH_PREFILLED, None)

    def preempt(self) -> None:
        self._finish(FINISH_PREEMPTED, None)

    def ignore(self, reason: str) -> None:
        self.ignored_reason = reason
        self._finish(FINISH_IGNORED, None)

    def fail(self, reason: str) -> None:
        """End the request with finish reason "error" (e.g. its grammar reached a dead end)."""
        if not self.finished:
            self.error_reason = reason
        self._finish(FINISH_ERROR, None)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        if self.finished:
            return
        self.finish_reason, self.stop_reason = reason, stop_reason
        unforked, self.unforked = self.unforked, []
        for sample in unforked:          # never started: they end as sample 0 did
            sample.ignored_reason, sample.error_reason = self.ignored_reason, self.error_reason
            sample._finish(reason, None)
        if self.detok is not None and not self._text_each_step:   # decoded once, now (no stop strings)
            self._text += self.detok.update()
        if self.detok is not None and self.stops.stop_str is None:
            tail = self.detok.finish()
            if not self.params.stop:
                self._text += tail
            else:
                self._text += self.stops.add(tail, allow_stop=False).delta
                self._text += self.stops.finish()

    @property
    def samples(self) -> tuple[Request, ...]:
        """The samples of a request reported on its own: itself."""
        return (self,)

    def _parts(self) -> tuple[str, list[int], list[dict[int, float]] | None, list[dict[int, Logprob]] | None]:
        """(text, token ids, logprobs, logprob entries) now, cumulative or (DELTA) what is new since the
        previous call."""
        first_token, first_char = self._num_reported if self.output_kind is OutputKind.DELTA else (0, 0)
        if self.output_kind is OutputKind.DELTA:
            self._num_reported = (self.num_output_tokens, len(self._text))
        token_ids = self.token_ids[self.num_prompt_tokens + first_token:]
        logprobs = None if self.logprobs is None else self.logprobs[first_token:]
        entries = None if self.logprob_entries is None else self.logprob_entries[first_token:]
        return (self._text[first_char:] if first_char else self._text), token_ids, logprobs, entries

    def completion(self) -> CompletionOutput:
        """This sample's `CompletionOutput` now (as `_parts`)."""
        text, token_ids, logprobs, entries = self._parts()
        return CompletionOutput(index=self.index, text=text, token_ids=token_ids, finish_reason=self.finish_reason,
                                logprobs=logprobs, stop_reason=self.stop_reason, ignored_reason=self.ignored_reason,
                                error_reason=self.error_reason, logprob_entries=entries)

    def prompt_logprobs_out(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs for an output: None if not asked, [] until the prompt is in (then the list,
        which no longer changes)."""
        if self.prompt_logprobs is None:
            return None
        return self.prompt_logprobs if len(self.prompt_logprobs) == self.num_prompt_tokens else []

    def to_output(self) -> RequestOutput:
        """This request's output now, cumulative or (DELTA) what is new since the previous call. The
        token and logprob lists are fresh copies (a later step never changes an output already handed
        out); prompt_token_ids is one list shared by all outputs of the request, copied once, so a step
        costs nothing per prompt token."""
        if self._prompt_out is None:
            self._prompt_out = self.prompt_token_ids
        if self.finished:
            return RequestOutput(self.request_id, self.prompt, self._prompt_out, [self.completion()], True,
                                 self.prompt_logprobs_out(), self.num_cached_tokens)
        text, token_ids, logprobs, entries = self._parts()
        return running_output(self.request_id, self.prompt, self._prompt_out, text, token_ids, logprobs, entries,
                              self.prompt_logprobs_out(), self.num_cached_tokens)


class ParallelRequest:
    """A request with SamplingParams.n > 1: its samples, each a `Request` (index 0..n − 1).

    Sample 0 is queued and prefilled; when its prompt is in, the engine samples n first tokens from
    its logits and forks the scheduler sequence (`Scheduler.fork_seq`) for samples 1..n − 1, which
    share its KV blocks copy-on-write. The request is finished when every sample is.
    """

    def __init__(self, samples: list[Request]) -> None:
        first = samples[0]
        self.samples = tuple(samples)
        self.request_id = first.request_id
        self.prompt = first.prompt
        self.num_prompt_tokens = first.num_prompt_tokens
        self.params = first.params
        self.output_kind = first.output_kind
        self.max_tokens = first.max_tokens
        self._prompt_out: list[int] | None = None
        for sample in samples:
            sample.owner = self
        first.unforked = list(samples[1:])

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt's token ids (each sample's `token_ids` starts with them)."""
        return self.samples[0].prompt_token_ids

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)

    def abort(self) -> None:
        for sample in self.samples:
            sample.abort()

    def ignore(self, reason: str) -> None:
        for sample in self.samples:
            if not sample.finished:
                sample.ignore(reason)

    def fail(self, reason: str) -> None:
        for sample in self.samples:
            sample.fail(reason)

    def to_output(self) -> RequestOutput:
        """One `CompletionOutput` per sample, in index order (each cumulative or DELTA as asked)."""
        if self._prompt_out is None:
            self._prompt_out = self.prompt_token_ids
        return RequestOutput(self.request_id, self.prompt, self._prompt_out,
                             [sample.completion() for sample in self.samples], self.finished,
                             self.samples[0].prompt_logprobs_out(), self.samples[0].num_cached_tokens)
