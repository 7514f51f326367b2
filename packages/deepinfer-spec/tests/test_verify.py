import torch

from deepinfer.spec import DraftSampler, VerifyInput, greedy_verify, verify

VOCAB = 6
# Chi-square critical value, 5 degrees of freedom, significance 0.001.
CHI2_5DF_0001 = 20.515


def _one_hot_logits(ids: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    logits = torch.full((len(ids), len(ids[0]), vocab), -3.0)
    for i, row in enumerate(ids):
        for j, t in enumerate(row):
            logits[i, j, t] = 5.0
    return logits


def test_greedy_accepts_the_matching_prefix_and_emits_the_target_token() -> None:
    target = _one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0]])
    drafts = torch.tensor([[1, 2, 0], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    out = greedy_verify(target, drafts, torch.tensor([3, 3, 1, 3]))
    assert out.num_accepted.tolist() == [2, 3, 1, 0]
    assert out.output_ids.tolist() == [[1, 2, 3, -1], [1, 2, 3, 4], [1, 2, -1, -1], [5, -1, -1, -1]]
    assert out.num_output.tolist() == [3, 4, 2, 1]
    expected = torch.log_softmax(target, dim=-1)
    assert torch.allclose(out.logprobs[1], expected[1, torch.arange(4), torch.tensor([1, 2, 3, 4])])
    assert out.logprobs[0, 3] == 0 and out.logprobs[3, 1:].abs().sum() == 0


def test_greedy_rows_in_a_sampled_batch_stay_exact() -> None:
    target = _one_hot_logits([[1, 2, 3], [1, 2, 3]])
    drafts = torch.tensor([[1, 4], [1, 4]])
    q = torch.full((2, 2, VOCAB), 1.0 / VOCAB)
    inp = VerifyInput(target, drafts, torch.tensor([2, 2]), torch.tensor([0.0, 0.0]), q, torch.tensor([1, 2]),
                      torch.tensor([0, 0]))
    out = verify(inp)
    assert out.output_ids.tolist() == [[1, 2, -1], [1, 2, -1]]


def _sampled_case(num_rows: int, seed_offset: int = 0):
    gen = torch.Generator().manual_seed(7)
    target_row = torch.randn(3, VOCAB, generator=gen) * 1.5              # p for positions 0, 1, 2
    draft_row = torch.randn(2, VOCAB, generator=gen) * 1.5               # q for drafts 0, 1
    seeds = torch.arange(num_rows, dtype=torch.int64) + seed_offset
    positions = torch.zeros(num_rows, dtype=torch.int64)
    temperature = torch.full((num_rows,), 0.7)
    sampler = DraftSampler(temperature, seeds, positions)
    draft_logits = draft_row.expand(num_rows, -1, -1)
    drafts = torch.stack([sampler(j, draft_logits[:, j]) for j in range(2)], dim=1)
    inp = VerifyInput(target_row.expand(num_rows, -1, -1).contiguous(), drafts, torch.full((num_rows,), 2),
                      temperature, sampler.draft_probs(draft_logits), seeds, positions)
    return inp, torch.softmax(target_row / 0.7, dim=-1)


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_preserves_the_target_distribution() -> None:
    inp, p = _sampled_case(30000)
    out = verify(inp)
    # The first emitted token is distributed as p0; given the first draft was accepted, the second
    # emitted token is distributed as p1 (chi-square, 5 dof, significance 0.001).
    assert _chi_square(out.output_ids[:, 0], p[0]) < CHI2_5DF_0001
    second = out.output_ids[out.num_accepted >= 1, 1]
    assert second.numel() > 5000
    assert _chi_square(second, p[1]) < CHI2_5DF_0001
    # The drafts themselves are not distributed as p: the test would catch a verifier that only
    # passes drafts through.
    assert _chi_square(inp.draft_ids[:, 0], p[0]) > 10 * CHI2_5DF_0001


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    inp, _ = _sampled_case(64)
    whole = verify(inp)
    picks = torch.tensor([40, 3, 17])                 # other rows, other order, other batch size
    sub = VerifyInput(inp.target_logits[picks], inp.draft_ids[picks], inp.num_drafts[picks], inp.temperature[picks],
                      inp.draft_probs[picks], inp.seeds[picks], inp.output_positions[picks])
    part = verify(sub)
    assert torch.equal(part.output_ids, whole.output_ids[picks])
    assert torch.equal(part.num_accepted, whole.num_accepted[picks])
    again = verify(inp)
    assert torch.equal(again.output_ids, whole.output_ids)
    other_seeds = verify(VerifyInput(*(getattr(inp, f) for f in ("target_logits", "draft_ids", "num_drafts",
                                                                  "temperature", "draft_probs")),
                                     inp.seeds + 1000, inp.output_positions))
    assert not torch.equal(other_seeds.output_ids, whole.output_ids)


def test_draft_sampler_is_greedy_at_temperature_zero_and_keyed_otherwise() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    greedy = DraftSampler(torch.zeros(4), torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert torch.equal(greedy(0, logits), logits.argmax(-1))
    hot = DraftSampler(torch.full((4,), 1.0), torch.tensor([5, 5, 6, 6]), torch.tensor([0, 0, 0, 0]))
    a = hot(0, logits[[0, 0, 0, 0]])
    assert a[0] == a[1]                                 # same seed and position: same draw


def test_keyed_uniforms_are_uniform_and_take_every_64_bit_seed() -> None:
    from deepinfer.spec import STREAM_ACCEPT, STREAM_SAMPLE, keyed_uniform, seed_to_int64

    seeds = torch.tensor([seed_to_int64(s) for s in (0, 1, 2**63, 2**64 - 1)])
    u = keyed_uniform(seeds, torch.arange(5).expand(4, -1), STREAM_ACCEPT, num_draws=2000)
    assert u.shape == (4, 5, 2000) and ((u > 0) & (u < 1)).all()
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert len({round(float(x), 6) for x in u[:, :, 0].flatten()}) == 20           # distinct per seed and position
    other = keyed_uniform(seeds, torch.arange(5).expand(4, -1), STREAM_SAMPLE, num_draws=2000)
    assert not torch.equal(u, other)
    import pytest
    with pytest.raises(ValueError):
        seed_to_int64(2**64)
