"""Relabel the nodes and GPUs of a new placement to overlap the old one as much as possible.

Which node or GPU gets which set of experts does not change any GPU's load: the placement
algorithm's node and GPU numbering is arbitrary. Two placements computed from almost the same
loads can still differ in that numbering, and then almost every slot would move. Matching
numbering first (nodes as whole blocks, then GPUs inside each matched node pair, so expert groups
that live on one node still do) keeps most weights where they are.

The matching is greedy on the overlap (experts two GPUs or nodes have in common, counted with
multiplicity): highest overlap first, ties to keeping the label, then to lower ids. It is a
heuristic; it falls back to the identity whenever that overlaps as much or more, so relabeling
never adds a move.
"""

from __future__ import annotations

import numpy as np


def _greedy_matching(overlap: np.ndarray) -> np.ndarray:
    """[n, n] int overlap (old label x new label) -> new label for each old label, int64 [n]."""
    size = overlap.shape[0]
    identity = np.arange(size)
    rows, cols = np.divmod(np.arange(size * size), size)
    order = np.lexsort((cols, rows, rows != cols, -overlap.ravel()))
    match = np.full(size, -1, dtype=np.int64)
    taken = np.zeros(size, dtype=bool)
    num_matched = 0
    for row, col in zip(rows[order].tolist(), cols[order].tolist()):
        if match[row] < 0 and not taken[col]:
            match[row] = col
            taken[col] = True
            num_matched += 1
            if num_matched == size:
                break
    if overlap[identity, match].sum() <= overlap[identity, identity].sum():
        return identity
    return match


def _overlap(old_counts: np.ndarray, new_counts: np.ndarray) -> np.ndarray:
    """[n, E] and [n, E] expert counts -> [n, n] sum over experts of min(old_i, new_j)."""
    return np.minimum(old_counts[:, None, :], new_counts[None, :, :]).sum(axis=2)


def relabel_row(
    old_row: np.ndarray, new_row: np.ndarray, num_logical: int, num_gpus: int, num_nodes: int
) -> np.ndarray:
    """[R] slot experts of one layer -> `new_row` with GPU blocks permuted to overlap `old_row`.

    Old GPU g receives the slots of new GPU `source[g]`; nodes move as whole blocks.
    """
    gpus_per_node = num_gpus // num_nodes
    old_gpu = old_row.reshape(num_gpus, -1)
    new_gpu = new_row.reshape(num_gpus, -1)
    old_counts = np.stack([np.bincount(slots, minlength=num_logical) for slots in old_gpu])
    new_counts = np.stack([np.bincount(slots, minlength=num_logical) for slots in new_gpu])
    node_match = _greedy_matching(
        _overlap(
            old_counts.reshape(num_nodes, gpus_per_node, -1).sum(axis=1),
            new_counts.reshape(num_nodes, gpus_per_node, -1).sum(axis=1),
        )
    )
    source = np.empty(num_gpus, dtype=np.int64)
    for old_node, new_node in enumerate(node_match.tolist()):
        old_span = slice(old_node * gpus_per_node, (old_node + 1) * gpus_per_node)
        new_span = slice(new_node * gpus_per_node, (new_node + 1) * gpus_per_node)
        gpu_match = _greedy_matching(_overlap(old_counts[old_span], new_counts[new_span]))
        source[old_span] = new_node * gpus_per_node + gpu_match
    gpu_overlap = np.minimum(old_counts, new_counts[source]).sum()
    if gpu_overlap <= np.minimum(old_counts, new_counts).sum():
        return new_row.copy()  # node matching went by node totals; never end up below the identity
    return new_gpu[source].reshape(-1)
