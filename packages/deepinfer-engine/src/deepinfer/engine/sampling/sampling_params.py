"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn, cast

from ..text.text_checks import lone_surrogate_at

# Below this temperature a row is sampled greedily: dividing float32 logits by such a value no longer
# gives a meaningful distribution (and for tiny values overflows), so argmax is the honest answer.
GREEDY_TEMPERATURE = 1e-5
# Above this the tempered distribution is uniform for every purpose (logits spread over less than 100
# give probabilities within 1 % of each other); the bound keeps float32(temperature) far from inf.
MAX_TEMPERATURE = 1e4
# The smallest top_p, and the smallest non-zero min_p. The sampler multiplies them (in float32) by a
# probability >= 1 / vocab_size > 2**-31; the product stays a normal float32 (>= 2**-126), so a kernel
# that flushes denormals to zero never turns the cut into 0 (which would keep no token at all).
MIN_PROBABILITY_CUT = 1e-20
MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1
MAX_NUM_TOKENS = 2**31 - 1      # max_tokens, min_tokens and top_k: within int32
MAX_TOKEN_ID = 2**31 - 1        # a stop_token_ids entry
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024      # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_STRUCTURED_CHARS = 2**20   # a schema (compact JSON), regex or grammar; all choices together
MAX_CHOICES = 4096
MAX_SCHEMA_DEPTH = 100         # JSON nesting of a schema (objects and arrays); xgrammar's compile recurses on it
MAX_GROUP_DEPTH = 100          # nested parentheses in a regex, a grammar or a schema's pattern
MAX_REPETITION = 1000           # a {m,n} count in a regex, a grammar or a schema's pattern (compile time grows fast)
MAX_N = 128                     # parallel samples of one request
MAX_PENALTY = 2.0               # presence / frequency penalties in [-2, 2]; repetition in (0, 2]
MAX_LOGIT_BIAS = 100.0          # a logit_bias value in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 2**20   # entries of allowed_token_ids
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 16        # tokens of one bad word once tokenized (checked by the engine)


