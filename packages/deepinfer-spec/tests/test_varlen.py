import numpy as np
import pytest
import torch

from deepinfer.spec import (
    AcceptanceCalibration,
    DraftRuntimeEstimator,
    FixedVerifyPolicy,
    ForwardRuntimeEstimator,
    SamplerRuntimeEstimator,
    StepTimeCurve,
    VarlenVerifyPolicy,
    choose_query_lens,
    cuda_graph_key,
    cuda_graph_keys,
    cuda_graph_sizes,
    drafting_can_pay,
    query_lens_by_confidence,
)


def test_graph_keys_are_powers_of_two_then_every_interval() -> None:
    assert [cuda_graph_key(q) for q in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 24, 32]
    assert cuda_graph_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert cuda_graph_sizes(33, interval=16) == (1, 2, 4, 8, 16, 32, 48)
    assert all(cuda_graph_key(s) == s for s in cuda_graph_sizes(200))      # every size is its own key
    with pytest.raises(ValueError):
        cuda_graph_key(0)
    totals = np.arange(1, 1000)
    for interval in (1, 3, 6, 8, 16):       # the array form: the same keys
        assert cuda_graph_keys(totals, interval).tolist() == [cuda_graph_key(int(t), interval) for t in totals]


def _curve(max_size: int, knee: int) -> StepTimeCurve:
    """A step-time curve flat-ish up to `knee` tokens, then steep (memory- then compute-bound)."""
    sizes = cuda_graph_sizes(max_size)
    return StepTimeCurve(sizes, tuple(10.0 + 0.05 * s if s <= knee else 10.0 + 0.05 * knee + 0.6 * (s - knee)
                                      for s in sizes))


def _brute_force(rates: list[list[float]], max_query_len: int, forward, sampler) -> int:
    """Best total_q over every allocation: for each total, the best drafts are the top cumulative products."""
    values = sorted((v for r in rates for v in np.cumprod(r[:max_query_len - 1])), reverse=True)
    n = len(rates)
    best, best_q = -1.0, n
    for extra in range(len(values) + 1):
        rate = (n + sum(values[:extra])) / (forward.estimate_ms(n + extra) + sampler.estimate_ms(n))
        if rate > best + 1e-12:
            best, best_q = rate, n + extra
    return best_q


@pytest.mark.parametrize("num_seqs,knee", [(3, 24), (12, 24), (30, 40), (60, 64)])
def test_varlen_picks_the_throughput_optimal_total_q(num_seqs: int, knee: int) -> None:
    rng = np.random.default_rng(num_seqs)
    rates = [list(rng.uniform(0.3, 0.95, size=5)) for _ in range(num_seqs)]
    forward = ForwardRuntimeEstimator(_curve(num_seqs * 6, knee))
    sampler = SamplerRuntimeEstimator()
    sampler.observe(num_seqs, 1.5)
    plan = choose_query_lens(rates, 6, forward, sampler)
    assert plan.total_q == _brute_force(rates, 6, forward, sampler)
    assert int(plan.query_lens.sum()) == plan.total_q
    assert plan.query_lens.min() >= 1 and plan.query_lens.max() <= 6
    # the same split as the on-device function for that total
    on_device = query_lens_by_confidence(torch.tensor(rates, dtype=torch.float32), plan.total_q)
    assert on_device.tolist() == plan.query_lens.tolist()


def test_free_verify_takes_everything_and_expensive_verify_takes_nothing() -> None:
    rates = [[0.9, 0.8, 0.7, 0.6, 0.5]] * 4
    flat = ForwardRuntimeEstimator(StepTimeCurve((1, 64), (10.0, 10.0)))
    assert choose_query_lens(rates, 6, flat, SamplerRuntimeEstimator()).query_lens.tolist() == [6, 6, 6, 6]
    steep = ForwardRuntimeEstimator(StepTimeCurve((1, 64), (1.0, 640.0)))
    assert choose_query_lens(rates, 6, steep, SamplerRuntimeEstimator()).query_lens.tolist() == [1, 1, 1, 1]


