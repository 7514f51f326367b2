"""`plan_moves`: exact plans on small cases, minimality by brute force, and execution by simulation."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.eplb import ExpertPlacement, plan_moves, round_robin_placement

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True)


def _placement(rows, num_experts: int, num_gpus: int, num_nodes: int = 1) -> ExpertPlacement:
    return ExpertPlacement.from_physical_to_logical(np.array(rows), num_experts, num_gpus, num_nodes)


def _moves(plan) -> list[tuple[int, int, int, int, bool]]:
    return list(
        zip(
            plan.layer_ids.tolist(),
            plan.logical_ids.tolist(),
            plan.src_slots.tolist(),
            plan.dst_slots.tolist(),
            plan.is_remote.tolist(),
        )
    )


def test_identical_placements_need_no_moves() -> None:
    placement = _placement([[0, 1, 2, 3, 0, 1]], 4, 2)
    plan = plan_moves(placement, placement)
    assert plan.num_moves == 0
    np.testing.assert_array_equal(plan.placement.physical_to_logical, placement.physical_to_logical)


def test_reordering_inside_a_gpu_is_free() -> None:
    old = _placement([[0, 1, 2, 3]], 4, 2)
    new = _placement([[1, 0, 3, 2]], 4, 2)
    plan = plan_moves(old, new)
    assert plan.num_moves == 0
    np.testing.assert_array_equal(plan.placement.physical_to_logical, old.physical_to_logical)


def test_exact_plan_with_remote_and_local_moves() -> None:
    # GPU 0 slots 0-2, GPU 1 slots 3-5.
    old = _placement([[0, 1, 2, 3, 4, 0]], 5, 2)
    new = _placement([[3, 3, 0, 1, 2, 4]], 5, 2)
    plan = plan_moves(old, new, relabel=False)

    # GPU 0 keeps expert 0 in slot 0, needs two copies of 3: one remote from slot 3, one local.
    # GPU 1 keeps expert 4 in slot 4, needs 1 and 2: both remote from GPU 0 (slots 1 and 2).
    np.testing.assert_array_equal(plan.placement.physical_to_logical, [[0, 3, 3, 1, 4, 2]])
    assert _moves(plan) == [
        (0, 3, 3, 1, True),
        (0, 1, 1, 3, True),
        (0, 2, 2, 5, True),
        (0, 3, 1, 2, False),
    ]
    assert (plan.num_remote, plan.num_local) == (3, 1)


def test_relabeling_gpus_saves_moves() -> None:
    # Same case: new GPU 1's experts {1, 2, 4} overlap old GPU 0 by two, new GPU 0's {3, 3, 0} old
    # GPU 1 by two, so the GPUs swap labels. GPU 0 keeps 1, 2 and receives 4; GPU 1 keeps 3, 0 and
    # copies 3 locally.
    old = _placement([[0, 1, 2, 3, 4, 0]], 5, 2)
    plan = plan_moves(old, _placement([[3, 3, 0, 1, 2, 4]], 5, 2))
    np.testing.assert_array_equal(plan.placement.physical_to_logical, [[4, 1, 2, 3, 3, 0]])
    assert _moves(plan) == [(0, 4, 4, 0, True), (0, 3, 3, 4, False)]


def test_permuted_nodes_and_gpus_need_no_moves() -> None:
    # 2 nodes x 2 GPUs x 2 slots. New = old with the nodes swapped and the GPUs of one node swapped.
    old = _placement([[0, 1, 2, 3, 4, 5, 6, 7]], 8, 4, num_nodes=2)
    new = _placement([[6, 7, 4, 5, 0, 1, 2, 3]], 8, 4, num_nodes=2)
    assert plan_moves(old, new).num_moves == 0
    assert plan_moves(old, new, relabel=False).num_moves == 8
    # Swapping two GPUs across nodes is not a relabeling that keeps node contents: moves remain.
    crossed = _placement([[4, 5, 2, 3, 0, 1, 6, 7]], 8, 4, num_nodes=2)
    assert plan_moves(old, crossed).num_moves == 4


def test_remote_source_prefers_same_node_then_kept_slot() -> None:
    # 4 GPUs (1 slot each) on 2 nodes: {0, 1}, {2, 3}. Expert 0 lives on GPUs 0 and 2; GPU 3 wants it.
    old = _placement([[0, 1, 0, 2]], 3, 4, num_nodes=2)
    new = _placement([[0, 1, 2, 0]], 3, 4, num_nodes=2)
    moves = _moves(plan_moves(old, new, relabel=False))
    # GPU 2's copy is overwritten (it takes expert 2 from GPU 3), yet it is on GPU 3's node: chosen.
    assert (0, 0, 2, 3, True) in moves

    # Single node: now the kept copy on GPU 0 wins over the overwritten one on GPU 2.
    old_flat = _placement([[0, 1, 0, 2]], 3, 4)
    new_flat = _placement([[0, 1, 2, 0]], 3, 4)
    assert (0, 0, 0, 3, True) in _moves(plan_moves(old_flat, new_flat, relabel=False))


def test_mismatched_placements_are_rejected() -> None:
    old = round_robin_placement(2, 4, 8, 2)
    with pytest.raises(ValueError, match="num_physical_experts"):
        plan_moves(old, round_robin_placement(2, 4, 4, 2))
    with pytest.raises(ValueError, match="num_layers"):
        plan_moves(old, round_robin_placement(1, 4, 8, 2))
    with pytest.raises(ValueError, match="num_gpus"):
        plan_moves(old, round_robin_placement(2, 4, 8, 4))


@st.composite
def placement_pairs(draw):
    num_nodes = draw(st.integers(1, 2))
    num_gpus = num_nodes * draw(st.integers(1, 3))
    slots_per_gpu = draw(st.integers(1, 4))
    num_slots = num_gpus * slots_per_gpu
    num_experts = draw(st.integers(1, num_slots))
    num_layers = draw(st.integers(1, 2))

    def rows():
        out = []
        for _ in range(num_layers):
            extra = draw(
                st.lists(
                    st.integers(0, num_experts - 1),
                    min_size=num_slots - num_experts,
                    max_size=num_slots - num_experts,
                )
            )
            out.append(draw(st.permutations(list(range(num_experts)) + extra)))
        return out

    old = _placement(rows(), num_experts, num_gpus, num_nodes)
    new = _placement(rows(), num_experts, num_gpus, num_nodes)
    return old, new


def _per_gpu_counts(placement: ExpertPlacement, layer: int) -> np.ndarray:
    rows = placement.physical_to_logical[layer].reshape(placement.num_gpus, -1)
    return np.stack([np.bincount(r, minlength=placement.num_logical_experts) for r in rows])


def _node_blocks(placement: ExpertPlacement, layer: int) -> list[list[list[int]]]:
    gpus = [sorted(g) for g in placement.physical_to_logical[layer].reshape(placement.num_gpus, -1).tolist()]
    per_node = placement.num_gpus // placement.num_nodes
    return [gpus[i : i + per_node] for i in range(0, placement.num_gpus, per_node)]


@SETTINGS
@given(placement_pairs(), st.booleans())
def test_plan_executes_to_the_target_with_the_fewest_moves(pair, relabel: bool) -> None:
    old, new = pair
    plan = plan_moves(old, new, relabel=relabel)
    target = plan.placement
    assert plan.num_moves <= plan_moves(old, new, relabel=False).num_moves
    for layer in range(old.num_layers):
        # Target = new up to renumbered nodes, GPUs inside nodes and slots inside GPUs.
        got, want = _node_blocks(target, layer), _node_blocks(new, layer)
        if relabel:
            assert sorted(sorted(node) for node in got) == sorted(sorted(node) for node in want)
        else:
            assert got == want
    slots_per_gpu = old.slots_per_gpu
    gpu = old.gpu_of_slot()
    node = gpu // (old.num_gpus // old.num_nodes)
    expected_writes = expected_remote = 0
    for layer in range(old.num_layers):
        old_counts, new_counts = _per_gpu_counts(old, layer), _per_gpu_counts(target, layer)
        expected_writes += np.maximum(new_counts - old_counts, 0).sum()
        expected_remote += ((old_counts == 0) & (new_counts > 0)).sum()

        # Simulate: stage 1 (remote) reads old contents, stage 2 (local) reads current contents.
        mine = plan.layer_ids == layer
        old_row = old.physical_to_logical[layer]
        contents = old_row.copy()
        written = plan.dst_slots[mine]
        assert len(set(written.tolist())) == len(written)
        for expert, src, dst, remote in zip(
            plan.logical_ids[mine], plan.src_slots[mine], plan.dst_slots[mine], plan.is_remote[mine]
        ):
            if remote:
                assert gpu[src] != gpu[dst] and old_row[src] == expert
                holders = gpu[old_row == expert]
                if (node[holders * slots_per_gpu] == node[dst]).any():
                    assert node[src] == node[dst]
            else:
                assert (
                    gpu[src] == gpu[dst]
                    and contents[src] == expert
                    and src not in set(plan.dst_slots[mine & ~plan.is_remote].tolist())
                )
            contents[dst] = expert
        np.testing.assert_array_equal(contents, target.physical_to_logical[layer])
        untouched = np.setdiff1d(np.arange(old.num_physical_experts), written)
        np.testing.assert_array_equal(old_row[untouched], target.physical_to_logical[layer][untouched])

    assert plan.num_moves == expected_writes
    assert plan.num_remote == expected_remote
    assert not plan.is_remote[plan.num_remote :].any()  # remote moves come first


@SETTINGS
@given(placement_pairs())
def test_no_within_gpu_ordering_of_the_target_writes_fewer_slots(pair) -> None:
    old, new = pair
    plan = plan_moves(old, new, relabel=False)
    best = 0
    for layer in range(old.num_layers):
        old_gpus = old.physical_to_logical[layer].reshape(old.num_gpus, -1)
        new_gpus = new.physical_to_logical[layer].reshape(old.num_gpus, -1)
        for old_slots, new_slots in zip(old_gpus, new_gpus):
            best += min(int((np.array(order) != old_slots).sum()) for order in set(itertools.permutations(new_slots)))
    assert plan.num_moves == best


def test_plan_arrays_are_read_only() -> None:
    plan = plan_moves(round_robin_placement(1, 4, 8, 2), _placement([[0, 0, 1, 2, 3, 3, 1, 2]], 4, 2))
    for array in (plan.layer_ids, plan.logical_ids, plan.src_slots, plan.dst_slots, plan.is_remote):
        with pytest.raises(ValueError):
            array[...] = 0
