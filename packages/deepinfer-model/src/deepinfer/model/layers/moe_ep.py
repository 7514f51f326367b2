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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from deepinfer.kernels import KernelSet

from .moe import Experts, MoE
from .moe_ep_fixed import fixed_capacity_exchange


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

    def run(self, x: Tensor, expert_ids: Tensor, weights: Tensor, experts: Experts, limit: float,
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
            return fixed_capacity_exchange(self, x, slot, weights, experts, limit, ops)
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


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers in forward order (module registration order)."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def shard_experts(model: nn.Module, local_experts: Sequence[Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Give every MoE layer of a model that holds no data yet (built on the meta device) only the
    expert slots of one EP rank, so that loading reads and allocates those experts alone.

    Args:
        model: a model on the meta device (`build_model` calls this before allocating).
        local_experts: per MoE layer, in `moe_layers(model)` order, the logical expert of each of
            this rank's slots (`ExpertSlots.local_logical_ids(rank)`; an expert may fill several).

    Returns:
        {the experts module's name (e.g. "layers.3.ffn.experts"): its slots' logical experts}, what
        the load plan needs to send each stored expert to its slots.

    Raises:
        ValueError: a layer count that does not match the model, an empty layer, or an expert id
            outside [0, n_routed_experts).
    """
    layers = moe_layers(model)
    if len(local_experts) != len(layers):
        raise ValueError(f"local_experts has {len(local_experts)} layers; the model has {len(layers)} MoE layers")
    names = {id(module): name for name, module in model.named_modules()}
    shards: dict[str, tuple[int, ...]] = {}
    for index, (moe, ids) in enumerate(zip(layers, local_experts)):
        ids = tuple(int(e) for e in ids)
        num = moe.cfg.n_routed_experts
        if not ids or min(ids) < 0 or max(ids) >= num:
            raise ValueError(f"local_experts[{index}] must be a non-empty list of expert ids in [0, {num}), "
                             f"got {list(ids)[:8]}")
        shards[names[id(moe.experts)]] = ids
        with torch.device("meta"):
            moe.experts = Experts(moe.cfg, moe.experts.expert_dtype, num_experts=len(ids))
    return shards


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup, slots: Sequence[ExpertSlots],
                          loaded_sharded: bool = False, max_decode_tokens: int | None = None) -> None:
    """Shard the routed experts of every MoE layer over the EP group, and attach the exchange.

    Each rank keeps the rows of its slots (a logical expert's weights copied into each of its
    slots); shared experts, attention and everything else stay whole on every rank.

    Args:
        model: a loaded model; every rank of `group` calls this with the same `slots`.
        group: the EP process group; its size must equal every `slots[i].ep_size`.
        slots: one placement per MoE layer, in `moe_layers(model)` order.
        loaded_sharded: the model was loaded with this rank's slots only (`load_model(...,
            local_experts=...)` with `slots[i].local_logical_ids(rank)`): nothing is copied, the
            exchange is attached to the experts as loaded.
        max_decode_tokens: the most tokens one rank feeds a decode step (the same on every rank):
            decode steps (`ForwardBatch.decode_step`) then exchange fixed-capacity buffers, with no
            host read (`moe_ep_fixed`); None = every step uses variable splits.

    Raises:
        ValueError: a placement count, EP size or expert count that does not match the model, or
            max_decode_tokens < 1.
    """
    layers = moe_layers(model)
    if len(slots) != len(layers):
        raise ValueError(f"slots has {len(slots)} placements for {len(layers)} MoE layers")
    if max_decode_tokens is not None and max_decode_tokens < 1:
        raise ValueError(f"max_decode_tokens={max_decode_tokens} must be >= 1 (or None)")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for index, (moe, layer_slots) in enumerate(zip(layers, slots)):
        if layer_slots.ep_size != size or layer_slots.num_logical_experts != moe.cfg.n_routed_experts:
            raise ValueError(f"slots[{index}]: ep_size={layer_slots.ep_size}, num_logical_experts="
                             f"{layer_slots.num_logical_experts}; the group has {size} ranks and the layer "
                             f"{moe.cfg.n_routed_experts} experts")
        full = moe.experts
        device = full.w13.device
        if loaded_sharded:
            if full.w13.shape[0] != layer_slots.slots_per_rank:
                raise ValueError(f"layer {index}: loaded with {full.w13.shape[0]} expert slots, the placement "
                                 f"gives each rank {layer_slots.slots_per_rank}")
        else:
            local_ids = layer_slots.local_logical_ids(rank).to(device)
            local = Experts(moe.cfg, full.expert_dtype, num_experts=layer_slots.slots_per_rank).to(device)
            with torch.no_grad():
                for name in full.param_names:
                    getattr(local, name).data = getattr(full, name).index_select(0, local_ids)
            moe.experts = local
        counts = torch.zeros(moe.cfg.n_routed_experts, dtype=torch.int64, device=device)
        moe.ep = ExpertParallel(group, rank, layer_slots.to(device), counts, max_decode_tokens)


def take_expert_counts(model: nn.Module) -> Tensor:
    """[num_moe_layers, num_logical_experts] int64 on the device: tokens routed per expert since the
    last call, summed over this rank's forwards; the device counters restart at zero. No host sync."""
    layers = [moe.ep for moe in moe_layers(model) if moe.ep is not None]
    if not layers:
        raise ValueError("the model has no expert-parallel MoE layer (apply_expert_parallel first)")
    counts = torch.stack([ep.expert_counts for ep in layers])
    for ep in layers:
        ep.expert_counts.zero_()
    return counts


@torch.no_grad()
def run_ep_dummy_forward(model: nn.Module, ops: KernelSet, *, decode_step: bool = False) -> None:
    """The EP exchanges of one forward with no tokens, for a rank with nothing to run while its peers
    run a step: each MoE layer sends no token but still takes part in every collective. `decode_step`
    must match the peers' step (True while they decode: the fixed-capacity exchange, which sends its
    buffers of zeros; False while they prefill: variable splits of nothing)."""
    for moe in moe_layers(model):
        if moe.ep is None:
            continue
        x = torch.empty(0, moe.cfg.hidden_size, dtype=moe.gate.weight.dtype, device=moe.ep.expert_counts.device)
        top_k = moe.cfg.num_experts_per_tok
        ids = torch.empty(0, top_k, dtype=torch.int64, device=x.device)
        moe.ep.run(x, ids, torch.empty(0, top_k, device=x.device), moe.experts, moe.cfg.swiglu_limit, ops,
                   decode_step=decode_step)
