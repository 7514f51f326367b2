"""Per-request text streaming: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns token ids into text deltas (never emitting U+FFFD for a character whose
bytes are still arriving); `StopStringChecker` finds stop strings across deltas and holds back text
that may still become one.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"   # what lossy UTF-8 decoding gives for bytes that are not (yet) a char
REANCHOR_TOKENS = 8           # a detokenizer window this long moves up to its latest clean chunk


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas as they arrive.

    The concatenation of every `add` result and the final `finish` result equals
    `tokenizer.decode(all_ids)`. Trailing U+FFFD characters (bytes of a character whose remaining
    bytes may come with the next token) are held back until the character completes, a real
    character follows, or `finish` is called, so no U+FFFD is ever emitted for a character that
    later completes. Each call decodes a window of the last few tokens (fewer than
    REANCHOR_TOKENS since a clean character boundary, plus the chunk being added): one decode per
    call, and a second one each time the window moves up.

    Args:
        token_ids: the list of token ids to read, which its owner appends to and then calls `update`
            (a request's `token_ids`: the history is kept once); None = a list of its own, fed by
            `add`.
        start: where the text starts in token_ids (a request's prompt length: only the outputs
            are detokenized); 0 with a list of its own.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 token_ids: list[int] | None = None, start: int = 0) -> None:
        if not 0 <= start <= (0 if token_ids is None else len(token_ids)):
            raise ValueError(f"start={start} must be in [0, len(token_ids)]")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._owns_ids = token_ids is None
        self._ids: list[int] = [] if token_ids is None else token_ids
        self._start = start
        self._prefix = start      # window start: a clean character boundary
        self._read = start        # tokens whose text is fully emitted
        self._base = ""           # decode(ids[prefix:read])
        self._num_emitted_new = 0  # chars of the text after `read` already emitted
        self._num_committed_chars = 0
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._start:]

    def add(self, token_ids: Sequence[int]) -> str:
        """Append token ids (any number); return the text that became final (maybe '')."""
        if not self._owns_ids:
            raise ValueError("this IncrementalDetokenizer reads its owner's token list: append there, then update()")
        if self._finished:
            raise ValueError("IncrementalDetokenizer.add called after finish()")
        self._ids.extend(token_ids)
        return self.update()

    def update(self) -> str:
        """Return the text that became final with the token ids appended since the last call (maybe '')."""
        if self._finished:
            raise ValueError("IncrementalDetokenizer.update called after finish()")
        window = self._window_text()
        new = window[len(self._base):]
        stable = new.rstrip(REPLACEMENT_CHAR)
        delta = stable[self._num_emitted_new:]
        if len(stable) < len(new):
            self._num_emitted_new = max(self._num_emitted_new, len(stable))
            return delta
        # No incomplete character at the end: the window's end is a clean boundary. Once the window
        # holds REANCHOR_TOKENS tokens, the next one starts at this chunk (one more decode, of the
        # chunk alone), unless the chunk decodes to nothing (skipped special tokens): a window must
        # open with visible text, as decoders such as Metaspace strip the leading space of the first
        # token they see. Until then the window grows, and each add costs one decode.
        self._num_committed_chars += len(new)
        chunk_text = self._decode(self._ids[self._read:]) if len(self._ids) - self._prefix >= REANCHOR_TOKENS else ""
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
            self._prefix = self._start
            text = self._decode(self._ids[self._start:])
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

    Each stop string runs a Knuth-Morris-Pratt matcher: its border table (one int32 per character)
    and its state, the length of the longest suffix of the text so far that is a proper prefix of
    it. The held-back text is the longest such suffix over all stop strings. Memory is linear in
    the total stop length (plus the text itself); each delta costs amortised time linear in its
    length per stop string, mostly spent in `str.find` / `str.startswith`.

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
        self._borders = tuple(_border_table(s) for s in self._stop)
        self._states = [0] * len(self._stop)
        self._streamed: list[str] = []
        self._held: deque[str] = deque()   # the held-back text, in pieces; the first starts at _held_start
        self._held_start = 0
        self._num_held = 0
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
        if not self._stop:
            self._streamed.append(delta)
            return StopUpdate(delta, None)
        best: tuple[int, int, str] | None = None    # (end in delta, -len, stop) of the earliest match
        states = list(self._states)
        for index, stop in enumerate(self._stop):
            if states[index] == 0 and stop[0] not in delta:
                continue                             # the common case, decided without a call
            states[index], end = _advance(stop, self._borders[index], states[index], delta,
                                          stop_at_match=allow_stop)
            if end >= 0:
                key = (end, -len(stop), stop)
                best = key if best is None or key < best else best
        if best is not None:
            end, minus_len, stop = best
            held = self._take_held(self._num_held)
            cut = len(held) + end + (0 if self._include else minus_len)
            released = (held + delta[:end])[:cut]
            self._stop_str = stop
            self._streamed.append(released)
            return StopUpdate(released, stop)
        self._states = states
        if delta:
            self._held.append(delta)
            self._num_held += len(delta)
        released = self._take_held(self._num_held - max(states))
        self._streamed.append(released)
        return StopUpdate(released, None)

    def finish(self) -> str:
        """The output ended another way: release the held-back text and return it."""
        released = self._take_held(self._num_held)
        self._states = [0] * len(self._stop)
        self._streamed.append(released)
        return released

    def _take_held(self, num_chars: int) -> str:
        """Remove the first `num_chars` characters of the held-back text and return them (time linear
        in num_chars plus the pieces dropped)."""
        pieces = []
        self._num_held -= num_chars
        while num_chars:
            head = self._held[0]
            available = len(head) - self._held_start
            if available <= num_chars:
                pieces.append(head[self._held_start:])
                self._held.popleft()
                self._held_start = 0
                num_chars -= available
            else:
                pieces.append(head[self._held_start:self._held_start + num_chars])
                self._held_start += num_chars
                num_chars = 0
        return "".join(pieces)


def _border_table(stop: str) -> array:
    """border[i] = the length of the longest proper prefix of stop[:i + 1] that is also its suffix."""
    border = array("i", [0]) * len(stop)
    length = 0
    for i in range(1, len(stop)):
        char = stop[i]
        while length and stop[length] != char:
            length = border[length - 1]
        if stop[length] == char:
            length += 1
        border[i] = length
    return border


def _advance(stop: str, border: array, state: int, text: str, *, stop_at_match: bool) -> tuple[int, int]:
    """Feed `text` to a stop string's matcher in `state` (chars of it matched so far, < len(stop)).

    Returns (state after, end): end = the index in `text` just past the first completed occurrence
    when `stop_at_match` (the state is then len(stop)), else -1; without `stop_at_match` completed
    occurrences are passed over and the state falls back to the longest proper border. Runs of
    matching characters are compared by `str.startswith` (`_match_len`), so a long stop string is
    not walked character by character in Python."""
    size = len(stop)
    first = stop[0]
    i = 0
    while i < len(text):
        if state == 0:
            i = text.find(first, i)
            if i < 0:
                return 0, -1
            state, i = 1, i + 1
        else:
            run = _match_len(text, i, stop, state, min(len(text) - i, size - state))
            if run == 0:                     # text[i] does not continue the match: fall back
                state = border[state - 1]
                continue
            state, i = state + run, i + run
        if state == size:
            if stop_at_match:
                return state, i
            state = border[size - 1]
    return state, -1


def _match_len(text: str, start: int, stop: str, offset: int, limit: int) -> int:
    """The largest k <= limit (>= 1) with text[start:start + k] == stop[offset:offset + k]: doubling,
    then halving, the compared length; time linear in k (comparisons are C `str.startswith`)."""
    if text[start] != stop[offset]:
        return 0
    good = probe = 1                         # text matches for `good` chars, not for `probe` (> good)
    while good < limit:
        probe = min(2 * good, limit)
        if not text.startswith(stop[offset + good:offset + probe], start + good):
            break
        good = probe
    else:
        return good
    while probe - good > 1:
        middle = (good + probe) // 2
        if text.startswith(stop[offset + good:offset + middle], start + good):
            good = middle
        else:
            probe = middle
    return good
