"""Presets, the redundant-expert count and the balance metric."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.eplb import (
    DECODE_EPLB_CONFIG,
    PREFILL_EPLB_CONFIG,
    EplbConfig,
    ExpertPlacement,
    balance_ratio,
    gpu_loads,
    num_redundant_experts,
    overall_balance,
)


def test_role_presets() -> None:
    assert (
        PREFILL_EPLB_CONFIG.min_redundant_experts,
        PREFILL_EPLB_CONFIG.window_steps,
        PREFILL_EPLB_CONFIG.rebalance_interval_steps,
    ) == (4, 100, 1000)
    assert (
        DECODE_EPLB_CONFIG.min_redundant_experts,
        DECODE_EPLB_CONFIG.window_steps,
        DECODE_EPLB_CONFIG.rebalance_interval_steps,
    ) == (1, 1000, 10000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        PREFILL_EPLB_CONFIG.window_steps = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_redundant_experts": -1}, "min_redundant_experts=-1"),
        ({"window_steps": 0}, "window_steps=0"),
        ({"rebalance_interval_steps": 0}, "rebalance_interval_steps=0"),
        ({"policy": "greedy"}, "policy='greedy'"),
        ({"min_improvement": -0.1}, "min_improvement=-0.1"),
        ({"min_improvement": float("nan")}, "min_improvement=nan"),
        ({"window_steps": 2.5}, "window_steps=2.5"),
    ],
)
def test_config_validation(kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EplbConfig(**kwargs)


@pytest.mark.parametrize(
    ("num_experts", "ep_size", "floor", "expected"),
    [(256, 64, 4, 64), (256, 64, 0, 0), (256, 32, 1, 32), (12, 8, 4, 4), (10, 4, 1, 2), (3, 1, 2, 2)],
)
def test_redundant_expert_examples(num_experts: int, ep_size: int, floor: int, expected: int) -> None:
    assert num_redundant_experts(num_experts, ep_size, floor) == expected


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 400), st.integers(1, 160), st.integers(0, 80))
def test_redundant_expert_count_is_the_smallest_valid(num_experts: int, ep_size: int, floor: int) -> None:
    count = num_redundant_experts(num_experts, ep_size, floor)
    assert count >= floor and (num_experts + count) % ep_size == 0
    assert all((num_experts + r) % ep_size for r in range(floor, count))


def test_redundant_expert_count_validation() -> None:
    with pytest.raises(ValueError, match="ep_size=0"):
        num_redundant_experts(256, 0, 1)
    with pytest.raises(ValueError, match="min_redundant_experts=-2"):
        num_redundant_experts(256, 8, -2)


def test_gpu_loads_split_a_replicated_expert_evenly() -> None:
    # Slots [0, 1 | 0, 2]: expert 0 has two replicas, each carrying 6 / 2.
    placement = ExpertPlacement.from_physical_to_logical([[0, 1, 0, 2], [2, 1, 0, 0]], 3, num_gpus=2)
    loads = np.array([[6.0, 4.0, 2.0], [8.0, 0.0, 4.0]])
    np.testing.assert_allclose(gpu_loads(placement, loads), [[7.0, 5.0], [4.0, 8.0]])
    np.testing.assert_allclose(balance_ratio(placement, loads), [7 / 6, 8 / 6])
    assert overall_balance(placement, loads) == pytest.approx((7 + 8) / (6 + 6))


def test_zero_load_counts_as_balanced() -> None:
    placement = ExpertPlacement.from_physical_to_logical([[0, 1]], 2, num_gpus=2)
    np.testing.assert_array_equal(balance_ratio(placement, [[0, 0]]), [1.0])
    assert overall_balance(placement, [[0, 0]]) == 1.0


def test_metric_checks_load_shape() -> None:
    placement = ExpertPlacement.from_physical_to_logical([[0, 1]], 2, num_gpus=2)
    with pytest.raises(ValueError, match=r"loads must have shape \[1, 2\]"):
        gpu_loads(placement, [[1, 2, 3]])
