"""The two greedy building blocks of the placement algorithm, vectorised over rows (layers).

Each loop runs once per item or per extra slot; every iteration handles all rows at once, so the
cost is O(items) numpy calls regardless of the layer count.
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the items of each row into `num_packs` packs of equal item count, evening out weight.

    Greedy: items in order of decreasing weight (ties: lower item index first) each go to the
    lightest pack that is not yet full (ties: lower pack index). With one item per pack, item i
    goes to pack i.

    Args:
        weight: [num_rows, num_items] float64; num_items is a multiple of num_packs.
        num_packs: packs per row.
    Returns:
        (pack_ids, rank_in_pack), each [num_rows, num_items] int64: the pack of every item and its
        position inside that pack (0 for the first item the pack received).
    """
    num_rows, num_items = weight.shape
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:
        pack_ids = np.broadcast_to(np.arange(num_items, dtype=np.int64), weight.shape).copy()
        return pack_ids, np.zeros_like(pack_ids)

    order = np.argsort(-weight, axis=1, kind="stable")
    rows = np.arange(num_rows)
    pack_loads = np.zeros((num_rows, num_packs), dtype=np.float64)
    pack_sizes = np.zeros((num_rows, num_packs), dtype=np.int64)
    pack_ids = np.empty((num_rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((num_rows, num_items), dtype=np.int64)
    for position in range(num_items):
        items = order[:, position]
        open_loads = np.where(pack_sizes < items_per_pack, pack_loads, np.inf)
        packs = open_loads.argmin(axis=1)
        pack_ids[rows, items] = packs
        rank_in_pack[rows, items] = pack_sizes[rows, packs]
        pack_loads[rows, packs] += weight[rows, items]
        pack_sizes[rows, packs] += 1
    return pack_ids, rank_in_pack


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give each row's experts `num_physical` slots, replicating the hottest ones.

    Slot j < num_logical holds expert j; every further slot goes to the expert with the largest
    load per replica (`weight / count`, ties: lower expert index).

    Args:
        weight: [num_rows, num_logical] float64.
        num_physical: slots per row, >= num_logical.
    Returns:
        (slot_to_expert [num_rows, num_physical] int64, replica_rank [num_rows, num_physical] int64
        (0 for an expert's first slot, 1 for its second, ...), replica_counts [num_rows, num_logical]
        int64).
    """
    num_rows, num_logical = weight.shape
    rows = np.arange(num_rows)
    slot_to_expert = np.empty((num_rows, num_physical), dtype=np.int64)
    slot_to_expert[:, :num_logical] = np.arange(num_logical)
    replica_rank = np.zeros((num_rows, num_physical), dtype=np.int64)
    replica_counts = np.ones((num_rows, num_logical), dtype=np.int64)
    for slot in range(num_logical, num_physical):
        experts = (weight / replica_counts).argmax(axis=1)
        slot_to_expert[:, slot] = experts
        replica_rank[:, slot] = replica_counts[rows, experts]
        replica_counts[rows, experts] += 1
    return slot_to_expert, replica_rank, replica_counts


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """[num_rows, n] int64 permutations -> their inverses, same shape: inv[r, perm[r, i]] = i."""
    inverse = np.empty_like(perm)
    np.put_along_axis(inverse, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inverse
