"""Penalties, logit_bias, allowed_token_ids and bad_words on small logits, against a pure-Python
reference of vLLM's formulas; the device path makes no host read (the CPU sync-guard emulation)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.device.sync_guard import forbid_cuda_sync
from deepinfer.engine.sampling.logit_controls import (
    HISTORY_WINDOW,
    TokenHistory,
    apply_logit_controls,
    build_logit_controls,
    record_tokens,
)
from deepinfer.engine.sampling.sampler import Sampler
from deepinfer.engine.sampling.sampling_batch import build_sampling_batch

VOCAB = 12
CPU = torch.device("cpu")


def reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int],
              bad_words: tuple[tuple[int, ...], ...]) -> list[float]:
    """vLLM's order and formulas, one row, in plain Python."""
    out = list(logits)
    if params.allowed_token_ids is not None:
        out = [v if t in params.allowed_token_ids else -math.inf for t, v in enumerate(out)]
    for word in bad_words:
        prefix = list(word[:-1])
        if not prefix or output[len(output) - len(prefix):] == prefix and len(output) >= len(prefix):
            out[word[-1]] = -math.inf
    for token_id, bias in params.logit_bias or ():
        out[token_id] += bias
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        count = output.count(t)
        out[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


ROWS = (
    # (params, prompt, outputs so far, bad words as token ids)
    (SamplingParams(presence_penalty=1.5, frequency_penalty=0.5), [1, 2], [3, 3, 4, 3], ()),
    (SamplingParams(repetition_penalty=1.7), [0, 5, 5], [6, 7], ()),
    (SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.0, presence_penalty=-0.5), [8], [8, 9, 9], ()),
    (SamplingParams(logit_bias={2: 5.0, 11: -100.0, 4: 0.25}), [1], [2], ()),
    (SamplingParams(allowed_token_ids=[1, 4, 7, 300]), [0], [], ()),            # 300 >= VOCAB: skipped
    (SamplingParams(), [0], [5, 6], ((10,), (6, 1), (4, 6, 2), (5, 6, 3))),  # (4, 6, 2) does not match
    (SamplingParams(presence_penalty=0.3), [0], [9, 5, 6], ((5, 6, 2), (9, 5, 6, 11), (6, 3))),
    (SamplingParams(), [3], [], ()),                                            # untouched
)


def make_rows(history: TokenHistory):
    slots = []
    for params, prompt, output, words in ROWS:
        needs = params.uses_penalties or any(len(w) > 1 for w in words)
        slots.append(history.acquire(prompt, output) if needs else None)
    return [r[0] for r in ROWS], slots, [r[3] for r in ROWS]


def test_controls_match_the_reference_formulas_and_record_the_sampled_tokens() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROWS), VOCAB, generator=generator) * 3
    history = TokenHistory(VOCAB, CPU)
    params, slots, words = make_rows(history)
    with forbid_cuda_sync(CPU):
        controls = build_logit_controls(params, slots, words, history, VOCAB, CPU)
        got = apply_logit_controls(logits, controls)
    for row, (p, prompt, output, bad) in enumerate(ROWS):
        want = reference(logits[row].tolist(), p, prompt, output, bad)
        assert got[row].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6), f"row {row}"
    assert got[7].tolist() == logits[7].tolist()
    assert [t for t in range(VOCAB) if got[5, t] == -math.inf] == [1, 3, 10]
    assert [t for t in range(VOCAB) if got[6, t] == -math.inf] == [2, 3, 11]
    # the sampled tokens go into the tracked rows' history on the device
    sampled = torch.tensor([3, 7, 9, 0, 1, 2, 3, 4])
    with forbid_cuda_sync(CPU):
        record_tokens(controls, sampled)
    for row, slot in enumerate(slots):
        if slot is None:
            continue
        output = ROWS[row][2] + [int(sampled[row])]
        assert history.counts[slot].tolist() == [output.count(t) for t in range(VOCAB)]
        tail = output[-HISTORY_WINDOW:]
        assert history.recent[slot].tolist() == [-1] * (HISTORY_WINDOW - len(tail)) + tail
    assert controls.history_rows.tolist() == [0, 1, 2, 5, 6]


def test_a_history_row_is_rebuilt_and_reused() -> None:
    history = TokenHistory(VOCAB, CPU)
    rows = [history.acquire([1], [2, 2]) for _ in range(9)]        # grows past its first 8 rows
    assert sorted(rows) == list(range(9)) and history.num_used == 9
    history.reset(rows[3], [4], [5])
    assert history.counts[rows[3]].tolist() == [1 if t == 5 else 0 for t in range(VOCAB)]
    assert history.prompt_mask[rows[3]].tolist() == [t == 4 for t in range(VOCAB)]
    assert history.counts[rows[8]].tolist()[2] == 2
    history.release(rows[3])
    with pytest.raises(ValueError, match="not a used TokenHistory row"):
        history.release(rows[3])
    assert history.acquire([], []) == rows[3] and history.counts[rows[3]].sum() == 0


