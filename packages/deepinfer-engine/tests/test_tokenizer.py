from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from deepinfer.engine.text.detokenizer import IncrementalDetokenizer, StopStringChecker
from deepinfer.engine.text.tokenizer import (
    NoTokenizerError,
    Tokenizer,
    TokenizerLoadError,
    load_tokenizer,
    require_tokenizer,
)

SPECIAL_TOKENS = ["<s>", "</s>"]
WORDS = ("héllo wörld café naïve señor 中文 測試 日本語 🎉 🚀 👍🏽 ok def return import class "
         "print(x) for in range 1234 ä ö ü ß").split()
FAST = settings(max_examples=150, deadline=None, derandomize=True)


def corpus() -> list[str]:
    """~300 lines: stdlib source (ASCII code) plus generated lines full of multi-byte characters."""
    source = Path(json.__file__).read_text(encoding="utf-8").splitlines()[:150]
    rng = random.Random(0)
    generated = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12))) for _ in range(150)]
    return source + generated


@functools.cache
def backend() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


@functools.cache
def other_backend(kind: str) -> tokenizers.Tokenizer:
    """Tokenizers whose decoders depend on context: Metaspace strips the first token's leading space,
    WordPiece joins '##' pieces and cleans up spaces."""
    if kind == "metaspace":
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIAL_TOKENS, show_progress=False)
    else:
        tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[UNK]", "<s>"], show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def make_tokenizer() -> Tokenizer:
    return Tokenizer(backend(), eos_token_ids=[1], bos_token_id=0)


