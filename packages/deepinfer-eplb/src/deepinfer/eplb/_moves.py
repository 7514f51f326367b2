"""Move plan: which expert weights to copy so that the old placement becomes the new one.

What "fewest" means. A move writes one expert's weights into one physical slot. Three changes to
the new placement leave every GPU's load, and so the balance, as they are: renumbering nodes,
renumbering GPUs inside a node, and reordering slots inside a GPU. The plan uses all three:
  1. (relabel=True) nodes, then GPUs inside nodes, are renumbered to overlap the old placement
     by greedy maximum-overlap matching (`_relabel.py`): a heuristic, never worse than keeping the
     numbering. Without it, two placements computed from nearly equal loads can share few slots;
  2. slots inside each GPU are reordered to line up with the old ones. For the resulting GPU
     contents both counts below are the exact minimum, reached together:
  * a slot whose old expert is still wanted on its GPU keeps its weights (no move). The slots
    written number sum over (gpu, expert) of max(0, new_count - old_count), since a GPU can keep
    at most min(old_count, new_count) copies of an expert;
  * a GPU that needs an expert it did not hold receives it once from another GPU (remote move);
    every further copy on that GPU, and every extra copy of an expert the GPU already held, is a
    local copy. Remote moves number #{(gpu, expert): old_count == 0 < new_count}, since such a GPU
    must receive that expert at least once.
A remote move reads from a GPU of the same node when one holds the expert, then from a slot that
keeps its weights, then from the GPU that has sent least so far.

Executing a plan: stage 1 runs every remote move, reading slot contents of the OLD placement (run
it as one exchange that receives into staging buffers before overwriting, as an all-to-all does: a
source slot may itself be overwritten). Stage 2 runs the local moves; each reads a slot on the same
GPU that already holds its final content (kept, or written in stage 1) and is not written again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ._placement import ExpertPlacement
from ._relabel import relabel_row


@dataclass(frozen=True, slots=True)
class MovePlan:
    """Weight copies turning an old placement into `placement`; remote moves first, then local.

    Move i copies logical expert `logical_ids[i]` of placement row `layer_ids[i]` from `src_slots[i]`
    to `dst_slots[i]` (slot ids of that row). Arrays are read-only; see the module docstring for the
    two-stage execution order.
    """

    placement: ExpertPlacement  # the target, re-ordered inside each GPU so kept slots stay put
    layer_ids: np.ndarray  # [num_moves] int64, row of the placement
    logical_ids: np.ndarray  # [num_moves] int64
    src_slots: np.ndarray  # [num_moves] int64; remote: old contents, local: final contents
    dst_slots: np.ndarray  # [num_moves] int64, each (layer, slot) written at most once
    is_remote: np.ndarray  # [num_moves] bool, source on another GPU

    @property
    def num_moves(self) -> int:
        return int(self.dst_slots.shape[0])

    @property
    def num_remote(self) -> int:
        return int(self.is_remote.sum())

    @property
    def num_local(self) -> int:
        return self.num_moves - self.num_remote


def _check_compatible(old: ExpertPlacement, new: ExpertPlacement) -> None:
    for name in ("num_layers", "num_logical_experts", "num_physical_experts", "num_gpus", "num_nodes"):
        if getattr(old, name) != getattr(new, name):
            raise ValueError(f"new.{name}={getattr(new, name)} must equal old.{name}={getattr(old, name)}")


def _align_gpu(old_experts: list[int], new_experts: list[int]) -> tuple[list[int], list[bool]]:
    """Slot contents for one GPU: old experts that stay keep their slot, the rest fill the gaps."""
    wanted = Counter(new_experts)
    aligned: list[int] = []
    kept: list[bool] = []
    for expert in old_experts:
        keep = wanted[expert] > 0
        wanted[expert] -= keep
        aligned.append(expert if keep else -1)
        kept.append(keep)
    incoming: list[int] = []  # experts still wanted, in the new placement's slot order
    for expert in new_experts:
        if wanted[expert] > 0:
            wanted[expert] -= 1
            incoming.append(expert)
    fill = iter(incoming)
    return [e if keep else next(fill) for e, keep in zip(aligned, kept)], kept


def _plan_layer(
    old_row: list[int], new_row: list[int], slots_per_gpu: int, gpus_per_node: int, num_gpus: int
) -> tuple[list[int], list[tuple[int, int, int, bool]]]:
    aligned: list[int] = []
    kept: list[bool] = []
    for gpu in range(num_gpus):
        span = slice(gpu * slots_per_gpu, (gpu + 1) * slots_per_gpu)
        gpu_aligned, gpu_kept = _align_gpu(old_row[span], new_row[span])
        aligned += gpu_aligned
        kept += gpu_kept

    old_slots_of: dict[int, list[int]] = {}
    for slot, expert in enumerate(old_row):
        old_slots_of.setdefault(expert, []).append(slot)
    num_sent = [0] * num_gpus
    moves: list[tuple[int, int, int, bool]] = []  # (expert, src, dst, remote)
    for gpu in range(num_gpus):
        holder: dict[int, int] = {}  # expert -> a slot on this GPU holding it after stage 1
        first = gpu * slots_per_gpu
        for slot in range(first, first + slots_per_gpu):
            if kept[slot]:
                holder.setdefault(aligned[slot], slot)
        for slot in range(first, first + slots_per_gpu):
            if kept[slot]:
                continue
            expert = aligned[slot]
            if expert in holder:
                moves.append((expert, holder[expert], slot, False))
                continue
            node = gpu // gpus_per_node
            source = min(
                old_slots_of[expert],
                key=lambda s: (
                    s // slots_per_gpu // gpus_per_node != node,
                    not kept[s],
                    num_sent[s // slots_per_gpu],
                    s,
                ),
            )
            num_sent[source // slots_per_gpu] += 1
            holder[expert] = slot
            moves.append((expert, source, slot, True))
    return aligned, moves


def plan_moves(old: ExpertPlacement, new: ExpertPlacement, *, relabel: bool = True) -> MovePlan:
    """Fewest weight moves from `old` to `new` (see the module docstring for the exact meaning).

    Args:
        old: the placement the GPUs hold now.
        new: the placement to reach; same layers, experts, slots, GPUs and nodes as `old`.
        relabel: also renumber nodes and GPUs (inside nodes) of `new` to overlap `old`.
    Returns:
        A MovePlan whose `placement` equals `new` up to renumbered nodes and GPUs (when `relabel`)
        and reordered slots inside GPUs, so it has the same multiset of GPU loads and keeps every
        node's experts together; install that placement, not `new`.
    Raises:
        ValueError: naming the first shape field on which `old` and `new` differ.
    """
    _check_compatible(old, new)
    slots_per_gpu = old.slots_per_gpu
    gpus_per_node = old.num_gpus // old.num_nodes
    aligned_rows: list[list[int]] = []
    stages: tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int, int]]] = ([], [])
    target_rows = new.physical_to_logical
    if relabel:
        target_rows = np.stack(
            [
                relabel_row(old_row, new_row, old.num_logical_experts, old.num_gpus, old.num_nodes)
                for old_row, new_row in zip(old.physical_to_logical, new.physical_to_logical)
            ]
        )
    for layer in range(old.num_layers):
        aligned, moves = _plan_layer(
            old.physical_to_logical[layer].tolist(),
            target_rows[layer].tolist(),
            slots_per_gpu,
            gpus_per_node,
            old.num_gpus,
        )
        aligned_rows.append(aligned)
        for expert, src, dst, remote in moves:
            stages[0 if remote else 1].append((layer, expert, src, dst))
    table = np.array(stages[0] + stages[1], dtype=np.int64).reshape(-1, 4)
    is_remote = np.arange(table.shape[0]) < len(stages[0])
    arrays = [table[:, i].copy() for i in range(4)] + [is_remote]
    for array in arrays:
        array.setflags(write=False)
    placement = ExpertPlacement.from_physical_to_logical(
        np.array(aligned_rows, dtype=np.int64), old.num_logical_experts, old.num_gpus, old.num_nodes
    )
    return MovePlan(placement, *arrays)
