"""`reference.sample_race` against a plain per-row sort, and its rules on small pinned rows."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.kernels import reference as ref


def race(logits, temperature, top_k, top_p, min_p, noise):
    """`reference.sample_race` with the host-side hint the sampler passes (`candidates`)."""
    return ref.sample_race(logits, temperature, top_k, top_p, min_p, noise, candidates(top_k, top_p, logits.shape[-1]))


def candidates(top_k, top_p, vocab: int) -> int:
    """0 when no row cuts by top-k or top-p, else the largest top_k (at most vocab)."""
    return min(int(top_k.max()), vocab) if bool(((top_k < vocab) | (top_p < 1)).any()) else 0


def kept_by_sorting(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[int]:
    """The kept token ids of one row, straight from the rules: rank, cut, accumulate in order."""
    ranked = sorted(range(len(probs)), key=lambda i: (-probs[i], i))[:top_k]
    total = sum(probs[i] for i in ranked)
    kept, before = [], 0.0
    for i in ranked:
        if top_p < 1 and before >= top_p * total:
            break
        kept.append(i)
        before += probs[i]
    return [i for i in kept if probs[i] >= min_p * max(probs)]


def race_by_sorting(logits, temperature, top_k, top_p, min_p, noise) -> list[int]:
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    scores = (probs / noise).tolist()
    tokens = []
    for row, row_probs in enumerate(probs.tolist()):
        kept = kept_by_sorting(row_probs, int(top_k[row]), float(top_p[row]), float(min_p[row]))
        tokens.append(max(kept, key=lambda i: (scores[row][i], -i)))
    return tokens


def random_rows(seed: int, settings: list[tuple[float, int, float, float]], vocab: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(settings), vocab, generator=gen) * 3
    logits[0, ::5] = -math.inf
    temperature, top_k, top_p, min_p = (torch.tensor(c) for c in zip(*settings))
    noise = torch.empty(len(settings), vocab).exponential_(generator=gen)
    return logits, temperature.float(), top_k, top_p.float(), min_p.float(), noise


MIXED = [(1.0, 500, 1.0, 0.0), (0.7, 1, 1.0, 0.0), (1.3, 50, 1.0, 0.0), (1.0, 500, 0.9, 0.0),
         (0.9, 500, 1e-4, 0.0), (1.0, 500, 1.0, 0.2), (0.8, 50, 0.8, 0.05), (1.1, 300, 0.95, 0.0)]


@pytest.mark.parametrize("seed", range(4))
def test_sample_race_matches_a_plain_sort(seed: int) -> None:
    args = random_rows(seed, MIXED, 500)
    assert race(*args).tolist() == race_by_sorting(*args)


@pytest.mark.parametrize("seed", range(4))
def test_sample_race_picks_from_the_kept_set_only(seed: int) -> None:
    # Noise p² makes each row's token its least likely kept token (of p > 0): the cut itself is checked.
    logits, temperature, top_k, top_p, min_p, _ = random_rows(seed, MIXED, 500)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    args = (logits, temperature, top_k, top_p, min_p, (probs * probs).clamp_min(1e-38))
    tokens = race(*args).tolist()
    for row, token in enumerate(tokens):
        kept = [i for i in kept_by_sorting(probs[row].tolist(), *MIXED[row][1:]) if probs[row, i] > 0]
        assert token == min(kept, key=lambda i: (probs[row, i].item(), -i))


def test_topk_fast_path_agrees_with_the_sort() -> None:
    # Every top_k <= 1024: one topk; a row without top_k but with top_p forces the sort for all.
    settings = [(1.0, 3, 1.0, 0.0), (1.0, 40, 0.5, 0.0), (0.5, 100, 0.9, 0.1), (2.0, 700, 0.3, 0.0)]
    logits, temperature, top_k, top_p, min_p, noise = random_rows(9, settings, 2000)
    logits = (logits * 2).round() / 2           # ties everywhere
    fast = race(logits, temperature, top_k, top_p, min_p, noise)
    extra = random_rows(10, [(1.0, 2000, 0.9, 0.0)], 2000)
    both = [torch.cat([a, b]) for a, b in zip((logits, temperature, top_k, top_p, min_p, noise), extra)]
    assert torch.equal(race(*both)[:4], fast)


def test_ties_at_the_top_k_place_keep_the_lowest_ids() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    noise = torch.tensor([[1.0, 9.0, 5.0, 1.0, 1.0]])      # token 3 would win were it kept
    one = torch.ones(1)
    assert race(logits, one, torch.tensor([2]), one, 0 * one, noise).tolist() == [2]
    assert race(logits, one, torch.tensor([3]), one, 0 * one, noise).tolist() == [3]


@pytest.mark.parametrize(("top_p", "kept"), [(0.01, 1), (0.5, 1), (0.7, 2), (0.85, 3), (1.0, 4)])
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p: float, kept: int) -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    noise = torch.tensor([[1.0, 0.1, 0.01, 0.001]])         # each later token beats the earlier ones
    one = torch.ones(1)
    token = race(logits, one, torch.tensor([4]), torch.tensor([top_p]), 0 * one, noise)
    assert token.tolist() == [kept - 1]


def test_num_candidates_outside_the_vocabulary_is_refused() -> None:
    logits, temperature, top_k, top_p, min_p, noise = random_rows(1, MIXED[:2], 100)
    with pytest.raises(ValueError, match="num_candidates=101"):
        ref.sample_race(logits, temperature, top_k, top_p, min_p, noise, 101)


def test_min_p_and_a_single_finite_logit() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05], [1.0, 1.0, 1.0, 1.0]]).log()
    logits[1, [0, 1, 3]] = -math.inf
    noise = torch.tensor([[1.0, 0.1, 0.01, 0.001]] * 2)
    args = (torch.ones(2), torch.tensor([4, 4]), torch.ones(2), torch.tensor([0.5, 0.5]), noise)
    assert race(logits, *args).tolist() == [1, 2]     # 0.15 < 0.5 * 0.5 is dropped
