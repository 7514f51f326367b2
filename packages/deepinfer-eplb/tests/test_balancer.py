"""`ExpertBalancer` and `ModelBalancer`: windows, intervals, gating and homogeneous layer groups."""

import numpy as np
import pytest

from deepinfer.eplb import (
    EplbConfig,
    ExpertBalancer,
    ModelBalancer,
    balance_ratio,
    group_moe_layers,
    overall_balance,
    round_robin_placement,
)

CONFIG = EplbConfig(min_redundant_experts=2, window_steps=2, rebalance_interval_steps=4)


def _hot(expert: int, num_layers: int = 2, num_experts: int = 8) -> np.ndarray:
    loads = np.full((num_layers, num_experts), 10.0)
    loads[:, expert] = 200.0
    return loads


def test_rebalances_every_interval_from_the_window_only() -> None:
    balancer = ExpertBalancer(CONFIG, layer_ids=[3, 4], num_logical_experts=8, num_gpus=2)
    assert balancer.num_physical_experts == 10
    start = balancer.placement

    assert balancer.record(_hot(0)) is None
    assert balancer.record(_hot(0)) is None
    assert balancer.record(_hot(5)) is None  # the window now holds steps 2..3
    change = balancer.record(_hot(5))

    assert change is not None and change.step == 4 and change.layer_ids == (3, 4)
    assert balancer.placement is change.placement
    counts = change.placement.logical_replica_counts
    assert (counts[:, 5] == 3).all() and (counts[:, 0] == 1).all()
    window = 2 * _hot(5)
    np.testing.assert_array_equal(balancer.window_loads(), window)
    assert change.balance_before == pytest.approx(overall_balance(start, window))
    assert change.balance_after == pytest.approx(overall_balance(change.placement, window))
    assert change.balance_after < change.balance_before


def test_moves_turn_the_old_placement_into_the_new_one() -> None:
    balancer = ExpertBalancer(CONFIG, layer_ids=[0, 1], num_logical_experts=8, num_gpus=2)
    old = balancer.placement.physical_to_logical.copy()
    change = None
    for _ in range(4):
        change = balancer.record(_hot(6))
    assert change is not None
    contents = old.copy()
    moves = change.moves
    for layer, expert, src, dst, remote in zip(
        moves.layer_ids, moves.logical_ids, moves.src_slots, moves.dst_slots, moves.is_remote
    ):
        assert (old if remote else contents)[layer, src] == expert
        contents[layer, dst] = expert
    np.testing.assert_array_equal(contents, change.placement.physical_to_logical)


def test_no_change_when_nothing_improves() -> None:
    balancer = ExpertBalancer(CONFIG, layer_ids=[0], num_logical_experts=8, num_gpus=2)
    start = balancer.placement
    # Round-robin [0..7, 0, 1] puts 0.5+0.5+1+1+1 = 4 on each GPU: already perfect for uniform loads.
    assert all(balancer.record(np.ones((1, 8))) is None for _ in range(4))
    assert balancer.placement is start

    results = [balancer.record(_hot(2, num_layers=1)) for _ in range(8)]
    assert results[3] is not None
    assert results[7] is None  # the same loads again: the adopted placement is not beaten


def test_min_improvement_gates_small_gains() -> None:
    gated = EplbConfig(min_redundant_experts=2, window_steps=2, rebalance_interval_steps=4, min_improvement=10.0)
    balancer = ExpertBalancer(gated, layer_ids=[0, 1], num_logical_experts=8, num_gpus=2)
    start = balancer.placement
    assert all(balancer.record(_hot(5)) is None for _ in range(8))
    assert balancer.placement is start
    assert balancer.rebalance() is None


def test_rebalance_before_any_step_is_a_no_op() -> None:
    balancer = ExpertBalancer(CONFIG, layer_ids=[0], num_logical_experts=8, num_gpus=2)
    assert balancer.rebalance() is None


def test_startup_validation() -> None:
    hierarchical = EplbConfig(policy="hierarchical")
    with pytest.raises(ValueError, match="num_groups=3 must be a multiple of num_nodes=2"):
        ExpertBalancer(
            hierarchical, layer_ids=[0], num_logical_experts=12, num_gpus=4, num_nodes=2, num_expert_groups=3
        )
    with pytest.raises(ValueError, match="num_expert_groups=5 must divide num_logical_experts=12"):
        ExpertBalancer(CONFIG, layer_ids=[0], num_logical_experts=12, num_gpus=4, num_expert_groups=5)
    with pytest.raises(ValueError, match="num_gpus=4 must be a multiple of num_nodes=3"):
        ExpertBalancer(CONFIG, layer_ids=[0], num_logical_experts=12, num_gpus=4, num_nodes=3)
    with pytest.raises(ValueError, match="must be non-empty and distinct"):
        ExpertBalancer(CONFIG, layer_ids=[1, 1], num_logical_experts=12, num_gpus=4)
    with pytest.raises(ValueError, match="layer id -1"):
        ExpertBalancer(CONFIG, layer_ids=[-1], num_logical_experts=12, num_gpus=4)
    with pytest.raises(ValueError, match="initial_placement.num_physical_experts=12 must be 16"):
        ExpertBalancer(
            CONFIG,
            layer_ids=[0],
            num_logical_experts=12,
            num_gpus=4,
            initial_placement=round_robin_placement(1, 12, 12, 4),
        )
    with pytest.raises(ValueError, match="config must be an EplbConfig"):
        ExpertBalancer({"window_steps": 1}, layer_ids=[0], num_logical_experts=12, num_gpus=4)


