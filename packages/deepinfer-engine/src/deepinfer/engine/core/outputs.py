"""What a request gives back: `RequestOutput` holding one `CompletionOutput` per sample.

Finish reasons are `deepinfer.sched.FinishReason` members, the one finish-reason type of the scheduler and
the engine: a str enum, so each equals and prints as its value (the OpenAI vocabulary plus five of ours):

- ``"stop"``: EOS, a stop token id or a stop string ended the output (`stop_reason` says which).
- ``"length"``: `max_tokens` or the model's max_model_len was reached.
- ``"abort"``: the user aborted the request.
- ``"preempted"``: the scheduler ran out of KV blocks and finished the request instead of
  recomputing it (docs/design.md §3.3, ``stop_preempted_request``).
- ``"ignored"``: the request was never run (prompt too long, grammar failed to compile, ...). The
  reason is a separate field, `ignored_reason`, rather than a suffix of the finish reason, so that a
  client can compare finish reasons with ``==`` against the constants below and still read why.
  A constrained request whose grammar fails to compile ends this way ("grammar compile failed: ...").
- ``"error"``: the request ran but could not go on (its grammar reached a dead end: no token is
  allowed); `error_reason` says why. The tokens produced before stay in the output; the other
  requests of the batch are unaffected.
- ``"prefilled"``: a PROMPT engine (disaggregated prefill) finished the prompt and sampled the first
  token; the request continues on a COMPLETION engine through the disaggregation hooks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.sched import FinishReason

# Finish reasons: deepinfer.sched's `FinishReason`, one type shared by the scheduler and the engine (a
# str enum: each compares equal to, and prints as, its value: "stop", "length", ...).
FINISH_STOP = FinishReason.STOP
FINISH_LENGTH = FinishReason.LENGTH
FINISH_ABORT = FinishReason.ABORT
FINISH_PREEMPTED = FinishReason.PREEMPTED
FINISH_IGNORED = FinishReason.IGNORED
FINISH_ERROR = FinishReason.ERROR
FINISH_PREFILLED = FinishReason.PREFILLED
FINISH_REASONS = frozenset(FinishReason)


class OutputKind(enum.Enum):
    """Which outputs `LLMEngine.step()` returns for a request.

    CUMULATIVE: every step the request changed, its whole output so far (vLLM's default).
    DELTA: every step the request changed, only what is new since its previous output (text, token ids
        and logprobs of the new tokens); the finished output carries the finish reason.
    FINAL_ONLY: one output, when the request finishes (`LLM.generate`). Without stop strings its text
        is decoded once, at the end, rather than token by token.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


def logprob_entries(logprobs: dict[int, float], sampled_id: int | None, sampled_rank: int | None,
                    decode: Callable[[int], str] | None) -> dict[int, Logprob]:
    """{token id: logprob} of one position -> {token id: `Logprob`}, same keys and order.

    The sampled (or prompt) token gets `sampled_rank`; every other entry is one of the most likely
    tokens, so all tokens above it are entries too: its rank is 1 + the entries with a larger logprob.
    """
    return {token_id: Logprob(logprob, sampled_rank if token_id == sampled_id else
                              1 + sum(other > logprob for other in logprobs.values()),
                              None if decode is None else decode(token_id))
            for token_id, logprob in logprobs.items()}


class InvalidOutput(ValueError):
    """An output was built with inconsistent fields; the message names the field."""


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's logprob entry, vLLM's shape.

    Attributes:
        logprob: log-probability of the token under the model's raw distribution.
        rank: 1 + the number of tokens of the vocabulary with a larger logprob (1 = the most likely).
        decoded_token: the token's text on its own (special tokens included), or None without a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated sample of a request, as of the step that produced it.

    Attributes:
        index: which sample of the request (0 for a request with one sample).
        text: the output text so far; stop strings are cut unless include_stop_str_in_output.
        token_ids: the output token ids so far (a stop token id or EOS that ended it included).
        finish_reason: None while running, else one of `FINISH_REASONS`.
        logprobs: None unless SamplingParams.logprobs was set; else one dict per entry of token_ids
            mapping token id -> logprob (float, of the model's raw distribution) holding the
            sampled token and the SamplingParams.logprobs most likely alternatives.
        stop_reason: for finish_reason "stop", the stop string (str) or the stop token id (int) that
            ended the output; None when EOS ended it or the output did not stop.
        ignored_reason: for finish_reason "ignored", why the request was not run; else None.
        error_reason: for finish_reason "error", why the request could not go on; else None.
        logprob_entries: None unless SamplingParams.logprob_entries (with logprobs set); else the same
            entries as `logprobs`, each a `Logprob` with its rank and decoded token (vLLM's shape).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None
    ignored_reason: str | None = None
    error_reason: str | None = None
    logprob_entries: list[dict[int, Logprob]] | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise InvalidOutput(f"index={self.index} must be >= 0")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            allowed = ", ".join(sorted(FINISH_REASONS))
            raise InvalidOutput(f"finish_reason={self.finish_reason!r} must be None or one of {allowed}")
        if (self.finish_reason == FINISH_IGNORED) != (self.ignored_reason is not None):
            raise InvalidOutput(
                f"ignored_reason={self.ignored_reason!r} must be set exactly when finish_reason is "
                f"'ignored' (finish_reason={self.finish_reason!r})"
            )
        if (self.finish_reason == FINISH_ERROR) != (self.error_reason is not None):
            raise InvalidOutput(
                f"error_reason={self.error_reason!r} must be set exactly when finish_reason is "
                f"'error' (finish_reason={self.finish_reason!r})"
            )
        if self.stop_reason is not None and self.finish_reason != FINISH_STOP:
            raise InvalidOutput(
                f"stop_reason={self.stop_reason!r} must be None unless finish_reason is 'stop' "
                f"(finish_reason={self.finish_reason!r})"
            )
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise InvalidOutput(
                f"len(logprobs)={len(self.logprobs)} must equal len(token_ids)={len(self.token_ids)}"
            )
        if self.logprob_entries is not None and len(self.logprob_entries) != len(self.token_ids):
            raise InvalidOutput(f"len(logprob_entries)={len(self.logprob_entries)} must equal "
                                f"len(token_ids)={len(self.token_ids)}")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The state of one request after an engine step.

    Attributes:
        request_id: the id the request was submitted with.
        prompt: the prompt text, or None when the request gave token ids only.
        prompt_token_ids: the prompt as token ids.
        outputs: one `CompletionOutput` per sample, in index order.
        finished: True once every sample has a finish reason (checked).
        prompt_logprobs: None unless SamplingParams.prompt_logprobs; else one entry per prompt token:
            None for the first, then {token id: Logprob} holding the prompt token (its logprob given
            the tokens before it) and the prompt_logprobs most likely alternatives. Filled once the
            prompt is prefilled (empty before).
        num_cached_tokens: prompt tokens served from the prefix cache (their prefill skipped), known
            once the request is admitted (0 before, and with prefix caching off).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.outputs:
            raise InvalidOutput(f"outputs of request {self.request_id!r} must hold at least one sample")
        for position, output in enumerate(self.outputs):
            if output.index != position:
                raise InvalidOutput(f"outputs[{position}].index={output.index} must be {position}")
        all_finished = all(output.finished for output in self.outputs)
        if self.finished != all_finished:
            raise InvalidOutput(
                f"finished={self.finished} must equal whether every output has a finish_reason "
                f"({all_finished}) for request {self.request_id!r}"
            )


_set = object.__setattr__


def running_output(request_id: str, prompt: str | None, prompt_token_ids: list[int], text: str,
                   token_ids: list[int], logprobs: list[dict[int, float]] | None,
                   logprob_entries: list[dict[int, Logprob]] | None = None,
                   prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
                   num_cached_tokens: int = 0) -> RequestOutput:
    """The `RequestOutput` of a request that is still running (one sample, no finish reason), built
    without the field checks: they only concern finish reasons, which a running output has none of,
    and the logprobs length, which the engine keeps equal to the token count (`Request.add_token`).
    The engine builds one per running request per step; finished outputs go through the checks."""
    completion = object.__new__(CompletionOutput)
    _set(completion, "index", 0)
    _set(completion, "text", text)
    _set(completion, "token_ids", token_ids)
    _set(completion, "finish_reason", None)
    _set(completion, "logprobs", logprobs)
    _set(completion, "stop_reason", None)
    _set(completion, "ignored_reason", None)
    _set(completion, "error_reason", None)
    _set(completion, "logprob_entries", logprob_entries)
    output = object.__new__(RequestOutput)
    _set(output, "request_id", request_id)
    _set(output, "prompt", prompt)
    _set(output, "prompt_token_ids", prompt_token_ids)
    _set(output, "outputs", [completion])
    _set(output, "finished", False)
    _set(output, "prompt_logprobs", prompt_logprobs)
    _set(output, "num_cached_tokens", num_cached_tokens)
    return output
