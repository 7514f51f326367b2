"""StopStringChecker: exact streaming semantics against a whole-text model, and memory linear in the
stop strings' length."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.text.detokenizer import StopStringChecker

FAST = settings(max_examples=300, deadline=None, derandomize=True)


def model_stream(
    chunks: list[str], allows: list[bool], stops: list[str], include: bool
) -> tuple[list[str], str | None]:
    """The documented semantics, recomputed from the whole text after every chunk: a stop counts if
    its occurrence ends inside a chunk fed with allow_stop (earliest end, then longest); otherwise
    everything is released except the longest suffix that is a proper prefix of some stop."""
    text, deltas, num_released = "", [], 0
    for chunk, allow in zip(chunks, allows):
        begin = len(text)
        text += chunk
        matches = []
        for stop in stops if allow else []:
            start = text.find(stop, max(0, begin - len(stop) + 1))
            if start >= 0:
                matches.append((start + len(stop), -len(stop), stop))
        if matches:
            end, minus_len, stop = min(matches)
            cut = end if include else end + minus_len
            assert cut >= num_released           # nothing released is ever taken back
            deltas.append(text[num_released:cut])
            return deltas, stop
        held = max((k for stop in stops for k in range(1, min(len(stop), len(text) + 1))
                    if text.endswith(stop[:k])), default=0)
        deltas.append(text[num_released:len(text) - held])
        num_released = len(text) - held
    deltas.append(text[num_released:])
    return deltas, None


def checker_stream(
    checker: StopStringChecker, chunks: list[str], allows: list[bool]
) -> tuple[list[str], str | None]:
    deltas = []
    for chunk, allow in zip(chunks, allows):
        update = checker.add(chunk, allow_stop=allow)
        deltas.append(update.delta)
        if update.stopped:
            return deltas, update.stop_str
    deltas.append(checker.finish())
    return deltas, None


@FAST
@given(
    pieces=st.lists(st.tuples(st.text(alphabet="abc", max_size=7), st.booleans()), max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=4),
    include=st.booleans(),
)
def test_every_delta_matches_the_whole_text_model(
    pieces: list[tuple[str, bool]], stops: list[str], include: bool
) -> None:
    chunks = [chunk for chunk, _ in pieces]
    allows = [allow for _, allow in pieces]
    checker = StopStringChecker(stops, include_stop_str_in_output=include)
    assert checker_stream(checker, chunks, allows) == model_stream(chunks, allows, stops, include)


def test_without_stop_strings_every_delta_passes_through() -> None:
    checker = StopStringChecker([])
    assert [checker.add(d).delta for d in ("a", "", "bc")] == ["a", "", "bc"]
    assert checker.finish() == "" and checker.text == "abc"


def test_periodic_stop_string_survives_overlapping_near_misses() -> None:
    # "abab…ac": after each near miss the longest border keeps most of the text held back.
    stop = "ab" * 5 + "ac"
    checker = StopStringChecker([stop])
    assert checker.add("x" + "ab" * 6).delta == "xab"   # "abababababab" ends with a 10-char border
    assert checker.add("a").delta == ""
    update = checker.add("cz")                          # the stop began right after the released "xab"
    assert (update.delta, update.stop_str, checker.text) == ("", stop, "xab")


def periodic_stop(length: int) -> str:
    """"abab…ab" + "ac": every prefix of it ending in "ab" has a long border, the hard case for a
    matcher that falls back."""
    return "ab" * (length // 2 - 1) + "ac"


@pytest.mark.parametrize("length", [4_000, 200_000])
def test_long_stop_string_is_matched_in_memory_linear_in_its_length(length: int) -> None:
    stop = periodic_stop(length)
    # A near miss ("ab" where the stop has "ac") keeps length - 2 characters held back; "ac" completes
    # the stop two characters into the "ab" run.
    text = "x " + "ab" * (length // 2) + "ac tail"
    chunks = [text[i:i + 1009] for i in range(0, len(text), 1009)]
    tracemalloc.start()
    try:
        checker = StopStringChecker([stop, "zz"])
        deltas, stop_str = checker_stream(checker, chunks, [True] * len(chunks))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stop_str == stop and "".join(deltas) == "x ab" == checker.text
    # Linear: the border table (4 B a char) and a few copies of the held text (1 B a char). Keeping
    # every prefix of the stop string, as the old matcher did, takes length**2 / 2 bytes (8 MB at
    # 4,000 characters, 20 GB at 200,000).
    assert peak < 16 * length + 64 * 1024


def test_long_held_text_is_released_when_the_output_ends() -> None:
    stop = periodic_stop(200_000)
    checker = StopStringChecker([stop], include_stop_str_in_output=True)
    near_miss = "ab" * 100_000
    assert checker.add(near_miss[:150_001]).delta == ""
    assert checker.add(near_miss[150_001:]).delta == "ab"     # the last 199,998 chars may still stop
    assert checker.add("!").delta == "ab" * 99_999 + "!"        # "!" ends every partial match
    assert checker.finish() == "" and checker.text == near_miss + "!"
