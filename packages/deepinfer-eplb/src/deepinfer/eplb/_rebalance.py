"""DeepSeek's EPLB placement (`rebalance_experts`), written from its published description.

Hierarchical policy (expert groups divide evenly over nodes):
  1. pack expert groups onto nodes, balancing the summed group load, same group count per node;
  2. inside each node, replicate the hottest experts into the node's share of slots;
  3. pack each node's replicas onto its GPUs (load of a replica = expert load / replica count).
Global policy: the same routine with one group and one node (replicate over all slots, pack onto all
GPUs). Arithmetic is float64 (DeepSeek's reference uses float32, so exact near-ties may resolve
differently); every tie is broken towards the lower index, deterministically.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from ._inputs import check_layout, load_array, positive_int
from ._packing import balanced_packing, inverse_permutation, replicate_experts

Policy = Literal["auto", "hierarchical", "global"]
_POLICIES = ("auto", "hierarchical", "global")


def resolve_policy(policy: str, num_groups: int, num_nodes: int) -> Literal["hierarchical", "global"]:
    """ "auto" -> hierarchical when num_groups % num_nodes == 0, else global.

    Raises:
        ValueError: unknown `policy`, or "hierarchical" with num_groups not a multiple of num_nodes.
    """
    if policy not in _POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {_POLICIES}")
    if policy == "global":
        return "global"
    divisible = num_groups % num_nodes == 0
    if policy == "hierarchical" and not divisible:
        raise ValueError(
            f"num_groups={num_groups} must be a multiple of num_nodes={num_nodes} for the "
            "hierarchical policy (use policy='global' or 'auto')"
        )
    return "hierarchical" if divisible else "global"


def _hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_logical // num_nodes
    slots_per_node = num_physical // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_physical // num_gpus

    # 1. Groups onto nodes. "Middle" ids number the experts node-major: all of node 0's groups (in
    # the order the node received them), then node 1's, ...; a group's experts stay contiguous.
    group_loads = weight.reshape(num_layers, num_groups, group_size).sum(axis=2)
    group_node, group_rank = balanced_packing(group_loads, num_nodes)
    group_position = group_node * groups_per_node + group_rank
    logical_to_middle = (group_position[:, :, None] * group_size + np.arange(group_size)).reshape(
        num_layers, num_logical
    )
    middle_to_logical = inverse_permutation(logical_to_middle)

    # 2. Replicate inside every node; rows are (layer, node) pairs from here on.
    middle_loads = np.take_along_axis(weight, middle_to_logical, axis=1).reshape(-1, experts_per_node)
    replica_to_middle, replica_rank, middle_counts = replicate_experts(middle_loads, slots_per_node)

    # 3. Replicas onto the node's GPUs; a replica's slot in the node is gpu * slots_per_gpu + rank.
    replica_loads = np.take_along_axis(middle_loads / middle_counts, replica_to_middle, axis=1)
    gpu_in_node, rank_on_gpu = balanced_packing(replica_loads, gpus_per_node)
    slot_to_replica = inverse_permutation(gpu_in_node * slots_per_gpu + rank_on_gpu)

    # 4. Back to global slot order and logical ids.
    slot_middle = np.take_along_axis(replica_to_middle, slot_to_replica, axis=1).reshape(
        num_layers, num_nodes, slots_per_node
    )
    slot_middle = slot_middle + (np.arange(num_nodes) * experts_per_node)[None, :, None]
    phy2log = np.take_along_axis(middle_to_logical, slot_middle.reshape(num_layers, num_physical), axis=1)
    rank = np.take_along_axis(replica_rank, slot_to_replica, axis=1).reshape(num_layers, num_physical)
    logcnt = np.take_along_axis(middle_counts.reshape(num_layers, num_logical), logical_to_middle, axis=1)
    return phy2log, rank, logcnt


def placement_arrays(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int, policy: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validated float64 loads [L, E] -> (phy2log [L, R], replica_rank [L, R], logcnt [L, E]), int64."""
    if policy == "hierarchical":
        return _hierarchical(weight, num_physical, num_groups, num_nodes, num_gpus)
    return _hierarchical(weight, num_physical, 1, 1, num_gpus)


