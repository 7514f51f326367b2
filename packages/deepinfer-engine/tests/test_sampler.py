from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from deepinfer.engine.sampling.sampler import MAX_LOGIT_MAGNITUDE, Sampler, logprob_dicts
from deepinfer.engine.sampling.sampling_batch import (
    InvalidSamplingBatch,
    RequestRng,
    SamplingBatch,
    build_sampling_batch,
)
from deepinfer.engine.sampling.sampling_params import (
    GREEDY_TEMPERATURE,
    MAX_TEMPERATURE,
    MIN_PROBABILITY_CUT,
    SamplingParams,
)

EOS = 2


def make_batch(
    params: Sequence[SamplingParams],
    vocab_size: int,
    *,
    rngs: Sequence[RequestRng | None] | None = None,
    num_output_tokens: Sequence[int] | None = None,
    device: str = "cpu",
) -> SamplingBatch:
    return build_sampling_batch(
        params,
        rngs=rngs if rngs is not None else [RequestRng.for_params(p, device) for p in params],
        num_output_tokens=num_output_tokens if num_output_tokens is not None else [0] * len(params),
        eos_token_ids=[EOS],
        vocab_size=vocab_size,
        device=device,
    )


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


def sample_counts(params: SamplingParams, logits_row: list[float], num_rows: int = 4000) -> list[int]:
    """Sample `num_rows` rows sharing one distribution with a seeded sampler; counts per token."""
    logits = torch.tensor([logits_row] * num_rows)
    batch = make_batch([params] * num_rows, len(logits_row))
    tokens = Sampler(seed=1234)(logits, batch).token_ids
    return torch.bincount(tokens, minlength=len(logits_row)).tolist()


def test_greedy_takes_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0], [5.0, 1.0, 1.0, 7.0]])
    batch = make_batch([SamplingParams(temperature=0.0)] * 3, 4)
    assert Sampler()(logits, batch).token_ids.tolist() == [1, 0, 3]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]] * 4)   # EOS=2 best, then 3, then 4
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    batch = make_batch([params, params, ignore, params], 5, num_output_tokens=[0, 1, 0, 2])
    # rows 0, 1 below min_tokens: EOS and 3 banned; row 2 ignores EOS so only 3 banned; row 3 reached it.
    assert Sampler()(logits, batch).token_ids.tolist() == [4, 4, 2, 2]


def test_banned_ids_beyond_vocab_are_skipped() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[1, 99])
    batch = make_batch([params], 4)
    assert batch.banned_token_ids.tolist() == [1, 2]
    assert Sampler()(torch.tensor([[0.0, 5.0, 4.0, 3.0]]), batch).token_ids.tolist() == [3]


def test_top_k_one_is_argmax_and_top_k_keeps_lowest_ids_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]] * 200)
    assert set(sample_counts_of(logits, SamplingParams(top_k=1, seed=None))) == {1}
    assert set(sample_counts_of(logits, SamplingParams(top_k=2))) == {1, 2}


def sample_counts_of(logits: torch.Tensor, params: SamplingParams) -> dict[int, int]:
    batch = make_batch([params] * logits.shape[0], logits.shape[1])
    tokens = Sampler(seed=7)(logits, batch).token_ids.tolist()
    return {t: tokens.count(t) for t in set(tokens)}


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.01, {0}), (0.5, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p: float, expected: set[int]) -> None:
    counts = sample_counts(SamplingParams(top_p=top_p), log_probs(0.5, 0.3, 0.15, 0.05))
    assert {t for t, c in enumerate(counts) if c} == expected


def test_top_p_applies_to_the_renormalised_top_k_distribution() -> None:
    # top-2 renormalised = [4/7, 3/7]: 4/7 >= 0.5 already, so only token 0 survives. Over the full
    # distribution 0.4 < 0.5 and token 1 would survive too.
    counts = sample_counts(SamplingParams(top_k=2, top_p=0.5), log_probs(0.4, 0.3, 0.2, 0.1))
    assert counts == [4000, 0, 0, 0]


@pytest.mark.parametrize("with_sort", [False, True])
def test_min_p_drops_tokens_below_fraction_of_max(with_sort: bool) -> None:
    # with_sort: a top_k row in the batch forces the sorted path for every row.
    params = SamplingParams(min_p=0.5)
    other = SamplingParams(top_k=3) if with_sort else params
    row = log_probs(0.5, 0.3, 0.15, 0.05)
    logits = torch.tensor([row] * 2000 + [row])
    batch = make_batch([params] * 2000 + [other], 4)
    tokens = Sampler(seed=3)(logits, batch).token_ids[:2000]
    assert set(tokens.tolist()) == {0, 1}