def test_group_moe_layers_by_expert_count() -> None:
    groups = group_moe_layers({7: 8, 3: 16, 1: 8, 2: 8})
    assert [(g.num_logical_experts, g.layer_ids) for g in groups] == [(8, (1, 2, 7)), (16, (3,))]
    with pytest.raises(ValueError, match="at least one MoE layer"):
        group_moe_layers({})
    with pytest.raises(ValueError, match=r"num_experts_by_layer\[4\]=0"):
        group_moe_layers({4: 0})


def test_model_balancer_shares_one_balancer_per_group() -> None:
    model = ModelBalancer(CONFIG, {1: 8, 2: 8, 3: 4, 5: 8}, num_gpus=2, num_expert_groups={8: 2, 4: 1})
    assert len(model.balancers) == 2
    first, row_first = model.placement_of(1)
    last, row_last = model.placement_of(5)
    assert first is last and (row_first, row_last) == (0, 2)
    assert model.balancers[0].layer_ids == (1, 2, 5) and model.balancers[1].layer_ids == (3,)

    def step(hot: int) -> tuple:
        loads = {layer: _hot(hot, 1, 8)[0] for layer in (1, 2, 5)}
        loads[3] = [1.0, 1.0, 30.0, 1.0]
        return model.record(loads)

    assert [len(step(4)) for _ in range(3)] == [0, 0, 0]
    changes = step(4)
    assert [c.layer_ids for c in changes] == [(1, 2, 5), (3,)]
    placement, row = model.placement_of(3)
    assert placement.logical_replica_counts[row, 2] == 3


def test_model_balancer_rejects_incomplete_steps_without_recording() -> None:
    model = ModelBalancer(CONFIG, {1: 8, 3: 4}, num_gpus=2)
    with pytest.raises(ValueError, match=r"missing \[3\], unknown \[9\]"):
        model.record({1: np.ones(8), 9: np.ones(4)})
    with pytest.raises(ValueError, match=r"loads_by_layer\[3\] must have shape \[4\]"):
        model.record({1: np.ones(8), 3: np.ones(5)})
    assert [b.num_steps for b in model.balancers] == [0, 0]
    with pytest.raises(ValueError, match="no entry for layers with 4 experts"):
        ModelBalancer(CONFIG, {1: 8, 3: 4}, num_gpus=2, num_expert_groups={8: 2})
    with pytest.raises(ValueError, match="layer_id=2 is not one of the MoE layers"):
        model.placement_of(2)


def test_reduce_loads_decides_what_is_placed_and_layer_balances_are_reported() -> None:
    seen: list[np.ndarray] = []

    def everyone_sees_expert_5_hot(window: np.ndarray) -> np.ndarray:
        seen.append(window.copy())
        return _hot(5)

    balancer = ExpertBalancer(CONFIG, layer_ids=[3, 4], num_logical_experts=8, num_gpus=2,
                              reduce_loads=everyone_sees_expert_5_hot)
    for _ in range(4):
        change = balancer.record(_hot(0))
    np.testing.assert_array_equal(seen[0], 2 * _hot(0))             # the window, handed to the hook
    assert change is not None
    assert change.placement.logical_replica_counts[0, 5] > 1         # placed for the reduced loads
    start = round_robin_placement(2, 8, 10, 2)
    np.testing.assert_allclose(change.layer_balance_before, balance_ratio(start, _hot(5)))
    np.testing.assert_allclose(change.layer_balance_after, balance_ratio(change.placement, _hot(5)))
    assert max(change.layer_balance_after) < min(change.layer_balance_before)
    bad = ExpertBalancer(CONFIG, layer_ids=[0], num_logical_experts=8, num_gpus=2,
                         reduce_loads=lambda window: np.ones((2, 8)))
    assert bad.record(np.ones((1, 8))) is None                      # not a rebalance step
    with pytest.raises(ValueError, match=r"reduce_loads returned shape \[2, 8\], expected \[1, 8\]"):
        bad.rebalance()


def test_global_policy_accepts_any_group_count() -> None:
    balancer = ExpertBalancer(CONFIG, layer_ids=[0], num_logical_experts=12, num_gpus=4, num_nodes=2,
                              num_expert_groups=5)
    assert balancer.num_physical_experts == 16
