"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

# Below this temperature a row is sampled greedily: dividing float32 logits by such a value no longer
# gives a meaningful distribution (and for tiny values overflows), so argmax is the honest answer.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1


class InvalidSamplingParams(ValueError):
    """A `SamplingParams` field is out of its allowed range; the message names the field."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the output tokens of one request.

    Attributes:
        temperature: >= 0. 0 (anything below `GREEDY_TEMPERATURE` = 1e-5) means greedy: argmax of
            the logits, ties broken towards the lowest token id.
        top_k: -1 or 0 = off, else >= 1: keep the `top_k` most likely tokens.
        top_p: in (0, 1]: keep the smallest set of most likely tokens whose probability is >= top_p.
        min_p: in [0, 1]: drop tokens whose probability is < min_p * (probability of the top token).
        max_tokens: >= 1, or None = generate until the model's max_model_len.
        min_tokens: >= 0 and <= max_tokens: EOS and `stop_token_ids` cannot be sampled, and stop
            strings do not end the request, before this many output tokens exist.
        stop: stop strings (a str or a sequence of str; normalised to a tuple of non-empty str). The
            output ends at the first one that completes; it is cut from the text unless
            `include_stop_str_in_output`.
        stop_token_ids: token ids (>= 0) that end the request like EOS (normalised to a tuple). The
            stop token stays in `token_ids`; its text is not part of the output.
        ignore_eos: keep generating after EOS (EOS is then an ordinary token).
        seed: None, or an int in [0, 2**64 - 1]: the request then draws from its own generator and its
            tokens do not depend on what else is in the batch.
        logprobs: None = no logprobs; an int in [0, 20] = for every output token return its logprob
            plus the logprobs of this many most likely alternatives.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = ()
    stop_token_ids: Sequence[int] | None = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        temperature = _real("temperature", self.temperature)
        if not temperature >= 0:
            _fail(f"temperature={temperature} must be >= 0 (0 = greedy)")
        top_k = _int("top_k", self.top_k)
        if top_k < -1:
            _fail(f"top_k={top_k} must be -1 or 0 (off) or >= 1")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            _fail(f"top_p={top_p} must be in (0, 1]")
        min_p = _real("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            _fail(f"min_p={min_p} must be in [0, 1]")
        max_tokens = None if self.max_tokens is None else _int("max_tokens", self.max_tokens)
        if max_tokens is not None and max_tokens < 1:
            _fail(f"max_tokens={max_tokens} must be >= 1 (or None = until max_model_len)")
        min_tokens = _int("min_tokens", self.min_tokens)
        if min_tokens < 0:
            _fail(f"min_tokens={min_tokens} must be >= 0")
        if max_tokens is not None and min_tokens > max_tokens:
            _fail(f"min_tokens={min_tokens} must be <= max_tokens={max_tokens}")
        seed = None if self.seed is None else _int("seed", self.seed)
        if seed is not None and not 0 <= seed <= MAX_SEED:
            _fail(f"seed={seed} must be None or in [0, 2**64 - 1]")
        logprobs = None if self.logprobs is None else _int("logprobs", self.logprobs)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            _fail(f"logprobs={logprobs} must be None or in [0, {MAX_LOGPROBS}]")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        normalised = {
            "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
            "max_tokens": max_tokens, "min_tokens": min_tokens, "seed": seed, "logprobs": logprobs,
            "stop": _normalise_stop(self.stop),
            "stop_token_ids": _normalise_stop_token_ids(self.stop_token_ids),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax (temperature below `GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1


def _fail(message: str) -> NoReturn:
    raise InvalidSamplingParams(message)


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(f"{name}={value!r} must be an int")
    return int(value)  # type: ignore[call-overload]


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(f"{name}={value!r} must be a float")
    result = float(value)  # type: ignore[arg-type]
    if not math.isfinite(result):
        _fail(f"{name}={value!r} must be finite")
    return result


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        _fail(f"{name}={value!r} must be a bool")


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, Sequence):
        _fail(f"stop={stop!r} must be a str or a sequence of str")
    result = tuple(items)  # type: ignore[arg-type]
    for i, item in enumerate(result):
        if not isinstance(item, str):
            _fail(f"stop[{i}]={item!r} must be a str")
        if not item:
            _fail(f"stop[{i}]='' must be a non-empty str")
    return result


def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        _fail(f"stop_token_ids={ids!r} must be a sequence of int")
    result = tuple(ids)  # type: ignore[arg-type]
    for i, item in enumerate(result):
        if isinstance(item, bool) or not isinstance(item, numbers.Integral) or item < 0:
            _fail(f"stop_token_ids[{i}]={item!r} must be an int >= 0")
    return tuple(int(item) for item in result)
