"""Expert parallelism over a whole model: find its MoE layers (`moe_layers`), shard their routed
experts over an EP group and attach each layer's exchange (`apply_expert_parallel`, or
`shard_experts` before loading), take the routing counts (`take_expert_counts`) and run the
collectives of a forward with no tokens (`run_ep_dummy_forward`). The exchange itself, one layer's
`ExpertParallel`, is in `moe_ep`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from deepinfer.kernels import KernelSet

from .moe import Experts, MoE
from .moe_ep import ExpertParallel, ExpertSlots


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
            moe.experts = Experts(moe.cfg, moe.experts.expert_dtype, num_experts=len(ids),
                                  mxfp4_packed=moe.experts.mxfp4_packed)
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
            local = Experts(moe.cfg, full.expert_dtype, num_experts=layer_slots.slots_per_rank,
                            mxfp4_packed=full.mxfp4_packed).to(device)
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
