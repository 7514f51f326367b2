"""`rebalance_experts`: DeepSeek's README example and hand-worked cases pinning the tie-breaking."""

import numpy as np
import pytest

from deepinfer.eplb import place_experts, rebalance_experts

# DeepSeek EPLB README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
README_PHY2LOG = np.array(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


def _slots_of(phy2log_row: np.ndarray, expert: int) -> set[int]:
    return {int(s) for s in np.flatnonzero(phy2log_row == expert)}


@pytest.mark.parametrize(
    "weight",
    [
        np.array(README_WEIGHT),
        README_WEIGHT,
        np.array(README_WEIGHT, dtype=np.float32),
        np.array(README_WEIGHT, dtype=np.uint16),
    ],
    ids=["int64", "list", "float32", "uint16"],
)
def test_readme_example_reproduces_exactly(weight) -> None:
    phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)

    np.testing.assert_array_equal(phy2log, README_PHY2LOG)
    for array in (phy2log, log2phy, logcnt):
        assert isinstance(array, np.ndarray) and array.dtype == np.int64
    expected_counts = np.stack([np.bincount(row, minlength=12) for row in README_PHY2LOG])
    np.testing.assert_array_equal(logcnt, expected_counts)
    assert log2phy.shape == (2, 12, 2)
    for layer in range(2):
        for expert in range(12):
            row = log2phy[layer, expert]
            count = logcnt[layer, expert]
            assert set(row[:count].tolist()) == _slots_of(README_PHY2LOG[layer], expert)
            assert (row[count:] == -1).all()


def test_readme_example_keeps_each_group_on_one_node() -> None:
    phy2log, _, _ = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    node_of_slot = np.arange(16) // 8
    for layer in range(2):
        for group in range(4):
            experts = range(3 * group, 3 * group + 3)
            nodes = {int(node_of_slot[s]) for e in experts for s in _slots_of(phy2log[layer], e)}
            assert len(nodes) == 1


def test_global_policy_worked_by_hand() -> None:
    # Replication: slot 4 -> expert 0 (4/1 ties with 4/1, lower index), slot 5 -> expert 1.
    # Packing six replicas of load 2 onto 2 GPUs, all ties: items 0,2,4 -> GPU 0, items 1,3,5 -> GPU 1.
    phy2log, log2phy, logcnt = rebalance_experts([[4, 4, 2, 2]], 6, 1, 1, 2)

    np.testing.assert_array_equal(phy2log, [[0, 2, 0, 1, 3, 1]])
    np.testing.assert_array_equal(logcnt, [[2, 2, 1, 1]])
    np.testing.assert_array_equal(log2phy, [[[0, 2], [3, 5], [1, -1], [4, -1]]])


def test_groups_not_divisible_by_nodes_falls_back_to_global() -> None:
    hierarchical_impossible = rebalance_experts(README_WEIGHT, 16, 3, 2, 8)  # 3 groups, 2 nodes
    single_domain = rebalance_experts(README_WEIGHT, 16, 1, 1, 8)
    for got, want in zip(hierarchical_impossible, single_domain):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(hierarchical_impossible[0], README_PHY2LOG)


def test_greedy_can_lose_to_round_robin_and_place_experts_guards_it() -> None:
    # The cardinality-constrained greedy (DeepSeek's packing) is a heuristic: items 3,3,2,2,2,0 in two
    # packs of three end as {3,2,2}=7 / {3,2,0}=5, while the contiguous layout gives {3,3,0} / {2,2,2}.
    weight = [[3, 3, 0, 2, 2, 2]]
    phy2log, _, _ = rebalance_experts(weight, 6, 1, 1, 2)
    np.testing.assert_array_equal(phy2log, [[0, 3, 5, 1, 4, 2]])

    guarded = place_experts(weight, 6, num_gpus=2)
    np.testing.assert_array_equal(guarded.physical_to_logical, [[0, 1, 2, 3, 4, 5]])


def test_place_experts_matches_rebalance_experts_when_greedy_wins() -> None:
    placement = place_experts(README_WEIGHT, 16, num_gpus=8, num_nodes=2, num_expert_groups=4)
    for got, want in zip(placement.as_tuple(), rebalance_experts(README_WEIGHT, 16, 4, 2, 8)):
        np.testing.assert_array_equal(got, want)


def test_place_experts_policy_choice() -> None:
    forced_global = place_experts(README_WEIGHT, 16, num_gpus=8, num_nodes=2, num_expert_groups=4, policy="global")
    np.testing.assert_array_equal(forced_global.physical_to_logical, rebalance_experts(README_WEIGHT, 16, 1, 1, 8)[0])


def test_one_slot_per_gpu_without_redundancy_is_identity_packing() -> None:
    phy2log, _, logcnt = rebalance_experts([[5, 1, 9, 3]], 4, 1, 1, 4)
    np.testing.assert_array_equal(phy2log, [[0, 1, 2, 3]])
    np.testing.assert_array_equal(logcnt, [[1, 1, 1, 1]])


def test_is_deterministic_and_does_not_touch_input() -> None:
    weight = np.array(README_WEIGHT, dtype=np.float64)
    before = weight.copy()
    first = rebalance_experts(weight, 16, 4, 2, 8)
    second = rebalance_experts(weight, 16, 4, 2, 8)
    np.testing.assert_array_equal(weight, before)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("num_groups", [3, 5, 7])
def test_groups_not_divisible_by_nodes_run_the_global_policy_for_any_group_count(num_groups: int) -> None:
    # DeepSeek's rule: num_groups % num_nodes != 0 -> global policy, which ignores the groups, so the
    # group count need not divide the 12 experts either.
    got = rebalance_experts(README_WEIGHT, 16, num_groups, 2, 8)
    expected = rebalance_experts(README_WEIGHT, 16, 1, 1, 8)
    for got_array, expected_array in zip(got, expected):
        np.testing.assert_array_equal(got_array, expected_array)
    with pytest.raises(ValueError, match="num_groups=5 must divide"):
        rebalance_experts(README_WEIGHT, 16, 5, 1, 8)        # divisible by nodes: hierarchical needs it