def test_sampled_frequencies_follow_tempered_softmax() -> None:
    row = [0.0, 1.0, 2.0, -1.0, 0.5]
    num_rows = 20000
    counts = sample_counts(SamplingParams(temperature=0.5), row, num_rows)
    expected = torch.softmax(torch.tensor(row) / 0.5, dim=-1).tolist()
    for token, (count, p) in enumerate(zip(counts, expected)):
        sigma = math.sqrt(num_rows * p * (1 - p))
        assert abs(count - num_rows * p) < 5 * sigma + 1, (token, count, num_rows * p)


def test_force_top_k_restricts_candidates() -> None:
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, 1.6]] * 500)
    batch = make_batch([SamplingParams()] * 500, 5)
    tokens = Sampler(seed=0, force_top_k=2)(logits, batch).token_ids
    assert set(tokens.tolist()) == {0, 1}
    assert set(Sampler(seed=0)(logits, batch).token_ids.tolist()) == {0, 1, 2, 3, 4}


def run_seeded_request(
    seed: int, row_index: int, batch_size: int, num_steps: int = 6, device: str = "cpu"
) -> list[int]:
    """Sample `num_steps` tokens of a seeded request placed at `row_index` among varied neighbours."""
    vocab_size = 3000
    target = SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
    target_rng = RequestRng.for_params(target, device)
    neighbours = [
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(top_k=20, seed=99),
        SamplingParams(min_p=0.1, logprobs=2),
        SamplingParams(temperature=1.3),
    ]
    neighbour_rngs = [RequestRng.for_params(p, device) for p in neighbours]
    sampler = Sampler()
    tokens = []
    for step in range(num_steps):
        step_gen = torch.Generator().manual_seed(1000 + step)
        target_logits = torch.randn(vocab_size, generator=step_gen) * 3
        noise_gen = torch.Generator().manual_seed(batch_size * 100 + row_index * 10 + step)
        logits = torch.randn(batch_size, vocab_size, generator=noise_gen) * 3
        logits[row_index] = target_logits
        params, rngs = [], []
        for row in range(batch_size):
            if row == row_index:
                params.append(target)
                rngs.append(target_rng)
            else:
                params.append(neighbours[row % len(neighbours)])
                rngs.append(neighbour_rngs[row % len(neighbours)])
        batch = make_batch(params, vocab_size, rngs=rngs, num_output_tokens=[step] * batch_size, device=device)
        tokens.append(sampler(logits.to(device), batch).token_ids[row_index].item())
    assert target_rng is not None and target_rng.num_draws == num_steps
    return tokens


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_seeded_request_is_independent_of_batch_composition(device: str) -> None:
    alone = run_seeded_request(seed=42, row_index=0, batch_size=1, device=device)
    assert run_seeded_request(seed=42, row_index=0, batch_size=5, device=device) == alone
    assert run_seeded_request(seed=42, row_index=3, batch_size=5, device=device) == alone
    assert run_seeded_request(seed=42, row_index=6, batch_size=7, device=device) == alone
    assert run_seeded_request(seed=43, row_index=0, batch_size=1, device=device) != alone


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_topk_fast_path_agrees_with_full_sort(device: str) -> None:
    # Rows that all set top_k take one topk; one row without top_k forces a full sort for the batch.
    # Logits are quantised so many tokens tie: both paths must keep the lowest ids among ties.
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randint(0, 6, (6, 400), generator=gen) * 0.5).float().to(device)
    params = [SamplingParams(top_k=k, top_p=p, seed=s) for k, p, s in
              [(1, 1.0, 1), (3, 1.0, 2), (40, 0.5, 3), (100, 0.9, 4), (7, 0.3, 5), (250, 1.0, 6)]]
    fast = Sampler()(logits, make_batch(params, 400, device=device)).token_ids
    with_sort = make_batch([*params, SamplingParams(seed=7)], 400, device=device)
    assert not with_sort.max_top_k < 400
    slow = Sampler()(torch.cat([logits, logits[:1]]), with_sort).token_ids[:6]
    assert torch.equal(fast, slow)
    assert fast[0].item() == int(torch.argmax(logits[0]).item())


