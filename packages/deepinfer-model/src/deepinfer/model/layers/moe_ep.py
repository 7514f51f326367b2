"""Expert parallelism (EP) for the routed experts of MoE layers, over torch.distributed.

Each rank of the EP group holds `slots_per_rank` physical expert slots per MoE layer (slot s lives on
rank s // slots_per_rank); a logical expert may have several slots (redundant copies, placed by EPLB).
One layer's forward on every rank:
  1. route locally (logical expert ids), count the tokens per logical expert on the device;
  2. pick a physical slot per (token, k) pair: replica `(pair index + rank) % copies` of the expert,
     deterministic and spread evenly over the copies;
  3. `all_to_all_single` the split sizes, then the slot ids and hidden rows (variable splits);
  4. run the local experts on the received rows (float, FP8 or MXFP4: the `Experts` module's kernels);
  5. `all_to_all_single` the results back and sum each token's top-k rows with its routing weights.
Step 3 reads the split sizes on the host (a device sync per layer). Decode steps
(`ForwardBatch.decode_step`) of a layer given `max_decode_tokens` instead exchange fixed-capacity
buffers with equal splits (`moe_ep_fixed`): static shapes and no host read, so the decode step can be
captured in a CUDA graph and launched under ZOS; both exchanges give the same output.
Every rank must run every layer's exchange once per forward, with or without tokens, and all of them
the same kind (a decode step everywhere, or a prefill step everywhere): a rank with no work calls
`run_ep_dummy_forward` with the step's kind so that the collectives of its peers match.
This module is one layer's exchange (`ExpertParallel`, `ExpertSlots`); `moe_ep_setup` applies it to
a model (`apply_expert_parallel`, `shard_experts`, `take_expert_counts`, `run_ep_dummy_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from deepinfer.kernels import KernelSet

from .moe_ep_fixed import LocalExperts, fixed_capacity_exchange


@dataclass(frozen=True, slots=True)
class ExpertSlots:
    """Which logical expert each physical slot of one MoE layer holds, over an EP group.

    Built from `physical_to_logical`; the inverse maps are derived. `logical_to_physical` has a fixed
    width (the most copies any expert can have: num_physical - num_logical + 1), so a new placement is
    copied into the same tensors in place (`copy_`).

    Raises:
        ValueError: a slot count not divisible by `ep_size`, an id outside [0, num_logical_experts),
            or a logical expert without a slot.
    """

    physical_to_logical: Tensor      # [num_physical] int64, logical expert of each slot
    num_logical_experts: int
    ep_size: int
    logical_replica_counts: Tensor = field(init=False)  # [num_logical] int64, >= 1
    logical_to_physical: Tensor = field(init=False)     # [num_logical, max copies] int64; -1 = none

    def __post_init__(self) -> None:
        phy2log = torch.as_tensor(self.physical_to_logical, dtype=torch.int64)
        num_physical, num_logical = phy2log.numel(), self.num_logical_experts
        if phy2log.ndim != 1 or num_physical < num_logical:
            raise ValueError(f"physical_to_logical must be 1-dim with >= {num_logical} slots, "
                             f"got shape {list(phy2log.shape)}")
        if self.ep_size < 1 or num_physical % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must be >= 1 and divide the {num_physical} slots")
        if int(phy2log.min()) < 0 or int(phy2log.max()) >= num_logical:
            raise ValueError(f"physical_to_logical entries must lie in [0, {num_logical})")
        counts = torch.bincount(phy2log, minlength=num_logical)
        if int(counts.min()) < 1:
            raise ValueError(f"logical expert {int(counts.argmin())} has no slot in physical_to_logical")
        log2phy = torch.full((num_logical, num_physical - num_logical + 1), -1, dtype=torch.int64)
        seen = torch.zeros(num_logical, dtype=torch.int64)
        for slot, expert in enumerate(phy2log.tolist()):
            log2phy[expert, seen[expert]] = slot
            seen[expert] += 1
        object.__setattr__(self, "physical_to_logical", phy2log)
        object.__setattr__(self, "logical_replica_counts", counts)
        object.__setattr__(self, "logical_to_physical", log2phy)

    @property
    def slots_per_rank(self) -> int:
        return self.physical_to_logical.numel() // self.ep_size

    def local_logical_ids(self, rank: int) -> Tensor:
        """[slots_per_rank] int64: the logical expert of each slot on `rank`."""
        per = self.slots_per_rank
        return self.physical_to_logical[rank * per:(rank + 1) * per]

    def to(self, device: torch.device) -> ExpertSlots:
        """The same placement with its tensors on `device`."""
        moved = ExpertSlots(self.physical_to_logical, self.num_logical_experts, self.ep_size)
        for name in ("physical_to_logical", "logical_replica_counts", "logical_to_physical"):
            object.__setattr__(moved, name, getattr(moved, name).to(device))
        return moved

    def copy_(self, other: ExpertSlots) -> None:
        """Take `other`'s placement in place (same slot and expert counts, same EP size)."""
        if (other.physical_to_logical.shape, other.num_logical_experts, other.ep_size) != \
                (self.physical_to_logical.shape, self.num_logical_experts, self.ep_size):
            raise ValueError("copy_ needs a placement with the same slots, experts and EP size")
        for name in ("physical_to_logical", "logical_replica_counts", "logical_to_physical"):
            getattr(self, name).copy_(getattr(other, name))


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """The EP state of one MoE layer (`MoE.ep`).

    Attributes:
        group: the EP process group (gloo on CPU, NCCL on GPUs); every member runs every layer.
        rank: this rank's index in `group`.
        slots: the layer's placement, on the layer's device (updated in place on a rebalance).
        expert_counts: [num_logical] int64 on the device: tokens this rank routed to each logical
            expert since the counts were last taken (`take_expert_counts`).
        max_decode_tokens: the most tokens this rank feeds one decode step (the same on every rank;
            the engine's `max_num_seqs`, its largest decode CUDA graph): decode steps then take the
            fixed-capacity exchange sized from it (`moe_ep_fixed`); None = variable splits always.
    """

    group: dist.ProcessGroup
    rank: int
    slots: ExpertSlots
    expert_counts: Tensor
    max_decode_tokens: int | None = None

    def run(self, x: Tensor, expert_ids: Tensor, weights: Tensor, experts: LocalExperts, limit: float,
            ops: KernelSet, *, decode_step: bool = False) -> Tensor:
        """x [num_tokens, hidden]; expert_ids [num_tokens, top_k] int64 logical ids; weights
        [num_tokens, top_k] float32 → [num_tokens, hidden] in x's dtype (num_tokens may be 0).
        `decode_step` with `max_decode_tokens` set: the fixed-capacity exchange (no host read; every
        rank of the group must pass the same `decode_step`)."""
        num_tokens, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        self.expert_counts.index_add_(0, flat, torch.ones_like(flat))
        slots = self.slots
        pair = torch.arange(flat.numel(), device=x.device)
        replica = (pair + self.rank) % slots.logical_replica_counts[flat]
        slot = slots.logical_to_physical[flat, replica]
        if decode_step and self.max_decode_tokens is not None:
            return fixed_capacity_exchange(x, slot, weights, experts, limit, ops, group=self.group,
                                           max_decode_tokens=self.max_decode_tokens,
                                           ep_size=slots.ep_size, slots_per_rank=slots.slots_per_rank)
        per_rank = slots.slots_per_rank
        order = torch.argsort(slot // per_rank, stable=True)
        send_counts = torch.bincount(slot // per_rank, minlength=slots.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        recv_slots = self._exchange((slot[order] % per_rank).contiguous(), recv_splits, send_splits)
        recv_x = self._exchange(x[order // top_k].contiguous(), recv_splits, send_splits)
        unit = torch.ones(recv_x.shape[0], 1, dtype=torch.float32, device=x.device)
        y = experts(recv_x, recv_slots[:, None], unit, limit, ops)
        back = self._exchange(y, send_splits, recv_splits)
        per_pair = torch.empty_like(back)
        per_pair[order] = back
        per_pair = per_pair.view(num_tokens, top_k, x.shape[1]) * weights.to(x.dtype)[..., None]
        return per_pair.sum(dim=1)

    def _exchange(self, rows: Tensor, recv_splits: list[int], send_splits: list[int]) -> Tensor:
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows, recv_splits, send_splits, group=self.group)
        return out
