"""Per-request text streaming: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns token ids into text deltas (never emitting U+FFFD for a character whose
bytes are still arriving); `StopStringChecker` finds stop strings across deltas and holds back text
that may still become one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"   # what lossy UTF-8 decoding gives for bytes that are not (yet) a char


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
