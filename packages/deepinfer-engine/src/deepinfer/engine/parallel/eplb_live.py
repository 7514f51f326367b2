"""EPLB while serving: expert counts from the router, a windowed balancer, weight moves between ranks.

Every forward step (dummy ones included, so all ranks count the same steps) the counts the MoE layers
accumulated on the device are taken and copied to the host without waiting; the copy of the previous
step is read and recorded (one step late, as under ZOS). Every `rebalance_interval_steps` steps the
window's counts are summed over the EP group (each rank counted only its own tokens), so every rank
computes the same placement with `deepinfer.eplb`; when it beats the current one, the moved experts'
weights are sent rank to rank (`deepinfer.model.move_experts`) and swapped in before the next step.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from deepinfer.eplb import (
    DECODE_EPLB_CONFIG,
    PREFILL_EPLB_CONFIG,
    EplbConfig,
    ModelBalancer,
    Rebalance,
    num_redundant_experts,
    round_robin_placement,
)
from deepinfer.model import ExpertMoves, ExpertSlots, moe_layers, move_experts, take_expert_counts

from ..config.engine_args import EngineArgs
from ..core.stats import RebalanceStats

PRESETS = {"prefill": PREFILL_EPLB_CONFIG, "decode": DECODE_EPLB_CONFIG}


def eplb_config(args: EngineArgs, ep_size: int) -> EplbConfig:
    """The balancer settings of `args.eplb`'s preset with the engine's overrides; the redundancy floor
    is per rank (4 per rank at EP 8: at least 32 in all)."""
    if args.eplb is None:
        raise ValueError("eplb=None: EPLB is off, it has no balancer settings")
    preset = PRESETS[args.eplb]
    per_rank = args.eplb_redundant_experts_per_rank
    floor = preset.min_redundant_experts if per_rank is None else per_rank
    return EplbConfig(min_redundant_experts=floor * ep_size,
                      window_steps=args.eplb_window_steps or preset.window_steps,
                      rebalance_interval_steps=args.eplb_interval_steps or preset.rebalance_interval_steps,
                      policy=preset.policy, min_improvement=preset.min_improvement)


def initial_slots(num_layers: int, num_experts: int, ep_size: int, config: EplbConfig | None) -> list[ExpertSlots]:
    """The round-robin placement every rank starts from: `num_experts` plus the redundant slots of
    `config` (none without EPLB, beyond what makes the slots divide over the ranks)."""
    floor = 0 if config is None else config.min_redundant_experts
    num_physical = num_experts + num_redundant_experts(num_experts, ep_size, floor)
    placement = round_robin_placement(num_layers, num_experts, num_physical, ep_size)
    return [ExpertSlots(torch.from_numpy(row.copy()), num_experts, ep_size) for row in placement.physical_to_logical]


class LiveBalancer:
    """Records the EP model's expert counts every step and re-places experts every M steps.

    Args:
        model: a model after `apply_expert_parallel` with `initial_slots(..., config)`.
        config: the balancer settings (`eplb_config`).
        ep_size: ranks in the EP group.
        load_group: a gloo group over the EP ranks (the counts are summed over it on the host).
    """

    def __init__(self, model: nn.Module, config: EplbConfig, ep_size: int, load_group: dist.ProcessGroup | None):
        self._model = model
        self._layers = moe_layers(model)
        self._load_group = load_group
        num_experts = self._layers[0].cfg.n_routed_experts
        self._balancer = ModelBalancer(config, dict.fromkeys(range(len(self._layers)), num_experts),
                                       num_gpus=ep_size, reduce_loads=self._sum_over_ranks)
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._rebalances: list[RebalanceStats] = []

    @property
    def rebalances(self) -> tuple[RebalanceStats, ...]:
        """The re-placements adopted so far, oldest first."""
        return tuple(self._rebalances)

    def _sum_over_ranks(self, window: np.ndarray) -> np.ndarray:
        total = torch.from_numpy(np.ascontiguousarray(window, dtype=np.float64))
        dist.all_reduce(total, group=self._load_group)
        return total.numpy()

    def after_forward(self) -> None:
        """Call once per forward step on every rank (dummy forwards included)."""
        counts = take_expert_counts(self._model)
        event = None
        if counts.is_cuda:
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = counts
        previous, self._pending = self._pending, (host, event)
        if previous is None:
            return
        loads, done = previous
        if done is not None:
            done.synchronize()          # recorded a whole step ago: long finished
        rows = loads.numpy()
        for change in self._balancer.record({layer: rows[layer] for layer in range(len(self._layers))}):
            self._apply(change)

    def _apply(self, change: Rebalance) -> None:
        plan = change.moves
        layer_of_row = change.layer_ids
        moves = ExpertMoves(tuple(layer_of_row[row] for row in plan.layer_ids.tolist()),
                            tuple(plan.src_slots.tolist()), tuple(plan.dst_slots.tolist()),
                            tuple(bool(remote) for remote in plan.is_remote.tolist()))
        new_rows = dict(zip(layer_of_row, plan.placement.physical_to_logical))
        old = [moe.ep.slots for moe in self._layers if moe.ep is not None]   # every layer: apply_expert_parallel
        slots = [old[index] if index not in new_rows else
                 ExpertSlots(torch.from_numpy(new_rows[index].copy()), old[index].num_logical_experts,
                             old[index].ep_size)
                 for index in range(len(self._layers))]
        move_experts(self._layers, moves, slots)
        self._rebalances.append(RebalanceStats(change.step, tuple(layer_of_row), change.layer_balance_before,
                                              change.layer_balance_after, plan.num_moves, plan.num_remote))