def stream(
    tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int], skip_special: bool = True
) -> list[str]:
    """Feed ids in chunks (sizes cycled); return every delta, the finish() result last."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special)
    deltas, i, step = [], 0, 0
    while i < len(ids):
        size = chunk_sizes[step % len(chunk_sizes)]
        deltas.append(detok.add(ids[i:i + size]))
        i, step = i + size, step + 1
    deltas.append(detok.finish())
    return deltas


def test_encode_decode_round_trip_with_multibyte_text() -> None:
    tokenizer = make_tokenizer()
    text = "naïve café 中文 測試 🎉👍🏽 def f(x): return x"
    ids = tokenizer.encode(text)
    assert all(0 <= t < tokenizer.vocab_size for t in ids)
    assert tokenizer.decode(ids) == text


def test_add_bos_prepends_once() -> None:
    tokenizer = Tokenizer(backend(), eos_token_ids=[1], bos_token_id=0, add_bos=True)
    assert tokenizer.encode("ok")[0] == 0 and tokenizer.encode("ok")[1] != 0
    assert tokenizer.encode("ok", add_special_tokens=False)[0] != 0
    assert tokenizer.encode("<s>ok")[:2] != [0, 0]


def test_emoji_split_across_tokens_is_held_back_until_complete() -> None:
    tokenizer = make_tokenizer()
    ids = tokenizer.encode("a🦀b")   # 🦀 is not in the corpus: split into byte tokens
    fragments = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in f for f in fragments), fragments   # the emoji really is split
    deltas = stream(tokenizer, ids, [1])
    assert "".join(deltas) == "a🦀b"
    assert all("\ufffd" not in d for d in deltas)


def test_dangling_partial_character_comes_out_on_finish() -> None:
    tokenizer = make_tokenizer()
    ids = tokenizer.encode("x🦀")
    partial = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:partial]) == tokenizer.decode(ids[:partial]).rstrip("\ufffd")
    assert detok.finish().endswith("\ufffd")


@FAST
@given(
    ids=st.lists(st.integers(0, 599), min_size=0, max_size=40),
    chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    skip_special=st.booleans(),
)
def test_incremental_equals_full_decode_for_random_ids(
    ids: list[int], chunk_sizes: list[int], skip_special: bool
) -> None:
    tokenizer = make_tokenizer()
    deltas = stream(tokenizer, ids, chunk_sizes, skip_special)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special)


@FAST
@given(
    kind=st.sampled_from(["metaspace", "wordpiece"]),
    ids=st.lists(st.integers(0, 499), max_size=30),
    chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_incremental_equals_full_decode_for_context_dependent_decoders(
    kind: str, ids: list[int], chunk_sizes: list[int]
) -> None:
    tokenizer = Tokenizer(other_backend(kind))
    assert "".join(stream(tokenizer, ids, chunk_sizes)) == tokenizer.decode(ids)


@FAST
@given(ids=st.lists(st.integers(2, 599), min_size=1, max_size=40))
def test_emitted_text_is_everything_but_trailing_partial_chars(ids: list[int]) -> None:
    # After each token the emitted text is exactly the decoded text minus trailing U+FFFD: nothing
    # final is held back, and nothing that may still change (an incomplete char) is emitted.
    tokenizer = make_tokenizer()
    detok = IncrementalDetokenizer(tokenizer)
    emitted = ""
    for n, token_id in enumerate(ids, start=1):
        emitted += detok.add([token_id])
        assert emitted == tokenizer.decode(ids[:n]).rstrip("\ufffd")


@FAST
@given(text=st.text(alphabet=st.sampled_from(list("ab é中🎉👍🏽\n")), max_size=30))
def test_incremental_equals_full_decode_for_encoded_text(text: str) -> None:
    tokenizer = make_tokenizer()
    ids = tokenizer.encode(text)
    assert "".join(stream(tokenizer, ids, [1])) == text


@FAST
@given(ids=st.lists(st.integers(2, 599), min_size=1, max_size=40), chunk=st.integers(1, 5))
def test_detokenizer_reading_its_owners_list_equals_one_fed_by_add(ids: list[int], chunk: int) -> None:
    # A request's detokenizer reads the request's own output list (the token history kept once):
    # the owner appends, then update(); the deltas are those of a detokenizer fed the same chunks.
    tokenizer = make_tokenizer()
    owned: list[int] = []
    reading = IncrementalDetokenizer(tokenizer, token_ids=owned)
    deltas = []
    for start in range(0, len(ids), chunk):
        owned.extend(ids[start:start + chunk])
        deltas.append(reading.update())
    deltas.append(reading.finish())
    assert deltas == stream(tokenizer, ids, [chunk]) and reading.token_ids == ids
    with pytest.raises(ValueError, match="owner's token list"):
        reading.add([5])


def test_detokenizer_rejects_add_after_finish() -> None:
    detok = IncrementalDetokenizer(make_tokenizer())
    detok.finish()
    with pytest.raises(ValueError, match="after finish"):
        detok.add([5])


def feed(checker: StopStringChecker, chunks: list[str]) -> tuple[list[str], str | None]:
    deltas = []
    for chunk in chunks:
        update = checker.add(chunk)
        deltas.append(update.delta)
        if update.stopped:
            return deltas, update.stop_str
    deltas.append(checker.finish())
    return deltas, None


def test_stop_string_spanning_deltas_is_cut_and_held_text_released_late() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.add("hello ST").delta == "hello "     # "ST" might start STOP: held
    update = checker.add("OP world")
    assert update.stopped and update.stop_str == "STOP" and update.delta == ""
    assert checker.text == "hello "


def test_held_text_is_released_when_it_stops_matching() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.add("a S").delta == "a "
    assert checker.add("T").delta == ""
    update = checker.add("ay")
    assert (update.delta, update.stopped) == ("STay", False)
    assert checker.add("S").delta == ""
    assert checker.finish() == "S"
    assert checker.text == "a STayS"


def test_include_stop_str_in_output_keeps_it() -> None:
    checker = StopStringChecker(["\n\n", "END"], include_stop_str_in_output=True)
    deltas, stop = feed(checker, ["one\n", "\ntwo END"])
    assert "".join(deltas) == "one\n\n" and stop == "\n\n"


def test_earliest_completed_stop_wins_then_longest() -> None:
    deltas, stop = feed(StopStringChecker(["abcd", "bc"]), ["xabcd"])
    assert ("".join(deltas), stop) == ("xa", "bc")
    deltas, stop = feed(StopStringChecker(["c", "abc"]), ["xabc"])
    assert ("".join(deltas), stop) == ("x", "abc")


def test_disallowed_stop_does_not_count_later() -> None:
    checker = StopStringChecker(["ab"])
    assert checker.add("xab", allow_stop=False).delta == "xab"
    assert checker.add("a", allow_stop=False).delta == ""
    update = checker.add("b")
    assert update.stopped and checker.text == "xab"


def test_bad_stop_strings_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"stop\[1\]='' must be a non-empty str"):
        StopStringChecker(["a", ""])
    checker = StopStringChecker(["a"])
    checker.add("xa")
    with pytest.raises(ValueError, match="after stop string 'a' matched"):
        checker.add("b")


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            key = (start + len(stop), -len(stop), start, stop)
            best = key if best is None or key < best else best
    if best is None:
        return text, None
    end, _, start, stop = best
    return text[:end if include else start], stop


@FAST
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_stop_result_is_independent_of_delta_split(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    checker = StopStringChecker(stops, include_stop_str_in_output=include)
    streamed = ""
    expected_text, expected_stop = reference_stop(text, stops, include)
    for chunk in chunks:
        update = checker.add(chunk)
        streamed += update.delta
        assert expected_text.startswith(streamed)   # never streams what is cut later
        if update.stopped:
            break
    else:
        streamed += checker.finish()
    assert (streamed, checker.stop_str) == (expected_text, expected_stop)


def write_model_dir(folder: Path, **configs: dict) -> Path:
    backend().save(str(folder / "tokenizer.json"))
    for name, data in configs.items():
        (folder / f"{name}.json").write_text(json.dumps(data))
    return folder


def test_load_tokenizer_reads_eos_bos_in_precedence_order(tmp_path: Path) -> None:
    write_model_dir(
        tmp_path,
        tokenizer_config={"eos_token": {"content": "</s>"}, "bos_token": "<s>", "add_bos_token": True},
        config={"eos_token_id": 5, "bos_token_id": 0},
        generation_config={"eos_token_id": [1, 7]},
    )
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer is not None
    assert tokenizer.eos_token_ids == (1, 7) and tokenizer.bos_token_id == 0 and tokenizer.add_bos
    (tmp_path / "generation_config.json").unlink()
    assert load_tokenizer(tmp_path).eos_token_ids == (5,)   # type: ignore[union-attr]
    (tmp_path / "config.json").unlink()
    loaded = load_tokenizer(tmp_path)
    assert loaded is not None and loaded.eos_token_ids == (1,) and loaded.bos_token_id == 0


def test_load_tokenizer_never_runs_model_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    write_model_dir(tmp_path, tokenizer_config={"auto_map": {"AutoTokenizer": ["tokenization_evil.Evil"]}})
    assert load_tokenizer(tmp_path) is not None
    assert not marker.exists()


def test_missing_tokenizer_json_gives_none_and_clear_text_prompt_error(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(NoTokenizerError, match="has no tokenizer.json: give the prompt as token ids"):
        require_tokenizer(None, tmp_path)
    tokenizer = make_tokenizer()
    assert require_tokenizer(tokenizer, tmp_path) is tokenizer


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ({"config": {"eos_token_id": 10_000}}, r"config.json: eos_token_id=10000 must be an int or list"),
        ({"generation_config": {"eos_token_id": [1, "x"]}}, r"generation_config.json: eos_token_id="),
        ({"tokenizer_config": {"eos_token": "<nope>"}}, r"eos_token='<nope>' is not a token"),
        ({"tokenizer_config": {"add_bos_token": "yes"}}, r"add_bos_token='yes' must be true or false"),
        ({"config": {"bos_token_id": [0, 1]}}, r"bos token must be a single id"),
        ({"tokenizer_config": {"eos_token": 5}}, r"tokenizer_config.json: eos_token=5 must be a token string"),
        ({"tokenizer_config": {"bos_token": {"special": True}}}, r"bos_token=\{'special': True\} needs a 'content'"),
    ],
)
def test_load_tokenizer_rejects_bad_configs(tmp_path: Path, configs: dict, message: str) -> None:
    write_model_dir(tmp_path, **configs)
    with pytest.raises(TokenizerLoadError, match=message):
        load_tokenizer(tmp_path)


def test_load_tokenizer_rejects_bad_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="is not a directory"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match=re.escape(str(tmp_path / "tokenizer.json")) + ": not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(TokenizerLoadError, match="tokenizer.json: cannot be loaded by the tokenizers library: "):
        load_tokenizer(tmp_path)
    write_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerLoadError, match="config.json: must hold a JSON object, got an array"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"])
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"eos_token_id": 1\xff}', r"not UTF-8 text \(invalid byte at offset 18\)"),
        (b'{"eos_token_id": 1,}', r"not valid JSON: Expecting property name enclosed in double quotes at line 1 "),
        (b"", r"not valid JSON: Expecting value at line 1 column 1"),
        (b'"text"', r"must hold a JSON object, got a string"),
        (b"[" * 100_000, r"not valid JSON: nested too deeply"),
    ],
)
def test_every_file_it_reads_is_named_with_its_fault(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    write_model_dir(tmp_path, tokenizer_config={}, generation_config={}, config={})
    (tmp_path / name).write_bytes(content)
    with pytest.raises(TokenizerLoadError, match=re.escape(str(tmp_path / name)) + ": " + message):
        load_tokenizer(tmp_path)


def test_a_folder_where_a_file_should_be(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(TokenizerLoadError, match=r"tokenizer.json: is not a regular file"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").rmdir()
    write_model_dir(tmp_path)
    (tmp_path / "generation_config.json").mkdir()
    with pytest.raises(TokenizerLoadError, match=r"generation_config.json: is not a regular file"):
        load_tokenizer(tmp_path)


def test_tokenizer_rejects_out_of_range_ids() -> None:
    with pytest.raises(TokenizerLoadError, match=r"eos_token_ids\[1\]=600 must be an int in \[0, 600\)"):
        Tokenizer(backend(), eos_token_ids=[1, 600])
    with pytest.raises(TokenizerLoadError, match=r"bos_token_id=-1 must be an int"):
        Tokenizer(backend(), bos_token_id=-1)