def logical_to_physical(phy2log: np.ndarray, replica_rank: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """[L, R] slot experts and replica ranks, [L, E] counts -> log2phy [L, E, max count] int64, -1 padded."""
    num_layers, num_physical = phy2log.shape
    log2phy = np.full((num_layers, logcnt.shape[1], int(logcnt.max())), -1, dtype=np.int64)
    layers = np.broadcast_to(np.arange(num_layers)[:, None], phy2log.shape)
    log2phy[layers, phy2log, replica_rank] = np.arange(num_physical)
    return log2phy


def validate_request(
    weight: Any, num_replicas: Any, num_groups: Any, num_nodes: Any, num_gpus: Any, replicas_name: str,
    policy: str = "auto",
) -> tuple[np.ndarray, int, int, int, int]:
    """Checked (loads float64 [L, E], num_replicas, num_groups, num_nodes, num_gpus).

    The groups must divide the expert count only when the hierarchical policy runs: the global
    policy ignores groups (as DeepSeek's does), so any num_groups >= 1 is accepted there.
    """
    loads = load_array(weight, "weight", ndim=2)
    num_replicas = positive_int(num_replicas, replicas_name)
    num_groups = positive_int(num_groups, "num_groups")
    num_nodes = positive_int(num_nodes, "num_nodes")
    num_gpus = positive_int(num_gpus, "num_gpus")
    num_logical = loads.shape[1]
    if resolve_policy(policy, num_groups, num_nodes) == "hierarchical" and num_logical % num_groups != 0:
        raise ValueError(f"num_groups={num_groups} must divide the number of logical experts ({num_logical})")
    check_layout(num_logical, num_replicas, num_gpus, num_nodes, replicas_name)
    return loads, num_replicas, num_groups, num_nodes, num_gpus


def rebalance_experts(
    weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Place `num_replicas` physical experts per layer on `num_gpus` GPUs (DeepSeek EPLB semantics).

    Hierarchical policy when `num_groups % num_nodes == 0`, global policy otherwise (which ignores
    the groups, so then num_groups need not divide the expert count). Slots are
    GPU-major: slot s lives on GPU `s // (num_replicas // num_gpus)`, GPU g on node
    `g // (num_gpus // num_nodes)`.

    Args:
        weight: [num_layers, num_logical_experts] load per expert (numpy array, torch tensor on any
            device, or nested sequence; int or float), finite and >= 0.
        num_replicas: physical experts per layer; a multiple of num_gpus, >= num_logical_experts.
        num_groups: expert groups; divides num_logical_experts when num_groups % num_nodes == 0.
        num_nodes: nodes (fast-interconnect domains); divides num_gpus.
        num_gpus: GPUs in the expert-parallel group.
    Returns:
        (phy2log, log2phy, logcnt), int64 numpy arrays:
        phy2log [num_layers, num_replicas]: logical expert held by each slot;
        log2phy [num_layers, num_logical_experts, max(logcnt)]: slots of each expert, replica r at
        position r, -1 = no such replica;
        logcnt [num_layers, num_logical_experts]: replicas per expert, >= 1, rows sum to num_replicas.
    Raises:
        ValueError: naming the bad field (weight shape, dtype or values; a count < 1; num_replicas
            not a multiple of num_gpus or < num_logical_experts; num_groups a multiple of num_nodes
            but not dividing the expert count; num_gpus not a multiple of num_nodes).
    """
    loads, num_replicas, num_groups, num_nodes, num_gpus = validate_request(
        weight, num_replicas, num_groups, num_nodes, num_gpus, "num_replicas"
    )
    policy = resolve_policy("auto", num_groups, num_nodes)
    phy2log, rank, logcnt = placement_arrays(loads, num_replicas, num_groups, num_nodes, num_gpus, policy)
    return phy2log, logical_to_physical(phy2log, rank, logcnt), logcnt
