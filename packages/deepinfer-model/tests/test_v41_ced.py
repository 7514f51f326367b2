"""CED / YOCO prefill truncation (docs/design.md §8): compact = mask, off = the full model, constraints."""

from __future__ import annotations

import pytest
import torch
from v41_helpers import run_chunks, tiny_model

from deepinfer.model import ConfigError, ForwardBatch, ModelCache
from deepinfer.model.ced import first_consumer_layer

TOKENS = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(9)).tolist()


def _prefill_then_decode(model, mode: str, keep: int, seqs: list[list[int]], decode_steps: int = 4):
    """Prefill each prompt in one step (truncated as `mode`), then greedy-decode `decode_steps` tokens:
    (last-row prefill logits, decode logits, generated tokens)."""
    model.set_prefill_truncation(mode, keep)
    spec = model.cache_spec(8, 2)
    cache = ModelCache.allocate(spec, 1 + 6 * len(seqs), len(seqs) + 1)
    tables = [list(range(1 + 6 * i, 7 + 6 * i)) for i in range(len(seqs))]
    slots = list(range(1, len(seqs) + 1))
    with torch.no_grad():
        first = model(ForwardBatch.build(seqs, [0] * len(seqs), tables, slots), cache)
        tokens = [[int(t)] for t in first.argmax(-1)]
        outs = []
        for _ in range(decode_steps):
            pos = [len(s) + len(t) - 1 for s, t in zip(seqs, tokens)]
            logits = model(ForwardBatch.build([[t[-1]] for t in tokens], pos, tables, slots), cache)
            outs.append(logits)
            for t, row in zip(tokens, logits):
                t.append(int(row.argmax()))
    model.set_prefill_truncation("off")
    return first, torch.stack(outs) if outs else None, tokens


def test_compact_equals_mask_and_keeps_decoding_equal() -> None:
    model = tiny_model(seed=2)
    seqs = [TOKENS, TOKENS[5:26]]
    compact = _prefill_then_decode(model, "compact", 6, seqs)
    mask = _prefill_then_decode(model, "mask", 6, seqs)
    torch.testing.assert_close(compact[0], mask[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(compact[1], mask[1], atol=1e-5, rtol=0)
    assert compact[2] == mask[2]
    off = _prefill_then_decode(model, "off", 6, seqs)
    assert (off[0] - compact[0]).abs().max() > 1e-4          # truncation is an approximation …


def test_truncation_is_exact_when_the_prompt_fits_the_tail() -> None:
    model = tiny_model(seed=2)
    full = run_chunks(model, [TOKENS], [[30]])[0][-1]
    for mode in ("compact", "mask"):
        got = _prefill_then_decode(model, mode, 30, [TOKENS], decode_steps=0)[0][0]
        torch.testing.assert_close(got, full, atol=1e-5, rtol=0)     # … that changes nothing for short prompts
    assert first_consumer_layer(model.cfg) == 8


def test_prompt_logprobs_are_refused_under_truncation() -> None:
    model = tiny_model(seed=2)
    model.set_prefill_truncation("compact", 6)
    cache = ModelCache.allocate(model.cache_spec(8, 2), 8, 2)
    with pytest.raises(ValueError, match="prompt logprobs"):
        model(ForwardBatch.build([TOKENS], [0], [list(range(1, 7))], [1], logits="all"), cache)


@pytest.mark.parametrize(
    ("overrides", "mode", "keep", "message"),
    [
        ({}, "sideways", 140, "mode='sideways'"),
        ({}, "compact", 0, "keep_tokens=0"),
        ({"engram_layer_ids": [1, 9], "engram_num_embeddings": [240, 306]}, "compact", 140, r"Engram layer\(s\) \[9\]"),
        ({"dspark_target_layer_ids": [6, 9]}, "mask", 140, "both sides"),
    ],
)
def test_constraints_are_checked_at_start(overrides, mode, keep, message) -> None:
    model = tiny_model(seed=0, **overrides)
    with pytest.raises(ConfigError, match=message):
        model.set_prefill_truncation(mode, keep)
