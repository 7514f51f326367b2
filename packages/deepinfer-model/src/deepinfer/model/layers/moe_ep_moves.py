"""Moving expert weights between the ranks of an EP group when the placement changes (EPLB).

A move copies one expert's weights into one physical slot. Remote moves read the OLD contents of a
slot on another rank and travel in one `all_to_all_single` of byte rows (every stacked tensor of the
expert — w13, w2 and the quantised formats' scales — viewed as bytes and concatenated, so FP8 and
MXFP4 experts move as they are stored); local moves then copy, on the same rank, a slot that already
holds its final contents. The new weights are assembled beside the old ones and copied over them only
when all have arrived, so the parameters keep their storage (CUDA-graph addresses stay valid).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .moe import MoE
from .moe_ep import ExpertParallel, ExpertSlots


@dataclass(frozen=True, slots=True)
class ExpertMoves:
    """Weight copies turning the current placement into the next one (e.g. `deepinfer.eplb.MovePlan`).

    Move i writes slot `dst_slots[i]` of MoE layer `layer_indices[i]` (an index into `moe_layers`)
    from slot `src_slots[i]`; remote moves (source on another rank) read old contents, local ones the
    final contents of a slot on the same rank. Remote moves come first.
    """

    layer_indices: tuple[int, ...]
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    is_remote: tuple[bool, ...]


def _byte_row(moe: MoE, names: tuple[str, ...], row: int) -> Tensor:
    return torch.cat([getattr(moe.experts, name)[row].contiguous().reshape(-1).view(torch.uint8) for name in names])


def _unpack_into(targets: dict[str, Tensor], row: int, data: Tensor) -> None:
    offset = 0
    for target in targets.values():
        part = target[row]
        num_bytes = part.numel() * part.element_size()
        part.copy_(data[offset:offset + num_bytes].view(part.dtype).view(part.shape))
        offset += num_bytes


@torch.no_grad()
def move_experts(layers: Sequence[MoE], moves: ExpertMoves, new_slots: Sequence[ExpertSlots]) -> None:
    """Run `moves` on this rank and install `new_slots`; every rank of the EP group calls it with the
    same arguments (one collective when there is a remote move).

    Args:
        layers: the expert-parallel MoE layers (`moe_layers(model)`), all with `ep` set.
        moves: the copies to make.
        new_slots: the placement each layer holds afterwards, in `layers` order.

    Raises:
        ValueError: a layer without EP, or a new placement of another shape.
    """
    eps = [moe.ep for moe in layers if moe.ep is not None]
    if len(eps) != len(layers) or len(new_slots) != len(layers):
        raise ValueError("move_experts needs every layer expert-parallel and one new placement per layer")
    names = layers[0].experts.param_names
    staged = {index: {name: getattr(layers[index].experts, name).clone() for name in names}
              for index in sorted(set(moves.layer_indices))}
    remote = [(layer, src, dst) for layer, src, dst, far in
              zip(moves.layer_indices, moves.src_slots, moves.dst_slots, moves.is_remote) if far]
    if remote:
        _receive_remote(layers, names, remote, staged, eps[0])
    rank, per_rank = eps[0].rank, eps[0].slots.slots_per_rank
    for layer, src, dst, far in zip(moves.layer_indices, moves.src_slots, moves.dst_slots, moves.is_remote):
        if not far and dst // per_rank == rank:
            for tensor in staged[layer].values():
                tensor[dst % per_rank] = tensor[src % per_rank]
    for index, (moe, ep) in enumerate(zip(layers, eps)):
        for name, tensor in staged.get(index, {}).items():
            getattr(moe.experts, name).copy_(tensor)
        ep.slots.copy_(new_slots[index])


def _receive_remote(layers: Sequence[MoE], names: tuple[str, ...], remote: list[tuple[int, int, int]],
                    staged: dict[int, dict[str, Tensor]], ep: ExpertParallel) -> None:
    """The remote moves' old slot contents, sent and received in one `all_to_all_single` of byte rows
    and unpacked into `staged`."""
    rank, size, per_rank = ep.rank, ep.slots.ep_size, ep.slots.slots_per_rank
    send_by_rank: list[list[Tensor]] = [[] for _ in range(size)]
    recv_by_rank: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    for layer, src, dst in remote:
        if src // per_rank == rank:
            send_by_rank[dst // per_rank].append(_byte_row(layers[layer], names, src % per_rank))
        if dst // per_rank == rank:
            recv_by_rank[src // per_rank].append((layer, dst % per_rank))
    row_bytes = _byte_row(layers[0], names, 0).numel()
    device = ep.expert_counts.device
    rows = [row for per_dst in send_by_rank for row in per_dst]
    send = torch.stack(rows) if rows else torch.empty(0, row_bytes, dtype=torch.uint8, device=device)
    recv_splits = [len(items) for items in recv_by_rank]
    recv = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, recv_splits, [len(items) for items in send_by_rank], group=ep.group)
    targets = [item for items in recv_by_rank for item in items]
    for (layer, local_slot), data in zip(targets, recv):
        _unpack_into(staged[layer], local_slot, data)