def test_policies_answer_the_scheduler_protocol_shape() -> None:
    forward = ForwardRuntimeEstimator(_curve(64, 16))
    policy = VarlenVerifyPolicy(forward, SamplerRuntimeEstimator(), default_acceptance=(0.0,))
    policy.observe("a", [0.99, 0.99, 0.99, 0.99, 0.99])
    lens = policy.query_lens(("a", "b"), np.array([10, 9], dtype=np.int32), 6)
    assert lens.dtype == np.int32 and lens.tolist() == [6, 1]
    policy.forget("a")
    assert policy.query_lens(("a", "b"), np.array([10, 9], dtype=np.int32), 6).tolist() == [1, 1]
    fixed = FixedVerifyPolicy().query_lens(("a", "b", "c"), np.array([3, 2, 1], dtype=np.int32), 4)
    assert fixed.tolist() == [4, 4, 4]


def test_forward_estimator_learns_a_slope_and_sampler_interpolates() -> None:
    curve = StepTimeCurve((1, 2, 4, 8, 16), (5.0, 5.0, 6.0, 7.0, 9.0))
    forward = ForwardRuntimeEstimator(curve)
    assert forward.estimate_ms(3) == 6.0                     # runs the graph of size 4
    for size in (1, 2, 4, 8, 16):
        for _ in range(3):
            forward.observe(size, curve.at(size) + 0.25 * size)
    forward.observe(8, 1000.0)                               # an outlier moves a median of medians little
    assert forward.slope_ms_per_token == pytest.approx(0.25)
    assert forward.estimate_ms(5) == pytest.approx(7.0 + 0.25 * 8)
    sampler = SamplerRuntimeEstimator(window=3)
    assert sampler.estimate_ms(4) == 0.0
    for ms in (1.0, 9.0, 2.0, 3.0):                          # window of 3 keeps 9, 2, 3
        sampler.observe(4, ms)
    sampler.observe(8, 5.0)
    assert sampler.estimate_ms(4) == 3.0
    assert sampler.estimate_ms(6) == pytest.approx(4.0)
    assert sampler.estimate_ms(100) == 5.0 and sampler.estimate_ms(1) == 3.0


def test_split_by_confidence_keeps_each_request_a_prefix() -> None:
    conf = torch.tensor([[0.9, 0.1, 0.99], [0.5, 0.5, 0.5]])
    # cumulative products: [0.9, 0.09, 0.089], [0.5, 0.25, 0.125]
    assert query_lens_by_confidence(conf, 2).tolist() == [1, 1]
    assert query_lens_by_confidence(conf, 4).tolist() == [2, 2]
    assert query_lens_by_confidence(conf, 6).tolist() == [2, 4]
    with pytest.raises(ValueError):
        query_lens_by_confidence(conf, 9)


def _draft_cost(ms_per_row: float, base_ms: float = 0.0) -> DraftRuntimeEstimator:
    rows = (1, 2, 4, 8, 16, 32, 64)
    return DraftRuntimeEstimator(prior=StepTimeCurve(rows, tuple(base_ms + ms_per_row * r for r in rows)))


def test_the_draft_walk_is_paid_for_only_by_rows_given_a_draft() -> None:
    good, poor = [0.95, 0.9, 0.85, 0.8, 0.75], [0.2, 0.1, 0.05, 0.0, 0.0]
    flat = ForwardRuntimeEstimator(StepTimeCurve((1, 64), (10.0, 10.0)))
    sampler = SamplerRuntimeEstimator(prior=StepTimeCurve((1, 64), (1.0, 1.0)))
    # a flat forward and a free draft walk: every draft of positive value is verified
    assert choose_query_lens([good, poor], 6, flat, sampler).query_lens.tolist() == [6, 4]
    # a walk costing 4 ms per row: the poor row's 0.35 expected tokens do not pay for its walk, so it
    # stays a plain decode row (no walk) while the good row drafts all 5
    plan = choose_query_lens([good, poor], 6, flat, sampler, _draft_cost(4.0))
    assert plan.query_lens.tolist() == [6, 1]
    assert plan.expected_ms == pytest.approx(10.0 + 1.0 + 4.0)
    # a walk costlier than everything its drafts can bring: nobody drafts, the step is a plain one
    plan = choose_query_lens([good, poor], 6, flat, sampler, _draft_cost(40.0))
    assert plan.query_lens.tolist() == [1, 1] and plan.expected_ms == pytest.approx(11.0)


