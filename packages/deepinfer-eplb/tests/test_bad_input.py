"""Bad input gives a ValueError whose message names the offending field."""

import math

import numpy as np
import pytest

from deepinfer.eplb import place_experts, rebalance_experts, round_robin_placement

GOOD = np.arange(24, dtype=np.float64).reshape(2, 12)


@pytest.mark.parametrize(
    ("weight", "field", "detail"),
    [
        (np.arange(12.0), "weight", "2 dims"),
        (np.zeros((2, 12, 1)), "weight", "2 dims"),
        (np.zeros((0, 12)), "weight", "empty"),
        (np.zeros((2, 0)), "weight", "empty"),
        ([[1.0, 2.0], [3.0]], "weight", "rectangular"),
        (np.array([["a", "b"]]), "weight", "real numbers"),
        (np.ones((2, 12), dtype=bool), "weight", "real numbers"),
        (np.ones((2, 12), dtype=np.complex64), "weight", "real numbers"),
    ],
)
def test_weight_shape_and_dtype(weight, field: str, detail: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        rebalance_experts(weight, 16, 4, 2, 8)
    assert detail in str(info.value)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, -math.inf])
def test_weight_values(bad: float) -> None:
    weight = GOOD.copy()
    weight[1, 7] = bad
    with pytest.raises(ValueError, match=r"weight\[1, 7\]"):
        rebalance_experts(weight, 16, 4, 2, 8)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((18, 4, 2, 8), "num_replicas=18 must be a multiple of num_gpus=8"),
        ((8, 4, 2, 8), "num_replicas=8 must be >= the number of logical experts"),
        ((16, 5, 1, 8), "num_groups=5 must divide"),
        ((16, 4, 3, 8), "num_gpus=8 must be a multiple of num_nodes=3"),
        ((0, 4, 2, 8), "num_replicas=0 must be >= 1"),
        ((16, 0, 2, 8), "num_groups=0"),
        ((16, 4, -2, 8), "num_nodes=-2"),
        ((16, 4, 2, 0), "num_gpus=0"),
        ((16.0, 4, 2, 8), "num_replicas=16.0 must be an integer"),
        ((16, True, 2, 8), "num_groups=True must be an integer"),
    ],
)
def test_counts_and_divisibility(args, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace("[", r"\[")):
        rebalance_experts(GOOD, *args)


def test_numpy_integer_counts_are_accepted() -> None:
    phy2log, _, _ = rebalance_experts(GOOD, np.int64(16), np.int32(4), np.uint8(2), np.int16(8))
    assert phy2log.shape == (2, 16)


def test_hierarchical_policy_requires_groups_divisible_by_nodes() -> None:
    with pytest.raises(ValueError, match="num_groups=3 must be a multiple of num_nodes=2"):
        place_experts(GOOD, 16, num_gpus=8, num_nodes=2, num_expert_groups=3, policy="hierarchical")
    # "auto" falls back to the global policy instead of failing.
    assert place_experts(GOOD, 16, num_gpus=8, num_nodes=2, num_expert_groups=3).num_physical_experts == 16


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy='best'"):
        place_experts(GOOD, 16, num_gpus=8, policy="best")


def test_place_experts_names_its_slot_field() -> None:
    with pytest.raises(ValueError, match="num_physical_experts=12 must be a multiple of num_gpus=8"):
        place_experts(GOOD, 12, num_gpus=8)


def test_round_robin_placement_checks_layout() -> None:
    with pytest.raises(ValueError, match="num_physical_experts=10 must be >= the number of logical experts"):
        round_robin_placement(1, 12, 10, 2)
    with pytest.raises(ValueError, match="num_layers=0"):
        round_robin_placement(0, 12, 12, 2)
