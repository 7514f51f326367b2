"""Checks on user text before it is tokenized or compiled.

A lone surrogate (a code point in U+D800..U+DFFF not paired into one character) is not Unicode
text: JSON's "\\ud800" escape and Python strings accept it, but no tokenizer or grammar compiler can
take it (the `tokenizers` library raises TypeError, xgrammar decodes it to U+FFFD). Such text is
refused here with a ValueError naming the field, before anything is registered.

A text's token count has a cheap lower bound: a token covers at most `Tokenizer.max_token_chars`
characters, so a text longer than that many times `max_model_len` cannot fit, and is refused without
tokenizing it (tokenizing megabytes takes seconds).
"""

from __future__ import annotations

import re

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, or None (an O(len) scan, no copy)."""
    found = _LONE_SURROGATE.search(text)
    return None if found is None else found.start()


def check_unicode(text: str, field: str) -> None:
    """Raises ValueError "{field}: ..." when `text` holds a lone surrogate."""
    at = lone_surrogate_at(text)
    if at is not None:
        raise ValueError(f"{field}: holds a lone surrogate {text[at]!r} at index {at}: not valid Unicode text "
                         "(a surrogate must be half of a pair)")


def find_lone_surrogate(value: object, path: str = "") -> str | None:
    """The path ("messages[0].content", "stop[3]", "" for `value` itself) of the first str in a JSON
    value (dicts, lists, str, numbers; keys included) that holds a lone surrogate, or None. Iterative:
    any nesting depth `json` produced is fine."""
    stack: list[tuple[object, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if lone_surrogate_at(item) is not None:
                return where
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                name = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and lone_surrogate_at(key) is not None:
                    return f"{where}[key {ascii(key)}]" if where else f"[key {ascii(key)}]"
                stack.append((child, name))
        elif isinstance(item, list | tuple):
            stack.extend((child, f"{where}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def check_prompt_length(text: str, max_token_chars: int, max_model_len: int, field: str = "prompt") -> None:
    """Raises ValueError "{field}: ..." when `text` is too long to fit `max_model_len` tokens whatever
    it tokenizes to (more than max_token_chars * max_model_len characters): checked before tokenizing."""
    limit = max_token_chars * max_model_len
    if len(text) > limit:
        raise ValueError(f"{field}: {len(text)} characters is at least {len(text) // max_token_chars} tokens (a token "
                         f"covers at most {max_token_chars} characters), more than max_model_len={max_model_len}")


__all__ = ["check_prompt_length", "check_unicode", "find_lone_surrogate", "lone_surrogate_at"]