@pytest.mark.parametrize(("curve", "draft_ms", "pays"), [
    (StepTimeCurve((1, 8, 64), (10.0, 10.0, 10.5)), 1.0, True),       # flat (a GPU at small batches): pays
    (StepTimeCurve((1, 8, 64), (1.0, 8.0, 64.0)), 0.5, False),        # every token costs the first's: never
    (StepTimeCurve((1, 8, 64), (10.0, 10.0, 10.5)), 100.0, False),    # a flat forward but a slow walk
])
def test_drafting_can_pay_at_some_batch_size_or_never(curve: StepTimeCurve, draft_ms: float, pays: bool) -> None:
    forward, sampler = ForwardRuntimeEstimator(curve), SamplerRuntimeEstimator()
    assert drafting_can_pay(8, 6, forward, sampler, _draft_cost(draft_ms)) is pays
    policy = VarlenVerifyPolicy(forward, sampler, draft=_draft_cost(draft_ms), plain_only=not pays,
                                default_acceptance=(1.0,))
    lens = policy.query_lens(("a", "b"), np.array([10, 9], dtype=np.int32), 6)
    assert (lens.tolist() == [1, 1]) is not pays


def test_estimators_start_from_their_prior_until_measured() -> None:
    sampler = SamplerRuntimeEstimator(prior=StepTimeCurve((1, 4), (1.0, 4.0)))
    assert sampler.estimate_ms(2) == 2.0
    sampler.observe(2, 7.0)                  # a measurement replaces the prior
    assert sampler.estimate_ms(2) == 7.0 and sampler.estimate_ms(4) == 7.0
    draft = _draft_cost(2.0)
    assert draft.estimate_ms(0) == 0.0 and draft.estimate_ms(3) == 6.0



def test_calibration_is_accepted_over_predicted_over_a_window() -> None:
    calibration = AcceptanceCalibration(window=4, prior_rows=2, prior_expected=1.0)
    assert calibration.factor == 1.0
    for _ in range(4):
        calibration.observe(3.0, 0)                 # predicted 3 accepted drafts, none were
    assert calibration.factor == pytest.approx(2 / 14)
    for _ in range(4):
        calibration.observe(1.0, 2)                 # the window forgets the old rows
    assert calibration.factor == pytest.approx(10 / 6)


def test_an_overconfident_head_is_calibrated_down_to_plain_rows() -> None:
    forward = ForwardRuntimeEstimator(StepTimeCurve((1, 64), (10.0, 11.0)))
    policy = VarlenVerifyPolicy(forward, SamplerRuntimeEstimator(), draft=_draft_cost(3.0))
    policy.observe("a", [0.9] * 5)
    assert policy.query_lens(("a",), np.array([10], dtype=np.int32), 6).tolist() == [6]
    for _ in range(100):                            # its drafts are never accepted
        policy.calibration.observe(3.0, 0)
    assert policy.query_lens(("a",), np.array([10], dtype=np.int32), 6).tolist() == [1]
    # scaled values stay probabilities and keep each row's drafts a prefix
    plan = choose_query_lens([[0.9, 0.8, 0.5]], 4, forward, SamplerRuntimeEstimator(), acceptance_scale=3.0)
    assert plan.query_lens.tolist() == [4] and plan.expected_tokens == pytest.approx(4.0)


def test_a_row_kept_plain_is_reprobed_with_one_draft_and_waits_twice_as_long_after_each_miss() -> None:
    forward = ForwardRuntimeEstimator(StepTimeCurve((1, 64), (10.0, 11.0)))
    policy = VarlenVerifyPolicy(forward, SamplerRuntimeEstimator(), draft=_draft_cost(3.0), reprobe_after=2,
                                max_reprobe_after=4)
    seq_lens = np.array([10], dtype=np.int32)
    policy.observe("a", [0.05] * 5)               # a bad first step: its drafts do not pay
    lens = [policy.query_lens(("a",), seq_lens, 6).tolist()[0] for _ in range(12)]
    # plain, probe (one draft) after 2 plain steps, then after 4, 4 (capped) ...
    assert lens == [1, 2, 1, 1, 1, 2, 1, 1, 1, 2, 1, 1]
    assert policy.last_plan is not None and policy.last_plan.total_q == 1
    policy.observe("a", [0.95] * 5)               # a probe finds good drafts: the row drafts again,
    assert policy.query_lens(("a",), seq_lens, 6).tolist() == [6]
    policy.observe("a", [0.05] * 5)               # and the next stretch waits from the start again
    assert [policy.query_lens(("a",), seq_lens, 6).tolist()[0] for _ in range(3)] == [1, 2, 1]
    policy.forget("a")
    with pytest.raises(ValueError, match="reprobe_after=0"):
        VarlenVerifyPolicy(forward, SamplerRuntimeEstimator(), reprobe_after=0)