class InvalidSamplingParams(ValueError):
    """A `SamplingParams` field is out of its allowed range; the message names the field."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output text; exactly one field is set.

    The output is decoded under the constraint (a token bitmask per step) and ends with EOS once the
    constraint is satisfied and nothing more may follow. A request that hits `max_tokens` or a stop
    string first ends there, possibly incomplete.

    Attributes:
        json: a JSON schema, as a dict or JSON text; normalised to compact JSON text (key order kept).
            Must be a JSON object or a boolean. The output is one JSON value valid against it,
            written with ", " and ": " separators and no other whitespace.
        regex: the whole output matches this regular expression (xgrammar's dialect, close to
            ECMAScript; implicitly anchored at both ends).
        grammar: an EBNF grammar in the GBNF form of llama.cpp, with a `root` rule.
        choice: the output is exactly one of these strings (a non-empty sequence of non-empty str;
            normalised to a tuple).

    Sizes are capped (compiling a grammar costs time and memory in proportion): the compact JSON
    schema, the regex and the grammar are at most MAX_STRUCTURED_CHARS (2**20) characters each; choice
    holds at most MAX_CHOICES (4096) strings of at most MAX_STRUCTURED_CHARS characters in all. A
    schema nests at most MAX_SCHEMA_DEPTH (100) objects and arrays deep; parentheses in the regex,
    the grammar or a schema's "pattern" nest at most MAX_GROUP_DEPTH (100) deep, and a
    repetition count `{m,n}` in them is at most
    MAX_REPETITION (1000): xgrammar's compile time grows faster than linearly in it (a schema pattern
    `[a-z]{1,10000}` compiles for over a minute). The compile itself is time-bounded too
    (`grammar_compiler`).

    Raises:
        InvalidSamplingParams: not exactly one field set, or a field of the wrong type or empty;
            the message names the field (e.g. "structured.json").
    """

    json: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None

    def __post_init__(self) -> None:
        given = [name for name in STRUCTURED_KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            _fail(f"structured: exactly one of json, regex, grammar, choice must be set, got {given or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _normalise_schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f"structured.{name}={value!r} must be a non-empty str")
            if value is not None:
                _check_text(f"structured.{name}", value)
                _check_repetitions(f"structured.{name}", value)
        if self.choice is not None:
            object.__setattr__(self, "choice", _normalise_choice(self.choice))
        kind = self.kind
        size = sum(map(len, self.choice)) if self.choice is not None else len(getattr(self, kind))
        if size > MAX_STRUCTURED_CHARS:
            what = "strings hold" if kind == "choice" else "is"
            _fail(f"structured.{kind} {what} {size} characters; at most {MAX_STRUCTURED_CHARS} are allowed")

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "grammar" or "choice"."""
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal keys compile to the same grammar (the compile cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        return kind, json.dumps(list(value)) if kind == "choice" else value


STRUCTURED_KINDS = ("json", "regex", "grammar", "choice")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the output tokens of one request.

    Every size-like field is capped and every float is checked so that its float32 value (the
    sampler's precision) does what was asked; a value outside its range raises an error naming the
    field and the range.

    Attributes:
        temperature: in [0, `MAX_TEMPERATURE` = 1e4]. 0 (anything below `GREEDY_TEMPERATURE` = 1e-5)
            means greedy: argmax of the logits, ties broken towards the lowest token id. From 1e-5 on,
            logits up to 1e33 in magnitude divided by float32(temperature) stay finite (larger ones
            fail the request as "non-finite logits").
        top_k: -1 or 0 = off, else in [1, 2**31 - 1]: keep the `top_k` most likely tokens.
        top_p: in [`MIN_PROBABILITY_CUT` = 1e-20, 1]: keep the smallest set of most likely tokens whose
            probability is >= top_p. Smaller values would round to 0 or to a denormal in float32
            (1e-46 is 0 there); 1e-20 already keeps only the most likely token (the lowest id of ties).
        min_p: 0, or in [1e-20, 1]: drop tokens whose probability is < min_p * (probability of the top
            token).
        max_tokens: in [1, 2**31 - 1], or None = generate until the model's max_model_len.
        min_tokens: in [0, 2**31 - 1] and <= max_tokens: EOS and `stop_token_ids` cannot be sampled,
            and stop strings do not end the request, before this many output tokens exist.
        stop: stop strings (a str or a sequence of str; normalised to a tuple of non-empty str): at most
            `MAX_STOP_STRINGS` = 64 of them, each at most `MAX_STOP_STRING_LEN` = 1,024 characters. The
            output ends at the first one that completes; it is cut from the text unless
            `include_stop_str_in_output`.
        stop_token_ids: at most `MAX_STOP_TOKEN_IDS` = 1,024 token ids in [0, 2**31 - 1] that end the
            request like EOS (normalised to a tuple; ids outside the vocabulary never occur). The stop
            token stays in `token_ids`; its text is not part of the output.
        ignore_eos: keep generating after EOS (EOS is then an ordinary token).
        seed: None, or an int in [0, 2**64 - 1]: the request then draws from its own generator and its
            tokens do not depend on what else is in the batch.
        logprobs: None = no logprobs; an int in [0, 20] = for every output token return its logprob
            plus the logprobs of this many most likely alternatives.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        structured: None, or a `StructuredOutput` the output must follow (JSON schema, regex, EBNF
            grammar or choice). Needs a tokenizer and the xgrammar package; cannot be combined with
            ignore_eos (a constrained output ends with EOS).
        n: in [1, `MAX_N` = 128]: parallel samples of the prompt (prefilled once, then forked
            copy-on-write). With a seed, sample i draws from seed + i (mod 2**64).
        presence_penalty: in [-2, 2]: subtracted from the logit of every token the output already
            holds (vLLM / OpenAI). 0 = off.
        frequency_penalty: in [-2, 2]: times the token's count in the output so far, subtracted from
            its logit. 0 = off.
        repetition_penalty: in (0, 2]: for tokens of the prompt or the output so far, a positive logit
            is divided by it and a negative one multiplied (HF / vLLM). 1 = off.
        logit_bias: None, or {token id: bias}: at most `MAX_LOGIT_BIAS_ENTRIES` = 1,024 entries, each
            bias in [-100, 100], added to the logit before sampling (normalised to a tuple of
            (token id, bias) pairs, ascending id; ids are checked against the vocabulary by the engine).
        allowed_token_ids: None, or a non-empty sequence of token ids: only these may be sampled
            (normalised to a sorted tuple without duplicates; checked against the vocabulary by the engine).
        bad_words: words that must not be generated (normalised to a tuple of non-empty str, at most
            `MAX_BAD_WORDS` = 128): each is tokenized (with and without a leading space, as vLLM does),
            and the last token of a tokenized word is banned while the output ends with its other tokens.
            Needs a tokenizer.
        prompt_logprobs: None, or an int in [0, 20]: the logprob of every prompt token given its prefix
            (None for the first one) plus this many most likely alternatives.
        skip_special_tokens: leave special tokens out of the output text.
        logprob_entries: with logprobs set, also return them as `Logprob` entries (logprob, rank in
            the vocabulary, decoded token: vLLM's shape) in `CompletionOutput.logprob_entries`.

        Penalties, logit_bias, allowed_token_ids and bad_words change what is sampled (greedy rows
        too); the logprobs stay those of the raw distribution. They apply in vLLM's order:
        allowed_token_ids, bad_words, min_tokens bans and logit_bias, then the penalties (repetition,
        then frequency and presence).

    Raises:
        InvalidSamplingParams: a field of the wrong type or outside its range (NaN and inf included).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] = ()                  # None is taken as () too
    stop_token_ids: Sequence[int] = ()              # None is taken as () too
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = ()
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logprob_entries: bool = False

    def __post_init__(self) -> None:
        normalised: dict[str, object] = {**_cuts(self), **_counts(self)}
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            _fail(f"structured={self.structured!r} must be None or a StructuredOutput")
        if self.structured is not None and self.ignore_eos:
            _fail("ignore_eos=True cannot be combined with structured: a constrained output ends with EOS")
        num_samples = _int("n", self.n)
        if not 1 <= num_samples <= MAX_N:
            _fail(f"n={num_samples} must be >= 1 and <= {MAX_N}")
        penalties = _penalties(self)
        prompt_logprobs = None if self.prompt_logprobs is None else _int("prompt_logprobs", self.prompt_logprobs)
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            _fail(f"prompt_logprobs={prompt_logprobs} must be None or in [0, {MAX_LOGPROBS}]")
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("logprob_entries", self.logprob_entries)
        if self.logprob_entries and self.logprobs is None:
            _fail("logprob_entries=True needs logprobs set (an int in [0, 20])")
        normalised.update({
            "n": num_samples, "prompt_logprobs": prompt_logprobs, **penalties,
            "logit_bias": _normalise_logit_bias(self.logit_bias),
            "allowed_token_ids": _normalise_allowed(self.allowed_token_ids),
            "bad_words": _normalise_bad_words(self.bad_words),
            "stop": _normalise_stop(self.stop),
            "stop_token_ids": _normalise_stop_token_ids(self.stop_token_ids),
        })
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax (temperature below `GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as normalised: (token id, bias) pairs, ascending id; () when None."""
        return cast("tuple[tuple[int, float], ...]", self.logit_bias or ())

    @property
    def uses_penalties(self) -> bool:
        """True when a penalty is on: the sampler needs the request's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _cuts(params: SamplingParams) -> dict[str, float | int]:
    """temperature, top_k, top_p and min_p, checked."""
    temperature = _real("temperature", params.temperature)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        _fail(f"temperature={temperature} must be >= 0 and <= {MAX_TEMPERATURE:g} "
              f"(0, or anything below {GREEDY_TEMPERATURE:g}, = greedy)")
    top_k = _int("top_k", params.top_k)
    if not -1 <= top_k <= MAX_NUM_TOKENS:
        _fail(f"top_k={top_k} must be -1 or 0 (off) or >= 1 (at most {MAX_NUM_TOKENS})")
    top_p = _real("top_p", params.top_p)
    if not MIN_PROBABILITY_CUT <= top_p <= 1:
        _fail(f"top_p={top_p} must be in (0, 1], and >= {MIN_PROBABILITY_CUT:g} (a smaller cut is 0 or "
              "a denormal in the sampler's float32)")
    min_p = _real("min_p", params.min_p)
    if not (0 <= min_p <= 1 and (min_p == 0 or min_p >= MIN_PROBABILITY_CUT)):
        _fail(f"min_p={min_p} must be in [0, 1], and 0 or >= {MIN_PROBABILITY_CUT:g} (a smaller cut is 0 "
              "or a denormal in the sampler's float32)")
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}


def _counts(params: SamplingParams) -> dict[str, int | None]:
    """max_tokens, min_tokens, seed and logprobs, checked."""
    max_tokens = None if params.max_tokens is None else _int("max_tokens", params.max_tokens)
    if max_tokens is not None and not 1 <= max_tokens <= MAX_NUM_TOKENS:
        _fail(f"max_tokens={max_tokens} must be >= 1 (or None = until max_model_len) and <= {MAX_NUM_TOKENS}")
    min_tokens = _int("min_tokens", params.min_tokens)
    if not 0 <= min_tokens <= MAX_NUM_TOKENS:
        _fail(f"min_tokens={min_tokens} must be >= 0 and <= {MAX_NUM_TOKENS}")
    if max_tokens is not None and min_tokens > max_tokens:
        _fail(f"min_tokens={min_tokens} must be <= max_tokens={max_tokens}")
    seed = None if params.seed is None else _int("seed", params.seed)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        _fail(f"seed={seed} must be None or in [0, 2**64 - 1]")
    logprobs = None if params.logprobs is None else _int("logprobs", params.logprobs)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        _fail(f"logprobs={logprobs} must be None or in [0, {MAX_LOGPROBS}]")
    return {"max_tokens": max_tokens, "min_tokens": min_tokens, "seed": seed, "logprobs": logprobs}


def _penalties(params: SamplingParams) -> dict[str, float]:
    penalties = {name: _real(name, getattr(params, name))
                 for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")}
    for name in ("presence_penalty", "frequency_penalty"):
        if not -MAX_PENALTY <= penalties[name] <= MAX_PENALTY:
            _fail(f"{name}={penalties[name]} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)")
    if not 0 < penalties["repetition_penalty"] <= MAX_PENALTY:
        _fail(f"repetition_penalty={penalties['repetition_penalty']} must be in (0, {MAX_PENALTY:g}] (1 = off)")
    return penalties


def _fail(message: str) -> NoReturn:
    raise InvalidSamplingParams(message)


def _check_text(name: str, text: str) -> None:
    """A str field must be Unicode text: a lone surrogate (`text_checks`) is refused, naming the field."""
    at = lone_surrogate_at(text)
    if at is not None:
        _fail(f"{name} holds a lone surrogate at index {at}: not valid Unicode text")


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(f"{name}={value!r} must be an int")
    return int(value)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(f"{name}={value!r} must be a float")
    result = float(value)
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
    if len(items) > MAX_STOP_STRINGS:
        _fail(f"stop has {len(items)} strings: at most {MAX_STOP_STRINGS} are allowed")
    result = tuple(items)
    for i, item in enumerate(result):
        if not isinstance(item, str):
            _fail(f"stop[{i}]={item!r} must be a str")
        if not item:
            _fail(f"stop[{i}]='' must be a non-empty str")
        if len(item) > MAX_STOP_STRING_LEN:
            _fail(f"stop[{i}] has {len(item)} characters: at most {MAX_STOP_STRING_LEN} are allowed")
        _check_text(f"stop[{i}]", item)
    return result


def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        _fail(f"stop_token_ids={ids!r} must be a sequence of int")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        _fail(f"stop_token_ids has {len(ids)} ids: at most {MAX_STOP_TOKEN_IDS} are allowed")
    result = tuple(ids)
    for i, item in enumerate(result):
        if isinstance(item, bool) or not isinstance(item, numbers.Integral) or not 0 <= int(item) <= MAX_TOKEN_ID:
            _fail(f"stop_token_ids[{i}]={item!r} must be an int >= 0 and <= {MAX_TOKEN_ID}")
    return tuple(int(item) for item in result)


def _token_id(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) <= MAX_TOKEN_ID:
        _fail(f"{name}={value!r} must be an int >= 0 and <= {MAX_TOKEN_ID}")
    return int(value)


def _normalise_logit_bias(bias: object) -> tuple[tuple[int, float], ...] | None:
    if bias is None:
        return None
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, Sequence) and not isinstance(bias, str | bytes):
        items = list(bias)
        if not all(isinstance(item, tuple | list) and len(item) == 2 for item in items):
            _fail("logit_bias must be a mapping {token id: bias} or a sequence of (token id, bias) pairs")
    else:
        _fail(f"logit_bias={bias!r} must be a mapping {{token id: bias}}")
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        _fail(f"logit_bias has {len(items)} entries: at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    result: dict[int, float] = {}
    for token_id, value in items:
        key = _token_id("logit_bias key", token_id)
        if key in result:
            _fail(f"logit_bias holds token id {key} twice")
        amount = _real(f"logit_bias[{key}]", value)
        if not -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS:
            _fail(f"logit_bias[{key}]={amount} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        result[key] = amount
    return tuple(sorted(result.items())) or None


def _normalise_allowed(ids: object) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence) or not ids:
        _fail(f"allowed_token_ids={ids!r} must be None or a non-empty sequence of int")
    if len(ids) > MAX_ALLOWED_TOKEN_IDS:
        _fail(f"allowed_token_ids has {len(ids)} ids: at most {MAX_ALLOWED_TOKEN_IDS} are allowed")
    return tuple(sorted({_token_id(f"allowed_token_ids[{i}]", t) for i, t in enumerate(ids)}))


def _normalise_bad_words(words: object) -> tuple[str, ...]:
    if words is None:
        return ()
    if isinstance(words, str | bytes) or not isinstance(words, Sequence):
        _fail(f"bad_words={words!r} must be a sequence of str")
    if len(words) > MAX_BAD_WORDS:
        _fail(f"bad_words has {len(words)} words: at most {MAX_BAD_WORDS} are allowed")
    for i, word in enumerate(words):
        if not isinstance(word, str) or not word.strip():
            _fail(f"bad_words[{i}]={word!r} must be a non-empty str")
        if len(word) > MAX_STOP_STRING_LEN:
            _fail(f"bad_words[{i}] has {len(word)} characters: at most {MAX_STOP_STRING_LEN} are allowed")
        _check_text(f"bad_words[{i}]", word)
    return tuple(words)


def _normalise_schema(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            _fail(f"structured.json is not valid JSON text: {error}")
        except RecursionError:
            _fail(f"structured.json is nested more than {MAX_SCHEMA_DEPTH} levels deep (objects and arrays)")
    if not isinstance(schema, dict | bool):
        _fail(f"structured.json must be a JSON schema (an object or a boolean), got {type(schema).__name__}")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        _fail(f"structured.json is nested more than {MAX_SCHEMA_DEPTH} levels deep (objects and arrays); at most "
              f"{MAX_SCHEMA_DEPTH} are allowed")
    for where, pattern in _schema_patterns(schema):
        _check_repetitions(f"structured.json{where}", pattern)
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        _fail(f"structured.json cannot be written as JSON: {error}")
    _check_text("structured.json", text)
    return text


_REPETITION = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _check_repetitions(name: str, pattern: str) -> None:
    """Refuse a `{m}` / `{m,n}` count above MAX_REPETITION (an escaped `\\{` is a literal brace), and
    parentheses nested deeper than MAX_GROUP_DEPTH (xgrammar's parsers recurse on them)."""
    depth = deepest = 0
    escaped = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
    if deepest > MAX_GROUP_DEPTH:
        _fail(f"{name}: parentheses nest {deepest} deep; at most {MAX_GROUP_DEPTH} are allowed")
    for found in _REPETITION.finditer(pattern):
        counts = [c for c in found.groups() if c]
        if any(len(c) > 9 or int(c) > MAX_REPETITION for c in counts):
            _fail(f"{name}: the repetition {found.group(0)[:40]} exceeds {MAX_REPETITION} (compiling it would take "
                  "too long); use a smaller count, or maxLength / maxItems in a JSON schema")


def _depth(value: object, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How deeply JSON objects and arrays nest in `value` (0 for a scalar), counted up to limit + 1
    (a Python value that contains itself stops there); iterative."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, level)
            if level <= limit:
                stack.extend((child, level + 1) for child in children)
    return deepest


def _schema_patterns(schema: object) -> list[tuple[str, str]]:
    """(where, regex) of every "pattern" value and "patternProperties" key of a JSON schema."""
    found, stack = [], [(schema, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    found.append((f"{where}.pattern", value))
                if key == "patternProperties" and isinstance(value, dict):
                    found.extend((f"{where}.patternProperties", k) for k in value if isinstance(k, str))
                stack.append((value, f"{where}.{key}"))
        elif isinstance(node, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(node))
    return found


def _normalise_choice(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str | bytes) or not isinstance(choice, Sequence) or not choice:
        _fail(f"structured.choice={choice!r} must be a non-empty sequence of str")
    result = tuple(choice)
    if len(result) > MAX_CHOICES:
        _fail(f"structured.choice holds {len(result)} strings; at most {MAX_CHOICES} are allowed")
    for i, item in enumerate(result):
        if not isinstance(item, str) or not item:
            _fail(f"structured.choice[{i}]={item!r} must be a non-empty str")
        _check_text(f"structured.choice[{i}]", item)
    return result