def test_unseeded_rows_reproduce_with_a_seeded_sampler() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    batch = make_batch([SamplingParams(temperature=1.0)] * 8, 100)
    first = Sampler(seed=5)(logits, batch).token_ids
    assert torch.equal(first, Sampler(seed=5)(logits, batch).token_ids)


def test_greedy_rows_do_not_advance_their_generator() -> None:
    params = SamplingParams(temperature=0.0, seed=1)
    rng = RequestRng.for_params(params)
    Sampler()(torch.zeros(1, 10), make_batch([params], 10, rngs=[rng]))
    assert rng is not None and rng.num_draws == 0


def test_mixed_batch_puts_each_token_at_its_row() -> None:
    logits = torch.full((4, 6), -20.0)
    for row, best in enumerate([5, 1, 4, 0]):
        logits[row, best] = 20.0   # random rows are then near-deterministic too
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0),
              SamplingParams(top_k=3, seed=8)]
    assert Sampler()(logits, make_batch(params, 6)).token_ids.tolist() == [5, 1, 4, 0]


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.3, top_k=5, logprobs=3), SamplingParams(logprobs=0),
              SamplingParams(temperature=0.0)]
    batch = make_batch(params, 50)
    out = Sampler(seed=0)(logits, batch)
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs is not None and out.top_ids is not None
    assert out.top_ids.shape == (3, 3) and out.top_logprobs.dtype == torch.float32
    expected_values, expected_ids = raw.sort(dim=-1, descending=True)
    torch.testing.assert_close(out.top_logprobs, expected_values[:, :3])
    assert torch.equal(out.top_ids, expected_ids[:, :3])
    dicts = logprob_dicts(out, batch)
    tokens = out.token_ids.tolist()
    assert dicts[0] is not None and set(dicts[0]) == {tokens[0], *expected_ids[0, :3].tolist()}
    assert dicts[1] == {tokens[1]: pytest.approx(raw[1, tokens[1]].item())}
    assert dicts[2] is None


def test_no_logprobs_requested_gives_no_top_tensors() -> None:
    out = Sampler()(torch.zeros(2, 5), make_batch([SamplingParams()] * 2, 5))
    assert out.top_ids is None and out.top_logprobs is None
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32


def test_bad_inputs_raise_clear_errors() -> None:
    batch = make_batch([SamplingParams()], 5)
    with pytest.raises(InvalidSamplingBatch, match=r"logits must be float32 \[num_seqs=1, vocab_size=5\]"):
        Sampler()(torch.zeros(1, 5, dtype=torch.float64), batch)
    with pytest.raises(InvalidSamplingBatch, match="logits must be float32"):
        Sampler()(torch.zeros(2, 5), batch)
    with pytest.raises(InvalidSamplingBatch, match=r"rngs\[0\] must be a RequestRng"):
        make_batch([SamplingParams(seed=1)], 5, rngs=[None])
    with pytest.raises(InvalidSamplingBatch, match=r"rngs\[0\] must be a RequestRng"):
        make_batch([SamplingParams()], 5, rngs=[RequestRng(3)])
    with pytest.raises(InvalidSamplingBatch, match="len\\(rngs\\)=0"):
        make_batch([SamplingParams()], 5, rngs=[])
    with pytest.raises(InvalidSamplingBatch, match=r"seed=-1 must be an int in \[0, 2\*\*64 - 1\]"):
        RequestRng(-1)
    with pytest.raises(InvalidSamplingBatch, match="force_top_k=0 must be None or >= 1"):
        Sampler(force_top_k=0)
    with pytest.raises(InvalidSamplingBatch, match="vocab_size=0 must be >= 1"):
        make_batch([SamplingParams()], 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampler_on_cuda_matches_rules() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]] * 3, device="cuda")
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=2, seed=4), SamplingParams(top_k=1)]
    batch = make_batch(params, 4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")   # any host-device sync inside the sampler raises
    try:
        out = Sampler(seed=0)(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids[0].item() == 1 and out.token_ids[1].item() in (1, 2) and out.token_ids[2].item() == 1
    again = make_batch([params[1]], 4, device="cuda")
    first = Sampler()(logits[:1], again).token_ids.item()
    assert first == Sampler()(logits[:1], make_batch([params[1]], 4, device="cuda")).token_ids.item()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_row_without_cuts_is_not_cut_by_its_neighbours_top_k(device: str) -> None:
    # One row keeps its 2 most likely tokens; the other cuts nothing, so over many draws from a flat
    # distribution it must reach tokens far outside the first row's candidates.
    logits = torch.zeros(2, 50, device=device)
    batch = make_batch([SamplingParams(top_k=2), SamplingParams()], 50, device=device)
    sampler = Sampler(seed=0)
    draws = torch.stack([sampler(logits, batch).token_ids for _ in range(40)]).cpu()
    assert set(draws[:, 0].tolist()) <= {0, 1}
    assert len(set(draws[:, 1].tolist())) > 10


def test_rows_with_non_finite_logits_are_flagged_and_the_others_sampled() -> None:
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [0.0, 1.0, 9.0, 3.0],            # fine
        [0.0, nan, 9.0, 3.0],            # NaN
        [0.0, 1.0, inf, 3.0],            # +inf
        [-inf, -inf, -inf, -inf],        # nothing finite
        [-inf, 5.0, -inf, 4.0],          # some -inf: fine (a model may mask tokens itself)
        [2e33, 0.0, 0.0, 0.0],           # divided by a temperature of 1e-5 it could overflow float32
        [-2e33, -2e33, -2e33, -2e33],    # ... and these underflow to -inf
        [0.0, 1.0, -inf, 9.0],           # fine
    ])
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0),
              SamplingParams(seed=3), SamplingParams(top_k=1), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.5), SamplingParams(top_k=1, seed=5)]
    out = Sampler(seed=0)(logits, make_batch(params, 4))
    assert out.finite_rows.tolist() == [True, False, False, False, True, False, False, True]
    tokens = out.token_ids.tolist()
    assert (tokens[0], tokens[4], tokens[7]) == (2, 1, 3)
    assert all(0 <= t < 4 for t in tokens)          # flagged rows still give an id in range


