"""`ExpertPlacement`: construction checks, immutability, round-robin layout."""

import dataclasses

import numpy as np
import pytest

from deepinfer.eplb import ExpertPlacement, rebalance_experts, round_robin_placement

PHY2LOG = np.array([[0, 2, 0, 1, 3, 1]])
LOG2PHY = np.array([[[0, 2], [3, 5], [1, -1], [4, -1]]])
LOGCNT = np.array([[2, 2, 1, 1]])


def test_accepts_rebalance_output_and_exposes_shape() -> None:
    placement = ExpertPlacement(*rebalance_experts([[4, 4, 2, 2]], 6, 1, 1, 2), num_gpus=2)
    assert (placement.num_layers, placement.num_logical_experts, placement.num_physical_experts) == (1, 4, 6)
    assert placement.slots_per_gpu == 3
    np.testing.assert_array_equal(placement.gpu_of_slot(), [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(placement.physical_to_logical, PHY2LOG)


def test_is_frozen_and_read_only_and_copies_input() -> None:
    source = PHY2LOG.copy()
    placement = ExpertPlacement(source, LOG2PHY, LOGCNT, num_gpus=2)
    source[0, 0] = 3
    assert placement.physical_to_logical[0, 0] == 0
    with pytest.raises(ValueError):
        placement.physical_to_logical[0, 0] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.num_gpus = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("phy2log", "log2phy", "logcnt", "match"),
    [
        ([[0, 2, 0, 1, 3, 4]], LOG2PHY, LOGCNT, r"entries must lie in \[0, 4\)"),
        ([[0, 2, 0, 1, 3, 3]], LOG2PHY, LOGCNT, "must count the slots"),
        (PHY2LOG, [[[0, 2], [3, 5], [1, -1], [4, 4]]], LOGCNT, "-1 past each expert's replica count"),
        (PHY2LOG, [[[0, 0], [3, 5], [1, -1], [4, -1]]], LOGCNT, "list every slot exactly once"),
        (PHY2LOG, [[[0, 2], [5, 3], [4, -1], [1, -1]]], LOGCNT, "map to each other"),
        (PHY2LOG, [[[0, 2, -1], [3, 5, -1], [1, -1, -1], [4, -1, -1]]], LOGCNT, "max replicas"),
        (PHY2LOG.astype(float), LOG2PHY, LOGCNT, "physical_to_logical must hold integers"),
        (PHY2LOG, LOG2PHY, [[2, 2, 1]], "shapes disagree"),
    ],
)
def test_inconsistent_arrays_are_rejected(phy2log, log2phy, logcnt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ExpertPlacement(phy2log, log2phy, logcnt, num_gpus=2)


def test_layout_rules_apply() -> None:
    with pytest.raises(ValueError, match="num_physical_experts=6 must be a multiple of num_gpus=4"):
        ExpertPlacement(PHY2LOG, LOG2PHY, LOGCNT, num_gpus=4)
    with pytest.raises(ValueError, match="num_gpus=2 must be a multiple of num_nodes=3"):
        ExpertPlacement(PHY2LOG, LOG2PHY, LOGCNT, num_gpus=2, num_nodes=3)


def test_from_physical_to_logical_numbers_replicas_in_slot_order() -> None:
    placement = ExpertPlacement.from_physical_to_logical([[1, 0, 1, 2, 1, 0]], 3, num_gpus=3)
    np.testing.assert_array_equal(placement.logical_replica_counts, [[2, 3, 1]])
    np.testing.assert_array_equal(placement.logical_to_physical, [[[1, 5, -1], [0, 2, 4], [3, -1, -1]]])
    with pytest.raises(ValueError, match="no slot for expert 2 in layer 0"):
        ExpertPlacement.from_physical_to_logical([[1, 0, 1, 0]], 3, num_gpus=2)


def test_round_robin_is_contiguous_then_repeats() -> None:
    placement = round_robin_placement(2, 4, 6, num_gpus=3)
    np.testing.assert_array_equal(placement.physical_to_logical, [[0, 1, 2, 3, 0, 1]] * 2)
    np.testing.assert_array_equal(placement.logical_replica_counts, [[2, 2, 1, 1]] * 2)
