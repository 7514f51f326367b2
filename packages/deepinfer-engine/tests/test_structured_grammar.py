"""Grammar back end (xgrammar), GrammarState (accept / rollback / stale check) and the compile pool."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from deepinfer.engine import StructuredOutput, StructuredOutputUnavailable
from deepinfer.engine.sampling.grammar_backend import (
    GrammarCompileError,
    GrammarState,
    StaleGrammarError,
    XGrammarBackend,
    choice_ebnf,
)
from deepinfer.engine.sampling.grammar_compiler import GrammarCompilePool
from deepinfer.engine.sampling.token_bitmask import allocate_token_bitmask, unpack_token_bitmask
from deepinfer.engine.text.tokenizer import Tokenizer

EOS = 0
PADDING = 7        # model vocabulary = tokenizer vocabulary + PADDING unused ids
CHOICES = ("yes", 'say "no"', "back\\slash", "été", "😀 ok")


def _byte_level_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(['{"ok": true, "color": "red"} 123-ab yes no maybe'] * 4, trainer)
    return Tokenizer(backend, eos_token_ids=(EOS,))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return _byte_level_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, tokenizer.vocab_size + PADDING, (EOS,))


def _accepts(backend: XGrammarBackend, tokenizer: Tokenizer, spec: StructuredOutput, text: str) -> bool:
    """Whether `text` then EOS is a complete output under `spec`."""
    state = backend.new_state(backend.compile(spec))
    ids = tokenizer.encode(text, add_special_tokens=False) + [EOS]
    return state.accept_tokens(ids) == len(ids) and state.is_terminated


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
          "required": ["ok", "color"]}


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (StructuredOutput(json=SCHEMA), ['{"ok": true, "color": "red"}'],
         ['{"ok":true,"color":"red"}', '{"ok": true}', '{"ok": 1, "color": "red"}', '{"ok": true, "color": "x"}']),
        (StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"), ["123-ab", "907-zz"], ["12-ab", "123-abc", "123ab"]),
        (StructuredOutput(grammar='root ::= "(" [a-c]+ ")"'), ["(a)", "(abcab)"], ["()", "(d)", "(a"]),
        (StructuredOutput(choice=CHOICES), list(CHOICES), ["ye", "yes!", 'say "no', "été "]),
    ],
)
def test_each_kind_accepts_exactly_its_language(backend, tokenizer, spec, good, bad) -> None:
    for text in good:
        assert _accepts(backend, tokenizer, spec, text), text
    for text in bad:
        assert not _accepts(backend, tokenizer, spec, text), text


def test_choice_grammar_escapes_quotes_backslashes_and_non_ascii() -> None:
    assert choice_ebnf(['a"b', "c\\d", "é", "😀", "x\ny"]) == (
        'root ::= "a\\"b" | "c\\\\d" | "\\u00e9" | "\\U0001f600" | "x\\u000ay"')


def test_mask_never_allows_padding_ids_and_allows_eos_only_when_complete(backend, tokenizer) -> None:
    vocab_size = tokenizer.vocab_size + PADDING
    state = backend.new_state(backend.compile(StructuredOutput(choice=["yes"])))
    bitmask = allocate_token_bitmask(1, vocab_size)
    state.fill_bitmask(bitmask, 0, expected_num_tokens=0)
    allowed = unpack_token_bitmask(bitmask, vocab_size)[0]
    assert not allowed[tokenizer.vocab_size:].any() and not allowed[EOS]
    assert state.accept_tokens(tokenizer.encode("yes", add_special_tokens=False)) > 0
    state.fill_bitmask(bitmask, 0, expected_num_tokens=state.num_accepted)
    assert unpack_token_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist() == [EOS]


def test_accept_stops_at_the_first_rejected_token_and_rollback_restores_the_mask(backend, tokenizer) -> None:
    vocab_size = tokenizer.vocab_size + PADDING
    state = backend.new_state(backend.compile(StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}")))
    digit, letter = tokenizer.token_to_id("1"), tokenizer.token_to_id("a")
    masks = allocate_token_bitmask(3, vocab_size)
    state.fill_bitmask(masks, 0, expected_num_tokens=0)
    assert state.accept_tokens([digit, digit]) == 2
    assert state.accept_tokens([digit, letter, digit]) == 1 and state.num_accepted == 3   # "1" ok, "a" not
    state.fill_bitmask(masks, 1, expected_num_tokens=3)   # after three digits only "-" may follow
    state.rollback(3)                                     # e.g. drafts a verify step rejected
    state.fill_bitmask(masks, 2, expected_num_tokens=0)
    assert torch.equal(masks[2], masks[0]) and not torch.equal(masks[1], masks[0])
    assert not unpack_token_bitmask(masks[1:2], vocab_size)[0, digit]
    with pytest.raises(ValueError, match=r"num_tokens=1 must be in \[0, num_accepted=0\]"):
        state.rollback(1)


def test_a_mask_from_a_stale_state_is_refused(backend, tokenizer) -> None:
    state = backend.new_state(backend.compile(StructuredOutput(regex="[0-9]+")))
    with pytest.raises(StaleGrammarError, match=r"consumed 0 tokens but the request has 1"):
        state.fill_bitmask(allocate_token_bitmask(1, tokenizer.vocab_size), 0, expected_num_tokens=1)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(json={"type": "foo"}), r'^invalid structured.json: Unsupported type "foo"$'),
        (StructuredOutput(json={"type": "string", "minLength": 5, "maxLength": 2}), r"^invalid structured.json: "),
        (StructuredOutput(regex="([a-"), r"^invalid structured.regex: Regex parsing error at position \d+"),
        (StructuredOutput(grammar="root ::= foo"), r'^invalid structured.grammar: .*Rule "foo" is not defined$'),
    ],
)
def test_compile_errors_name_the_field_and_drop_xgrammar_source_locations(backend, spec, message) -> None:
    with pytest.raises(GrammarCompileError, match=message) as info:
        backend.compile(spec)
    assert ".cc:" not in str(info.value)


def test_backend_needs_xgrammar_and_an_eos(monkeypatch, tokenizer) -> None:
    with pytest.raises(StructuredOutputUnavailable, match="needs an EOS token id"):
        XGrammarBackend(tokenizer, tokenizer.vocab_size, ())
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(StructuredOutputUnavailable, match=r"needs the xgrammar package \(a dependency of "
                                                              r"deepinfer-engine, missing from this environment\)"):
        XGrammarBackend(tokenizer, tokenizer.vocab_size, (EOS,))


class _GatedBackend:
    """Returns ("compiled", key) after the gate of that key (if any) opens; regex "bad" fails."""

    def __init__(self) -> None:
        self.gates: dict[tuple[str, str], threading.Event] = {}
        self.compiled: list[tuple[str, str]] = []

    def compile(self, spec: StructuredOutput) -> object:
        gate = self.gates.get(spec.key)
        if gate is not None:
            assert gate.wait(30)
        self.compiled.append(spec.key)
        if spec.regex == "bad":
            raise GrammarCompileError("invalid structured.regex: bad")
        if spec.regex == "boom":
            raise KeyError("boom")
        return ("compiled", spec.key)

    def new_state(self, compiled: object) -> GrammarState:
        raise AssertionError("not used by the pool")


def _drain(pool: GrammarCompilePool, count: int) -> list:
    done = []
    while len(done) < count:
        assert pool.wait(30)
        done += pool.pop_completed()
    return done


def test_pool_compiles_each_key_once_and_answers_every_request() -> None:
    backend = _GatedBackend()
    pool = GrammarCompilePool(backend, max_workers=2)
    slow, fast = StructuredOutput(regex="slow"), StructuredOutput(regex="fast")
    backend.gates[slow.key] = threading.Event()
    pool.submit("r1", slow)
    pool.submit("r2", fast)
    pool.submit("r3", slow)                                # joins the running compile of r1's key
    assert [d.request_id for d in _drain(pool, 1)] == ["r2"]           # slow one does not hold r2 back
    assert pool.pop_completed() == [] and not pool.wait(0.01)
    backend.gates[slow.key].set()
    done = _drain(pool, 2)
    assert sorted(d.request_id for d in done) == ["r1", "r3"]
    assert all(d.compiled == ("compiled", slow.key) and d.error is None for d in done)
    pool.submit("r4", fast)                                # cached: answered at once, no compile
    assert [(d.request_id, d.compiled) for d in pool.pop_completed()] == [("r4", ("compiled", fast.key))]
    assert backend.compiled.count(slow.key) == 1 and backend.compiled.count(fast.key) == 1
    assert (pool.num_compiles, pool.num_cache_hits, pool.num_cached) == (2, 2, 2)
    pool.shutdown()


def test_pool_reports_and_caches_failures() -> None:
    backend = _GatedBackend()
    pool = GrammarCompilePool(backend, max_workers=1)
    pool.submit("a", StructuredOutput(regex="bad"))
    pool.submit("b", StructuredOutput(regex="boom"))
    done = {d.request_id: d for d in _drain(pool, 2)}
    assert done["a"].compiled is None and done["a"].error == "invalid structured.regex: bad"
    assert done["b"].error == "KeyError: 'boom'"
    pool.submit("c", StructuredOutput(regex="bad"))
    assert [d.error for d in pool.pop_completed()] == ["invalid structured.regex: bad"]
    assert backend.compiled.count(("regex", "bad")) == 1
    pool.shutdown()


def test_pool_drops_least_recently_used_finished_compiles() -> None:
    backend = _GatedBackend()
    pool = GrammarCompilePool(backend, max_workers=1, max_cached=2)
    for i, name in enumerate(["a", "b", "a", "c"]):       # "a" used again, so "b" is the oldest
        pool.submit(str(i), StructuredOutput(regex=name))
        _drain(pool, 1)
    assert pool.num_cached == 2
    pool.submit("4", StructuredOutput(regex="b"))         # dropped: compiled again, then "a" is dropped
    pool.submit("5", StructuredOutput(regex="c"))         # still cached
    _drain(pool, 2)
    assert [key[1] for key in backend.compiled] == ["a", "b", "c", "b"]
    assert (pool.num_compiles, pool.num_cache_hits, pool.num_cached) == (4, 2, 2)
    with pytest.raises(ValueError, match="max_workers=0 must be >= 1"):
        GrammarCompilePool(backend, max_workers=0)
    with pytest.raises(ValueError, match="max_cached=0 must be >= 1"):
        GrammarCompilePool(backend, max_cached=0)
    pool.shutdown()
