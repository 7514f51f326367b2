"""`ExpertPlacement`, the frozen result type, and the placement functions that return it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._inputs import check_layout, positive_int
from ._rebalance import (
    Policy,
    logical_to_physical,
    placement_arrays,
    resolve_policy,
    validate_request,
)


def _frozen_int_array(value: Any, name: str, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.ndim != ndim or 0 in array.shape:
        raise ValueError(f"{name} must be a non-empty {ndim}-dim array, got shape {list(array.shape)}")
    array = np.array(array, dtype=np.int64)
    array.setflags(write=False)
    return array


def slot_gpu_loads(phy2log: np.ndarray, logcnt: np.ndarray, loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """phy2log [L, R], logcnt [L, E] int64, loads [L, E] float64 -> GPU loads [L, num_gpus] float64."""
    per_replica = loads / logcnt
    slot_loads = np.take_along_axis(per_replica, phy2log, axis=1)
    return slot_loads.reshape(phy2log.shape[0], num_gpus, -1).sum(axis=2)


def replica_ranks(phy2log: np.ndarray, num_logical: int) -> tuple[np.ndarray, np.ndarray]:
    """[L, R] slot experts -> (replica rank of each slot in slot order [L, R], counts [L, E]), int64."""
    num_layers, num_physical = phy2log.shape
    flat = phy2log + (np.arange(num_layers) * num_logical)[:, None]
    logcnt = np.bincount(flat.ravel(), minlength=num_layers * num_logical).reshape(num_layers, num_logical)
    order = np.argsort(phy2log, axis=1, kind="stable")
    first_slot = np.cumsum(logcnt, axis=1) - logcnt
    sorted_experts = np.take_along_axis(phy2log, order, axis=1)
    rank_sorted = np.arange(num_physical) - np.take_along_axis(first_slot, sorted_experts, axis=1)
    rank = np.empty_like(phy2log)
    np.put_along_axis(rank, order, rank_sorted, axis=1)
    return rank, logcnt


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Where every physical expert slot lives and which logical expert it holds, for a stack of layers.

    Slots are GPU-major: slot s is on GPU `s // slots_per_gpu`, GPU g on node `g // gpus_per_node`.
    The arrays are read-only int64 copies; construction checks that they agree with each other.
    """

    physical_to_logical: np.ndarray  # [num_layers, num_physical_experts] int64, logical id per slot
    logical_to_physical: np.ndarray  # [num_layers, num_logical_experts, max_replicas] int64; -1 = none
    logical_replica_counts: np.ndarray  # [num_layers, num_logical_experts] int64, >= 1
    num_gpus: int
    num_nodes: int = 1

    def __post_init__(self) -> None:
        num_gpus = positive_int(self.num_gpus, "num_gpus")
        num_nodes = positive_int(self.num_nodes, "num_nodes")
        phy2log = _frozen_int_array(self.physical_to_logical, "physical_to_logical", 2)
        log2phy = _frozen_int_array(self.logical_to_physical, "logical_to_physical", 3)
        logcnt = _frozen_int_array(self.logical_replica_counts, "logical_replica_counts", 2)
        for name, value in (
            ("physical_to_logical", phy2log),
            ("logical_to_physical", log2phy),
            ("logical_replica_counts", logcnt),
            ("num_gpus", num_gpus),
            ("num_nodes", num_nodes),
        ):
            object.__setattr__(self, name, value)
        num_layers, num_physical = phy2log.shape
        num_logical = logcnt.shape[1]
        if logcnt.shape[0] != num_layers or log2phy.shape[:2] != (num_layers, num_logical):
            raise ValueError(
                f"shapes disagree: physical_to_logical {list(phy2log.shape)}, logical_to_physical "
                f"{list(log2phy.shape)}, logical_replica_counts {list(logcnt.shape)}"
            )
        check_layout(num_logical, num_physical, num_gpus, num_nodes, "num_physical_experts")
        self._check_consistent(phy2log, log2phy, logcnt)

    @staticmethod
    def _check_consistent(phy2log: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray) -> None:
        num_layers, num_physical = phy2log.shape
        num_logical = logcnt.shape[1]
        if phy2log.min() < 0 or phy2log.max() >= num_logical:
            raise ValueError(f"physical_to_logical entries must lie in [0, {num_logical})")
        _, counted = replica_ranks(phy2log, num_logical)
        if not np.array_equal(counted, logcnt):
            raise ValueError(
                "logical_replica_counts must count the slots of each expert in physical_to_logical"
            )
        if logcnt.min() < 1:
            raise ValueError("logical_replica_counts must be >= 1: every logical expert needs a slot")
        if log2phy.shape[2] != logcnt.max():
            raise ValueError(f"logical_to_physical must have {logcnt.max()} (max replicas) columns")
        valid = np.arange(log2phy.shape[2]) < logcnt[:, :, None]
        if (log2phy[~valid] != -1).any():
            raise ValueError("logical_to_physical must be -1 past each expert's replica count")
        slots = log2phy[valid].reshape(num_layers, num_physical)  # each layer has exactly R valid
        if not (np.sort(slots, axis=1) == np.arange(num_physical)).all():
            raise ValueError("logical_to_physical must list every slot exactly once per layer")
        experts = np.broadcast_to(np.arange(num_logical)[None, :, None], log2phy.shape)[valid]
        layers = np.broadcast_to(np.arange(num_layers)[:, None, None], log2phy.shape)[valid]
        if not np.array_equal(phy2log[layers, log2phy[valid]], experts):
            raise ValueError("logical_to_physical and physical_to_logical must map to each other")

    @classmethod
    def from_physical_to_logical(
        cls, physical_to_logical: Any, num_logical_experts: int, num_gpus: int, num_nodes: int = 1
    ) -> ExpertPlacement:
        """Build a placement from slot contents alone; replica r of an expert is its r-th slot.

        Args:
            physical_to_logical: [num_layers, num_physical_experts] int, every expert at least once.
        Raises:
            ValueError: naming the bad field.
        """
        phy2log = _frozen_int_array(physical_to_logical, "physical_to_logical", 2)
        num_logical = positive_int(num_logical_experts, "num_logical_experts")
        if phy2log.min() < 0 or phy2log.max() >= num_logical:
            raise ValueError(f"physical_to_logical entries must lie in [0, {num_logical})")
        rank, logcnt = replica_ranks(phy2log, num_logical)
        if logcnt.min() < 1:
            missing = np.argwhere(logcnt == 0)[0]
            raise ValueError(f"physical_to_logical has no slot for expert {missing[1]} in layer {missing[0]}")
        return cls(phy2log, logical_to_physical(phy2log, rank, logcnt), logcnt, num_gpus, num_nodes)

    @property
    def num_layers(self) -> int:
        return int(self.physical_to_logical.shape[0])

    @property
    def num_logical_experts(self) -> int:
        return int(self.logical_replica_counts.shape[1])

    @property
    def num_physical_experts(self) -> int:
        return int(self.physical_to_logical.shape[1])

    @property
    def slots_per_gpu(self) -> int:
        return self.num_physical_experts // self.num_gpus

    def gpu_of_slot(self) -> np.ndarray:
        """[num_physical_experts] int64: the GPU of every slot."""
        return np.arange(self.num_physical_experts) // self.slots_per_gpu

    def as_tuple(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(phy2log, log2phy, logcnt), the return convention of `rebalance_experts` (read-only)."""
        return self.physical_to_logical, self.logical_to_physical, self.logical_replica_counts


def _round_robin_arrays(num_layers: int, num_logical: int, num_physical: int) -> np.ndarray:
    return np.broadcast_to(np.arange(num_physical) % num_logical, (num_layers, num_physical)).copy()


def round_robin_placement(
    num_layers: int, num_logical_experts: int, num_physical_experts: int, num_gpus: int, num_nodes: int = 1
) -> ExpertPlacement:
    """The load-blind placement: slot s holds expert `s % num_logical_experts` in every layer.

    Without redundancy this is the contiguous layout (GPU g holds experts g*k .. g*k+k-1); extra
    slots repeat experts 0, 1, ... on the last GPUs.

    Raises:
        ValueError: a count < 1, num_physical_experts < num_logical_experts or not a multiple of
            num_gpus, num_gpus not a multiple of num_nodes.
    """
    num_layers = positive_int(num_layers, "num_layers")
    num_logical = positive_int(num_logical_experts, "num_logical_experts")
    num_physical = positive_int(num_physical_experts, "num_physical_experts")
    num_gpus = positive_int(num_gpus, "num_gpus")
    num_nodes = positive_int(num_nodes, "num_nodes")
    check_layout(num_logical, num_physical, num_gpus, num_nodes, "num_physical_experts")
    phy2log = _round_robin_arrays(num_layers, num_logical, num_physical)
    return ExpertPlacement.from_physical_to_logical(phy2log, num_logical, num_gpus, num_nodes)


def place_experts(
    loads: Any,
    num_physical_experts: int,
    *,
    num_gpus: int,
    num_nodes: int = 1,
    num_expert_groups: int = 1,
    policy: Policy = "auto",
) -> ExpertPlacement:
    """Load-aware placement: DeepSeek's EPLB, never worse than round-robin.

    Runs the chosen policy (see `rebalance_experts`; "auto" = hierarchical when expert groups divide
    evenly over nodes). The greedy packing is a heuristic and can lose to the load-blind layout on a
    few inputs; for any layer where `round_robin_placement` has a lighter busiest GPU on `loads`,
    that layer uses round-robin instead. So max / mean GPU load is never above round-robin's.

    Args:
        loads: [num_layers, num_logical_experts] finite loads >= 0 (numpy, torch or sequence).
        num_physical_experts: slots per layer; a multiple of num_gpus, >= num_logical_experts.
        num_gpus: GPUs in the expert-parallel group; a multiple of num_nodes.
        num_nodes: nodes (fast-interconnect domains).
        num_expert_groups: expert groups of the model (group-limited routing); divides the expert
            count when the hierarchical policy runs (the global one ignores groups).
        policy: "auto", "hierarchical" (needs num_expert_groups % num_nodes == 0) or "global".
    Returns:
        The placement, num_gpus and num_nodes recorded in it.
    Raises:
        ValueError: naming the bad field, as `rebalance_experts`, plus an unknown `policy` or
            "hierarchical" with groups not divisible by nodes.
    """
    array, num_physical, num_groups, num_nodes, num_gpus = validate_request(
        loads, num_physical_experts, num_expert_groups, num_nodes, num_gpus, "num_physical_experts", policy
    )
    resolved = resolve_policy(policy, num_groups, num_nodes)
    phy2log, rank, logcnt = placement_arrays(array, num_physical, num_groups, num_nodes, num_gpus, resolved)

    num_layers, num_logical = array.shape
    baseline = _round_robin_arrays(num_layers, num_logical, num_physical)
    baseline_rank, baseline_cnt = replica_ranks(baseline, num_logical)
    greedy_peak = slot_gpu_loads(phy2log, logcnt, array, num_gpus).max(axis=1)
    baseline_peak = slot_gpu_loads(baseline, baseline_cnt, array, num_gpus).max(axis=1)
    use_baseline = baseline_peak < greedy_peak
    if use_baseline.any():
        phy2log = np.where(use_baseline[:, None], baseline, phy2log)
        rank = np.where(use_baseline[:, None], baseline_rank, rank)
        logcnt = np.where(use_baseline[:, None], baseline_cnt, logcnt)
    return ExpertPlacement(phy2log, logical_to_physical(phy2log, rank, logcnt), logcnt, num_gpus, num_nodes)
