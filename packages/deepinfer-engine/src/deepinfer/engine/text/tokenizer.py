"""Text in and out: `Tokenizer` (the `tokenizers` library over tokenizer.json) and how it is found in
a model folder. The per-request streaming objects live in `detokenizer`.

Nothing from the model folder is executed: only tokenizer.json and plain JSON configs are read.

Per request, the engine chains the two streaming objects of `detokenizer` after each step:

    delta = detokenizer.add(new_token_ids)
    update = checker.add(delta, allow_stop=num_output_tokens >= params.min_tokens)
    if update.stopped: finish with "stop" (stop_reason=update.stop_str); text = checker.text
    elif finished another way: checker.add(detokenizer.finish(), allow_stop=...); checker.finish()
    stream update.delta (plus what the two finish() calls released)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from .text_checks import check_unicode


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
        """Text -> token ids (int, each in [0, vocab_size)).

        Raises:
            ValueError: `text` holds a lone surrogate (not Unicode text; `text_checks`).
        """
        check_unicode(text, "text")
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids -> text; bytes that do not form UTF-8 characters decode to U+FFFD."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """One token's text on its own, special tokens included (cached: logprob entries ask often)."""
        cache = self.__dict__.setdefault("_token_texts", {})
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: the longest vocabulary entry (a
        byte-level entry holds one character per byte, and a text character is at least one byte)
        or added token, times 2 as a margin for a normaliser that folds characters together."""
        cached = self.__dict__.get("_max_token_chars")
        if cached is None:
            cached = self.__dict__["_max_token_chars"] = 2 * max(
                map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
        return cached


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """Load `<model_dir>/tokenizer.json`; None when the folder has none (token-id prompts only).

    EOS ids come from the first of generation_config.json `eos_token_id`, config.json
    `eos_token_id`, tokenizer_config.json `eos_token` that is present (int or list of int, or a
    token string); BOS likewise from `bos_token_id` / `bos_token`. tokenizer_config.json
    `add_bos_token` sets `add_bos`. Any `auto_map` / custom code in the folder is ignored.

    Raises:
        TokenizerLoadError: model_dir is not a directory, or a file or field is malformed (the message
            names the file's path and what is wrong with it).
    """
    folder = Path(model_dir)
    if not folder.is_dir():
        raise TokenizerLoadError(f"model_dir={str(model_dir)!r} is not a directory")
    path = folder / "tokenizer.json"
    text = _read_text(path)
    if text is None:
        return None
    try:
        backend = tokenizers.Tokenizer.from_str(text)
    except Exception as error:  # the Rust side raises a bare Exception
        _parse_json(path, text)             # a JSON fault gets the same message as in the other files
        raise TokenizerLoadError(f"{path}: cannot be loaded by the tokenizers library: {error}") from error
    configs = [(folder / name, _read_json(folder / name)) for name in
               ("generation_config.json", "config.json", "tokenizer_config.json")]
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    eos = _first_token_ids(configs, "eos", backend, vocab_size)
    bos = _first_token_ids(configs, "bos", backend, vocab_size)
    if len(bos) > 1:
        raise TokenizerLoadError(f"{folder}: bos token must be a single id, got {list(bos)}")
    tokenizer_config = configs[2][1] or {}
    add_bos = tokenizer_config.get("add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise TokenizerLoadError(f"{configs[2][0]}: add_bos_token={add_bos!r} must be true or false")
    return Tokenizer(backend, eos_token_ids=eos, bos_token_id=bos[0] if bos else None, add_bos=add_bos)


def require_tokenizer(tokenizer: Tokenizer | None, model_dir: str | Path) -> Tokenizer:
    """The tokenizer, or a `NoTokenizerError` explaining that only token-id prompts work."""
    if tokenizer is None:
        raise NoTokenizerError(
            f"prompt is text but {str(model_dir)!r} has no tokenizer.json: give the prompt as token ids "
            f"(prompt_token_ids) or add a tokenizer.json to the model folder"
        )
    return tokenizer


def _read_text(path: Path) -> str | None:
    """The UTF-8 text of `path`; None when it does not exist."""
    if not path.exists():
        return None
    if not path.is_file():
        raise TokenizerLoadError(f"{path}: is not a regular file")
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as error:
        raise TokenizerLoadError(f"{path}: cannot be read: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise TokenizerLoadError(f"{path}: not UTF-8 text (invalid byte at offset {error.start})") from None


def _parse_json(path: Path, text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TokenizerLoadError(f"{path}: not valid JSON: {error.msg} at line {error.lineno} column "
                                 f"{error.colno}") from None
    except RecursionError:
        raise TokenizerLoadError(f"{path}: not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(data), "a number")
        raise TokenizerLoadError(f"{path}: must hold a JSON object, got {kind}")
    return data


def _read_json(path: Path) -> dict[str, Any] | None:
    text = _read_text(path)
    return None if text is None else _parse_json(path, text)


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _first_token_ids(
    configs: list[tuple[Path, dict[str, Any] | None]],
    kind: str,
    backend: tokenizers.Tokenizer,
    vocab_size: int,
) -> tuple[int, ...]:
    for file_name, config in configs:
        if config is None:
            continue
        if file_name.name == "tokenizer_config.json":
            field, value = f"{kind}_token", config.get(f"{kind}_token")
            if isinstance(value, dict):   # serialised AddedToken
                if not isinstance(value.get("content"), str):
                    raise TokenizerLoadError(f"{file_name}: {field}={value!r} needs a 'content' string")
                value = value["content"]
            if value is None:
                continue
            if not isinstance(value, str):
                raise TokenizerLoadError(f"{file_name}: {field}={value!r} must be a token string")
            token_id = backend.token_to_id(value)
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
