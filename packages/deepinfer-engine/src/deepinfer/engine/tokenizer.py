"""Text in and out: `Tokenizer` (the `tokenizers` library over tokenizer.json), the per-request
`IncrementalDetokenizer`, and the `StopStringChecker` that ends outputs on stop strings.

Nothing from the model folder is executed: only tokenizer.json and plain JSON configs are read.

Per request, the engine chains the two streaming objects after each step:

    delta = detokenizer.add(new_token_ids)
    update = checker.add(delta, allow_stop=num_output_tokens >= params.min_tokens)
    if update.stopped: finish with "stop" (stop_reason=update.stop_str); text = checker.text
    elif finished another way: checker.add(detokenizer.finish(), allow_stop=...); checker.finish()
    stream update.delta (plus what the two finish() calls released)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

REPLACEMENT_CHAR = "\ufffd"   # what lossy UTF-8 decoding gives for bytes that are not (yet) a char


class TokenizerLoadError(ValueError):
    """tokenizer.json or a config next to it cannot be used; the message names the file and field."""


class NoTokenizerError(ValueError):
    """A text prompt was given but the model folder has no tokenizer.json."""


class Tokenizer:
    """Encodes text to token ids and back, with the model's EOS / BOS ids.

    Args:
        backend: a loaded `tokenizers.Tokenizer`.
        eos_token_ids: ids that end generation (may be empty).
        bos_token_id: the BOS id, or None.
        add_bos: prepend BOS in `encode` (when special tokens are added) if the backend did not.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        add_bos: bool = False,
    ) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        named = [(f"eos_token_ids[{i}]", t) for i, t in enumerate(eos_token_ids)]
        for name, token_id in named + [("bos_token_id", bos_token_id)] * (bos_token_id is not None):
            if not _is_token_id(token_id, self.vocab_size):
                raise TokenizerLoadError(f"{name}={token_id!r} must be an int in [0, {self.vocab_size})")
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (int, each in [0, vocab_size))."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids -> text; bytes that do not form UTF-8 characters decode to U+FFFD."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """Load `<model_dir>/tokenizer.json`; None when the folder has none (token-id prompts only).

    EOS ids come from the first of generation_config.json `eos_token_id`, config.json
    `eos_token_id`, tokenizer_config.json `eos_token` that is present (int or list of int, or a
    token string); BOS likewise from `bos_token_id` / `bos_token`. tokenizer_config.json
    `add_bos_token` sets `add_bos`. Any `auto_map` / custom code in the folder is ignored.

    Raises:
        TokenizerLoadError: model_dir is not a directory, or a file or field is malformed.
    """
    folder = Path(model_dir)
    if not folder.is_dir():
        raise TokenizerLoadError(f"model_dir={str(model_dir)!r} is not a directory")
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception
        raise TokenizerLoadError(f"{path}: cannot be loaded by the tokenizers library: {error}") from error
    configs = [(name, _read_json(folder / name)) for name in
               ("generation_config.json", "config.json", "tokenizer_config.json")]
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    eos = _first_token_ids(configs, "eos", backend, vocab_size)
    bos = _first_token_ids(configs, "bos", backend, vocab_size)
    if len(bos) > 1:
        raise TokenizerLoadError(f"{folder}: bos token must be a single id, got {list(bos)}")
    tokenizer_config = configs[2][1] or {}
    add_bos = tokenizer_config.get("add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise TokenizerLoadError(f"tokenizer_config.json: add_bos_token={add_bos!r} must be true or false")
    return Tokenizer(backend, eos_token_ids=eos, bos_token_id=bos[0] if bos else None, add_bos=add_bos)


def require_tokenizer(tokenizer: Tokenizer | None, model_dir: str | Path) -> Tokenizer:
    """The tokenizer, or a `NoTokenizerError` explaining that only token-id prompts work."""
    if tokenizer is None:
        raise NoTokenizerError(
            f"prompt is text but {str(model_dir)!r} has no tokenizer.json: give the prompt as token ids "
            f"(prompt_token_ids) or add a tokenizer.json to the model folder"
        )
    return tokenizer


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerLoadError(f"{path}: not readable JSON: {error}") from error
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path}: must hold a JSON object")
    return data


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _first_token_ids(
    configs: list[tuple[str, dict[str, Any] | None]],
    kind: str,
    backend: tokenizers.Tokenizer,
    vocab_size: int,
) -> tuple[int, ...]:
    for file_name, config in configs:
        if config is None:
            continue
        if file_name == "tokenizer_config.json":
            field, value = f"{kind}_token", config.get(f"{kind}_token")
            if isinstance(value, dict):   # serialised AddedToken
                value = value.get("content")
            if value is None:
                continue
            token_id = backend.token_to_id(value) if isinstance(value, str) else None
            if token_id is None:
                raise TokenizerLoadError(f"{file_name}: {field}={value!r} is not a token of tokenizer.json")
            return (token_id,)
        field, value = f"{kind}_token_id", config.get(f"{kind}_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        for token_id in ids:
            if not _is_token_id(token_id, vocab_size):
                raise TokenizerLoadError(
                    f"{file_name}: {field}={value!r} must be an int or list of int in [0, {vocab_size})"
                )
        return tuple(ids)
    return ()


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas as they arrive.

    The concatenation of every `add` result and the final `finish` result equals
    `tokenizer.decode(all_ids)`. Trailing U+FFFD characters (bytes of a character whose remaining
    bytes may come with the next token) are held back until the character completes, a real
    character follows, or `finish` is called, so no U+FFFD is ever emitted for a character that
    later completes. Each call decodes only the tokens since the previous clean character boundary.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0          # window start: a clean character boundary
        self._read = 0            # tokens whose text is fully emitted
        self._base = ""           # decode(ids[prefix:read])
        self._num_emitted_new = 0  # chars of the text after `read` already emitted
        self._num_committed_chars = 0
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append token ids (any number); return the text that became final (maybe '')."""
        if self._finished:
            raise ValueError("IncrementalDetokenizer.add called after finish()")
        self._ids.extend(token_ids)
        window = self._window_text()
        new = window[len(self._base):]
        stable = new.rstrip(REPLACEMENT_CHAR)
        delta = stable[self._num_emitted_new:]
        if len(stable) < len(new):
            self._num_emitted_new = max(self._num_emitted_new, len(stable))
            return delta
        # No incomplete character at the end: the window's end is a clean boundary. The next window
        # starts at this chunk, unless the chunk alone decodes to nothing (skipped special tokens):
        # a window must open with visible text, as decoders such as Metaspace strip the leading
        # space of the first token they see.
        self._num_committed_chars += len(new)
        chunk_text = self._decode(self._ids[self._read:])
        if chunk_text:
            self._prefix, self._base = self._read, chunk_text
        else:
            self._base = window
        self._read = len(self._ids)
        self._num_emitted_new = 0
        return delta

    def finish(self) -> str:
        """The request ended: return everything held back (a dangling partial char as U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        return self._window_text()[len(self._base) + self._num_emitted_new:]

    def _window_text(self) -> str:
        """decode(ids[prefix:]); it must extend `_base`, else fall back to decoding every token."""
        text = self._decode(self._ids[self._prefix:])
        if not text.startswith(self._base):
            # The decoder rewrote text before the window's end (not seen with byte-level BPE):
            # decode from the first token; the text emitted so far is taken as given.
            self._prefix = 0
            text = self._decode(self._ids)
            self._base = text[:self._num_committed_chars]
        return text

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


@dataclass(frozen=True, slots=True)
class StopUpdate:
    """Result of feeding a text delta to a `StopStringChecker`."""

    delta: str               # text that may be streamed now (never retracted later)
    stop_str: str | None     # the stop string that ended the output, None if it did not stop

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None


class StopStringChecker:
    """Finds stop strings in one request's streamed text and decides what may be streamed.

    The output stops at the stop-string occurrence that completes first (smallest end; if several
    end at the same place, the longest), so the result does not depend on how the text was split
    into deltas. The stop string is cut from the text unless `include_stop_str_in_output`. Text
    that could still be the start of a stop string is held back until resolved.

    Args:
        stop: the stop strings (non-empty str).
        include_stop_str_in_output: keep the matched stop string.
    """

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        for i, item in enumerate(stop):
            if not isinstance(item, str) or not item:
                raise ValueError(f"stop[{i}]={item!r} must be a non-empty str")
        self._stop = tuple(stop)
        self._include = include_stop_str_in_output
        self._prefixes = {s[:k] for s in self._stop for k in range(1, len(s))}
        self._max_held = max((len(s) - 1 for s in self._stop), default=0)
        self._streamed: list[str] = []
        self._held = ""
        self._stop_str: str | None = None

    @property
    def text(self) -> str:
        """The text released so far (held-back text excluded)."""
        return "".join(self._streamed)

    @property
    def stop_str(self) -> str | None:
        return self._stop_str

    def add(self, delta: str, *, allow_stop: bool = True) -> StopUpdate:
        """Feed the next text delta. With allow_stop=False (before min_tokens) no stop string can
        end the output, and occurrences completed by this delta never count later either."""
        if self._stop_str is not None:
            raise ValueError(f"StopStringChecker.add called after stop string {self._stop_str!r} matched")
        text = self._held + delta
        if allow_stop:
            match = self._earliest_match(text, len(self._held))
            if match is not None:
                start, stop = match
                released = text[:start + len(stop) if self._include else start]
                self._held, self._stop_str = "", stop
                self._streamed.append(released)
                return StopUpdate(released, stop)
        num_held = self._held_suffix_len(text)
        released = text[:len(text) - num_held]
        self._held = text[len(text) - num_held:]
        self._streamed.append(released)
        return StopUpdate(released, None)

    def finish(self) -> str:
        """The output ended another way: release the held-back text and return it."""
        released, self._held = self._held, ""
        self._streamed.append(released)
        return released

    def _earliest_match(self, text: str, num_checked: int) -> tuple[int, str] | None:
        """The (start, stop) whose end is smallest (then longest stop) among ends > num_checked."""
        best: tuple[int, int, str] | None = None   # (end, -len, stop)
        for stop in self._stop:
            start = text.find(stop, max(0, num_checked - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                best = key if best is None or key < best else best
        return None if best is None else (best[0] + best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        for length in range(min(self._max_held, len(text)), 0, -1):
            if text[len(text) - length:] in self._prefixes:
                return length
        return 0