def test_largest_allowed_logits_sample_at_the_smallest_temperature() -> None:
    # |logsumexp| up to MAX_LOGIT_MAGNITUDE divided by float32(1e-5) stays finite: no NaN, no flag.
    big = MAX_LOGIT_MAGNITUDE
    logits = torch.tensor([[big, 0.0, -big, 0.0], [-big] * 4, [0.0, -big, 1.0, 0.5]])
    assert torch.isfinite(logits / torch.tensor(GREEDY_TEMPERATURE, dtype=torch.float32)).all()
    params = [SamplingParams(temperature=GREEDY_TEMPERATURE)] * 3
    out = Sampler(seed=0)(logits, make_batch(params, 4))
    assert out.finite_rows.tolist() == [True, True, True]
    assert out.token_ids[0].item() == 0 and out.token_ids[2].item() == 2


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"top_p": MIN_PROBABILITY_CUT}, {3}),                       # only the best allowed token
        ({"temperature": GREEDY_TEMPERATURE}, {3}),
        ({"temperature": MAX_TEMPERATURE}, {0, 1, 3, 4}),             # near uniform over the allowed
        ({"temperature": 5.0, "min_p": MIN_PROBABILITY_CUT}, {0, 1, 3, 4}),
    ],
)
def test_extreme_allowed_params_never_sample_a_banned_token(kwargs: dict, expected: set[int]) -> None:
    # EOS (the best token) is banned below min_tokens: a cut rounded to 0 would keep nothing and the
    # race would fall back to token 0, bypassing the ban and the ranking alike.
    logits = torch.tensor([[-5.0, 1.0, 9.0, 8.0, 7.0]] * 500)
    params = SamplingParams(min_tokens=1, **kwargs)
    assert set(Sampler(seed=2)(logits, make_batch([params] * 500, 5)).token_ids.tolist()) == expected


def test_logprob_dicts_reads_nothing_when_no_row_asked() -> None:
    batch = make_batch([SamplingParams(), SamplingParams(temperature=0.0)], 5)
    out = Sampler(seed=0)(torch.zeros(2, 5), batch)
    assert logprob_dicts(out, batch) == [None, None]
    with_logprobs = make_batch([SamplingParams(logprobs=1), SamplingParams(temperature=0.0)], 5)
    out = Sampler(seed=0)(torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]] * 2), with_logprobs)
    dicts = logprob_dicts(out, with_logprobs, token_ids=[4, 1])    # the caller's host copy is used
    assert dicts[0] is not None and set(dicts[0]) == {4, 1} and dicts[1] is None
