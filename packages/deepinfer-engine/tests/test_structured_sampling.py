"""Token bitmasks: unpack / apply (reference vs xgrammar's CPU kernel), filling from grammar states,
the sampler's masked sampling, and the sampling stage applying a grammar row's mask."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xgrammar

from deepinfer.engine import SamplingParams
from deepinfer.engine.sampling.grammar_backend import GrammarState
from deepinfer.engine.sampling.sampler import Sampler
from deepinfer.engine.sampling.sampling_batch import InvalidSamplingBatch, RequestRng, build_sampling_batch
from deepinfer.engine.sampling.sampling_stage import RowParams, SamplingStage, StepRows
from deepinfer.engine.sampling.token_bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask,
    fill_token_bitmask,
    unpack_token_bitmask,
)

VOCAB = ["<eos>", "y", "e", "s", "n", "o", "ye", "yes", "x", "z"]   # token id = index; 0 = EOS
PADDED_VOCAB = 70                                                      # model vocab: ids 10..69 unused


def _random_bitmask(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    width = (vocab_size + 31) // 32
    return torch.randint(-(2**31), 2**31, (num_rows, width), generator=gen, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("vocab_size", [1, 32, 77, 1000])
def test_unpack_reads_bit_t_mod_32_of_word_t_div_32(vocab_size: int) -> None:
    bitmask = _random_bitmask(3, vocab_size, seed=vocab_size)
    expect = [[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab_size)] for r in range(3)]
    assert unpack_token_bitmask(bitmask, vocab_size).tolist() == expect


@pytest.mark.parametrize("vocab_size", [77, 129_280])
def test_reference_apply_matches_xgrammar_cpu_kernel_and_leaves_other_rows(vocab_size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, vocab_size, generator=gen)
    rows = torch.tensor([4, 0, 3])
    bitmask = _random_bitmask(3, vocab_size, seed=2)
    before = logits.clone()
    out = apply_token_bitmask(logits, bitmask, rows)
    twin = logits.clone()
    full = allocate_token_bitmask(6, vocab_size)
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(twin, full, vocab_size=vocab_size, indices=rows.tolist())
    assert torch.equal(out, twin) and torch.equal(logits, before)            # out of place
    assert torch.equal(out[[1, 2, 5]], logits[[1, 2, 5]])
    assert apply_token_bitmask(logits, bitmask[:0], rows[:0]) is logits
    every_row = logits.clone()                                # rows=None: mask row i is logits row i
    xgrammar.apply_token_bitmask_inplace(every_row, full, vocab_size=vocab_size)
    assert torch.equal(apply_token_bitmask(logits, full, None), every_row) and torch.equal(logits, before)


@pytest.fixture(scope="module")
def compiler() -> xgrammar.GrammarCompiler:
    info = xgrammar.TokenizerInfo(VOCAB, xgrammar.VocabType.RAW, vocab_size=PADDED_VOCAB, stop_token_ids=[0])
    return xgrammar.GrammarCompiler(info, max_threads=1)


def _state(compiler: xgrammar.GrammarCompiler, ebnf: str) -> GrammarState:
    return GrammarState(xgrammar.GrammarMatcher(compiler.compile_grammar(ebnf)))


def _allowed(bitmask: torch.Tensor, position: int) -> list[int]:
    return unpack_token_bitmask(bitmask, PADDED_VOCAB)[position].nonzero().flatten().tolist()


class _ClosedState(GrammarState):
    """A state whose grammar allows nothing (e.g. a vocabulary that cannot spell what must follow)."""

    def __init__(self) -> None:
        super().__init__(matcher=None)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, *, expected_num_tokens: int) -> None:
        bitmask[row] = 0


def test_fill_masks_constrained_rows_and_detects_dead_ends(compiler) -> None:
    yes_or_no = _state(compiler, 'root ::= "yes" | "no"')
    done = _state(compiler, 'root ::= "yes"')
    assert done.accept_tokens([7]) == 1                       # "yes": only EOS may follow
    step = fill_token_bitmask([None, yes_or_no, done, _ClosedState(), None], [3, 0, 1, 0, 0],
                              [(), (), (0,), (), ()], PADDED_VOCAB)
    assert step is not None and step.rows == (1, 2, 3) and step.bitmask.shape == (3, 3)
    assert _allowed(step.bitmask, 0) == [1, 4, 6, 7]           # y, n, ye, yes
    assert step.dead_rows == (2, 3)                            # EOS banned by min_tokens; nothing allowed
    assert "only allows EOS / stop tokens, which min_tokens still bans" in step.dead_reasons[0]
    assert step.dead_reasons[1] == "grammar dead end after 0 output tokens: no token is allowed"
    assert _allowed(step.bitmask, 1) == _allowed(step.bitmask, 2) == list(range(PADDED_VOCAB))   # left open
    assert fill_token_bitmask([None, None], [0, 0], [(), ()], PADDED_VOCAB) is None


def test_sampler_takes_only_allowed_tokens_and_reports_raw_logprobs(compiler) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, PADDED_VOCAB, generator=gen)
    logits[:, 8] = 50.0                                        # "x" would win everywhere unmasked
    bitmask = allocate_token_bitmask(2, PADDED_VOCAB)
    states = [_state(compiler, 'root ::= "yes" | "no"'), _state(compiler, 'root ::= "ye" "s"')]
    for position, state in enumerate(states):
        state.fill_bitmask(bitmask, position, expected_num_tokens=0)
    params = [SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=3)]
    batch = build_sampling_batch(params, rngs=[RequestRng.for_params(p) for p in params], num_output_tokens=[0] * 3,
                                 eos_token_ids=[0], vocab_size=PADDED_VOCAB, token_bitmask=bitmask,
                                 bitmask_rows=[0, 2])
    for _ in range(20):                                        # row 2 samples; always an allowed token
        out = Sampler(seed=0)(logits, batch)
        assert out.token_ids[1].item() == 8                     # unconstrained row unaffected
        assert out.token_ids[2].item() in (1, 2, 6, 7)          # y, e, ye, yes
    allowed = [1, 4, 6, 7]
    assert out.token_ids[0].item() == allowed[int(logits[0, allowed].argmax())]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None])[:, 0])


def test_sampling_batch_checks_bitmask_fields() -> None:
    params = [SamplingParams(temperature=0)]
    common = {"rngs": [None], "num_output_tokens": [0], "eos_token_ids": [0], "vocab_size": PADDED_VOCAB}
    with pytest.raises(InvalidSamplingBatch, match=r"token_bitmask must be int32 \[1, 3\]"):
        build_sampling_batch(params, **common, token_bitmask=torch.zeros(1, 2, dtype=torch.int32), bitmask_rows=[0])
    with pytest.raises(InvalidSamplingBatch, match=r"token_bitmask must be int32"):
        build_sampling_batch(params, **common, token_bitmask=torch.zeros(1, 3), bitmask_rows=[0])
    every_row = build_sampling_batch(params * 2, **{**common, "rngs": [None] * 2, "num_output_tokens": [0, 0]},
                                     token_bitmask=allocate_token_bitmask(2, PADDED_VOCAB), bitmask_rows=[0, 1])
    assert every_row.bitmask_rows is None and every_row.token_bitmask is not None
    with pytest.raises(InvalidSamplingBatch, match=r"bitmask_rows must be None without a token_bitmask"):
        dataclasses.replace(every_row, token_bitmask=None, bitmask_rows=torch.tensor([0]))


def test_sampling_stage_masks_grammar_rows_only(compiler) -> None:
    logits = torch.zeros(2, PADDED_VOCAB)
    logits[:, 8] = 1.0
    stage = SamplingStage(Sampler(seed=0), eos_token_ids=[0], vocab_size=PADDED_VOCAB)
    plain = SamplingParams(temperature=0)
    state = _state(compiler, 'root ::= "no"')
    rows = StepRows.from_rows([RowParams(plain, None, 0), RowParams(plain, None, 0, grammar=state)])
    sampled = stage.collect(stage.launch(("free", "json"), logits, rows, guarded=True))
    assert [(t.seq_id, t.token_id, t.error) for t in sampled.tokens()] == [("free", 8, None), ("json", 4, None)]
