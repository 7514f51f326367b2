"""Hypothesis properties of `rebalance_experts` and `place_experts` over random valid layouts."""

from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.eplb import (
    ExpertPlacement,
    balance_ratio,
    gpu_loads,
    place_experts,
    rebalance_experts,
    round_robin_placement,
)

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True)


@dataclass(frozen=True)
class Case:
    weight: np.ndarray  # [layers, experts]
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_gpus: int


@st.composite
def cases(draw) -> Case:
    num_nodes = draw(st.integers(1, 3))
    num_gpus = num_nodes * draw(st.integers(1, 3))
    num_groups = draw(st.integers(1, 6))
    num_experts = num_groups * draw(st.integers(1, 4))
    min_slots_per_gpu = -(-num_experts // num_gpus)
    num_replicas = num_gpus * draw(st.integers(min_slots_per_gpu, min_slots_per_gpu + 2))
    num_layers = draw(st.integers(1, 3))
    # Few distinct values, zeros included, so ties are common.
    values = st.one_of(st.sampled_from([0.0, 1.0, 2.0, 3.0, 7.0]), st.floats(0.0, 1e6, allow_nan=False))
    flat = draw(st.lists(values, min_size=num_layers * num_experts, max_size=num_layers * num_experts))
    weight = np.array(flat, dtype=np.float64).reshape(num_layers, num_experts)
    return Case(weight, num_replicas, num_groups, num_nodes, num_gpus)


def _run(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return rebalance_experts(case.weight, case.num_replicas, case.num_groups, case.num_nodes, case.num_gpus)


@SETTINGS
@given(cases())
def test_outputs_are_consistent(case: Case) -> None:
    phy2log, log2phy, logcnt = _run(case)
    num_layers, num_experts = case.weight.shape

    assert phy2log.shape == (num_layers, case.num_replicas)
    assert logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape == (num_layers, num_experts, logcnt.max())
    assert {a.dtype for a in (phy2log, log2phy, logcnt)} == {np.dtype(np.int64)}
    assert (logcnt >= 1).all()  # every expert placed at least once
    assert (logcnt.sum(axis=1) == case.num_replicas).all()
    for layer in range(num_layers):
        np.testing.assert_array_equal(np.bincount(phy2log[layer], minlength=num_experts), logcnt[layer])
        seen: list[int] = []
        for expert in range(num_experts):
            count = logcnt[layer, expert]
            slots = log2phy[layer, expert, :count]
            assert (log2phy[layer, expert, count:] == -1).all()
            assert (phy2log[layer, slots] == expert).all()
            seen += slots.tolist()
        assert sorted(seen) == list(range(case.num_replicas))


@SETTINGS
@given(cases())
def test_every_gpu_holds_its_share_and_loads_are_conserved(case: Case) -> None:
    placement = ExpertPlacement(*_run(case), num_gpus=case.num_gpus, num_nodes=case.num_nodes)
    slots_per_gpu = case.num_replicas // case.num_gpus

    assert np.bincount(placement.gpu_of_slot()).tolist() == [slots_per_gpu] * case.num_gpus
    per_gpu = gpu_loads(placement, case.weight)
    assert per_gpu.shape == (case.weight.shape[0], case.num_gpus)
    np.testing.assert_allclose(per_gpu.sum(axis=1), case.weight.sum(axis=1), rtol=1e-12)


@SETTINGS
@given(cases())
def test_hierarchical_policy_keeps_expert_groups_inside_nodes(case: Case) -> None:
    if case.num_groups % case.num_nodes != 0:
        return
    phy2log, _, _ = _run(case)
    num_layers, num_experts = case.weight.shape
    group_size = num_experts // case.num_groups
    node_of_slot = np.arange(case.num_replicas) // (case.num_replicas // case.num_nodes)
    for layer in range(num_layers):
        node_of_group = {}
        for slot, expert in enumerate(phy2log[layer]):
            group = int(expert) // group_size
            assert node_of_group.setdefault(group, node_of_slot[slot]) == node_of_slot[slot]
        assert (
            np.bincount(list(node_of_group.values()), minlength=case.num_nodes).tolist()
            == [case.num_groups // case.num_nodes] * case.num_nodes
        )


@SETTINGS
@given(cases())
def test_place_experts_is_never_worse_than_round_robin(case: Case) -> None:
    num_layers, num_experts = case.weight.shape
    placement = place_experts(
        case.weight,
        case.num_replicas,
        num_gpus=case.num_gpus,
        num_nodes=case.num_nodes,
        num_expert_groups=case.num_groups,
    )
    baseline = round_robin_placement(num_layers, num_experts, case.num_replicas, case.num_gpus, case.num_nodes)
    ours = balance_ratio(placement, case.weight)
    theirs = balance_ratio(baseline, case.weight)
    assert (ours <= theirs * (1 + 1e-12)).all()

    # Each layer is either DeepSeek's placement or, where that lost, round-robin.
    greedy, _, _ = _run(case)
    for layer in range(num_layers):
        row = placement.physical_to_logical[layer]
        assert np.array_equal(row, greedy[layer]) or np.array_equal(row, baseline.physical_to_logical[layer])


@SETTINGS
@given(cases())
def test_uniform_loads_give_perfect_balance_without_redundancy(case: Case) -> None:
    num_layers, num_experts = case.weight.shape
    if num_experts % case.num_gpus != 0:
        return
    uniform = np.ones((num_layers, num_experts))
    placement = place_experts(uniform, num_experts, num_gpus=case.num_gpus, num_nodes=case.num_nodes)
    np.testing.assert_allclose(balance_ratio(placement, uniform), 1.0)
