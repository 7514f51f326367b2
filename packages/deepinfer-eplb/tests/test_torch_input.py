"""Torch tensors are accepted wherever loads are (converted through numpy; skipped without torch)."""

import numpy as np
import pytest

from deepinfer.eplb import (
    EplbConfig,
    ExpertBalancer,
    LoadRecorder,
    ModelBalancer,
    place_experts,
    rebalance_experts,
)

torch = pytest.importorskip("torch")

README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor(README_WEIGHT),
        lambda: torch.tensor(README_WEIGHT, dtype=torch.float32),
        lambda: torch.tensor(README_WEIGHT, dtype=torch.bfloat16),  # all entries < 256: exact in bf16
        lambda: torch.tensor(README_WEIGHT, dtype=torch.float32, requires_grad=True),
        lambda: torch.tensor(README_WEIGHT, dtype=torch.float64).t().contiguous().t(),  # non-contiguous
    ],
    ids=["int64", "float32", "bfloat16", "requires-grad", "strided"],
)
def test_torch_weight_matches_numpy(make) -> None:
    expected = rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    got = rebalance_experts(make(), 16, 4, 2, 8)
    for a, b in zip(got, expected):
        assert isinstance(a, np.ndarray) and a.dtype == np.int64
        np.testing.assert_array_equal(a, b)
    placement = place_experts(make(), 16, num_gpus=8, num_nodes=2, num_expert_groups=4)
    np.testing.assert_array_equal(placement.physical_to_logical, expected[0])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_torch_bad_values_name_the_entry(bad: float) -> None:
    weight = torch.arange(24, dtype=torch.float32).reshape(2, 12)
    weight[1, 7] = bad
    with pytest.raises(ValueError, match=r"weight\[1, 7\]"):
        rebalance_experts(weight, 16, 4, 2, 8)


def test_torch_complex_is_rejected() -> None:
    with pytest.raises(ValueError, match="weight must hold real loads"):
        rebalance_experts(torch.ones(2, 12, dtype=torch.complex64), 16, 4, 2, 8)


def test_recorder_and_balancers_take_tensors() -> None:
    recorder = LoadRecorder(2, 3, window_steps=4)
    recorder.record(torch.ones(2, 3, dtype=torch.int32))
    np.testing.assert_array_equal(recorder.window_loads(), np.ones((2, 3)))

    config = EplbConfig(min_redundant_experts=2, window_steps=1, rebalance_interval_steps=1)
    balancer = ExpertBalancer(config, layer_ids=[0], num_logical_experts=8, num_gpus=2)
    hot = torch.full((1, 8), 10.0)
    hot[0, 5] = 200.0
    change = balancer.record(hot)
    assert change is not None and change.placement.logical_replica_counts[0, 5] == 3

    model = ModelBalancer(config, {1: 4}, num_gpus=2)
    assert len(model.record({1: torch.tensor([1, 1, 30, 1])})) == 1