def test_the_sampler_never_samples_what_the_controls_forbid() -> None:
    rng = random.Random(1)
    sampler = Sampler(seed=3)
    history = TokenHistory(VOCAB, CPU)
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[2, 5, 9]),
              SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
              SamplingParams(temperature=2.0, logit_bias={t: -100.0 for t in range(6)}),
              SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)]
    slots = [None, None, None, history.acquire([0], [])]
    for _ in range(30):
        logits = torch.tensor([[rng.gauss(0, 1) for _ in range(VOCAB)] for _ in params])
        before = history.counts[slots[3]].clone()
        with forbid_cuda_sync(CPU):
            controls = build_logit_controls(params, slots, [()] * len(params), history, VOCAB, CPU)
            batch = build_sampling_batch(params, rngs=[None] * len(params), num_output_tokens=[0] * len(params),
                                         eos_token_ids=(), vocab_size=VOCAB, controls=controls)
            out = sampler(logits, batch)
        tokens = out.token_ids.tolist()
        assert tokens[0] in (2, 5, 9) and tokens[1] == 7 and tokens[2] >= 6
        penalised = logits[3] - 2.0 * before - 2.0 * (before > 0)
        assert tokens[3] == int(penalised.argmax())
        # logprobs stay those of the raw logits
        assert out.logprobs.tolist() == pytest.approx(
            [float(torch.log_softmax(logits[r], -1)[t]) for r, t in enumerate(tokens)], abs=1e-6)
    assert history.counts[slots[3]].sum() == 30


def test_no_controls_means_no_extra_work() -> None:
    assert build_logit_controls([SamplingParams()] * 3, [None] * 3, [()] * 3, None, VOCAB, CPU) is None


@pytest.mark.parametrize(("field", "value", "message"), [
    ("n", 0, "n=0 must be >= 1 and <= 128"),
    ("n", 129, "n=129 must be"),
    ("presence_penalty", 2.5, r"presence_penalty=2.5 must be in \[-2, 2\]"),
    ("frequency_penalty", -2.1, r"frequency_penalty=-2.1 must be in \[-2, 2\]"),
    ("frequency_penalty", float("nan"), "frequency_penalty=nan must be finite"),
    ("repetition_penalty", 0.0, r"repetition_penalty=0.0 must be in \(0, 2\]"),
    ("repetition_penalty", 2.01, r"repetition_penalty=2.01 must be in \(0, 2\]"),
    ("logit_bias", {5: 100.5}, r"logit_bias\[5\]=100.5 must be in \[-100, 100\]"),
    ("logit_bias", {-1: 1.0}, "logit_bias key=-1 must be an int >= 0"),
    ("logit_bias", {i: 1.0 for i in range(1025)}, "logit_bias has 1025 entries: at most 1024"),
    ("logit_bias", [(1, 1.0), (1, 2.0)], "logit_bias holds token id 1 twice"),
    ("logit_bias", 5, "logit_bias=5 must be a mapping"),
    ("allowed_token_ids", [], "allowed_token_ids=.. must be None or a non-empty sequence"),
    ("allowed_token_ids", [1, True], r"allowed_token_ids\[1\]=True must be an int"),
    ("bad_words", "word", "bad_words='word' must be a sequence of str"),
    ("bad_words", ["ok", " "], r"bad_words\[1\]=' ' must be a non-empty str"),
    ("bad_words", ["w"] * 129, "bad_words has 129 words: at most 128"),
    ("prompt_logprobs", 21, r"prompt_logprobs=21 must be None or in \[0, 20\]"),
    ("skip_special_tokens", 0, "skip_special_tokens=0 must be a bool"),
])
def test_new_sampling_fields_are_checked_by_name(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_new_sampling_fields_are_normalised() -> None:
    params = SamplingParams(logit_bias={9: 1, 2: -3.5}, allowed_token_ids=[7, 3, 7], bad_words=["a b"], n=2)
    assert params.logit_bias == ((2, -3.5), (9, 1.0)) and params.allowed_token_ids == (3, 7)
    assert params.bad_words == ("a b",) and params.n == 2
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams().uses_penalties and SamplingParams(repetition_penalty=1.1).uses_penalties
