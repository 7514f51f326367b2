"""Speculative steps of lockstep ranks: DP attention + EP MoE (docs/design.md §7.2, §9).

Every rank of an expert-parallel group runs each decode step's MoE exchanges together, so under
speculative decoding they run verify forwards of one size: after the step-kind vote each rank
offers the graph key of its own total query tokens (0 when it has no decode row) and all take the
largest (`graph_size`: one MIN all-reduce of the negated keys over the vote's gloo group, no GPU
sync). A rank with rows pads its verify forward to that size; a rank without runs a dummy verify
forward of it (`SpeculativeDecoder.idle_verify`). The varlen policy's start-up curves are the mean
over the group (`mean_curve`), and a curve is loaded from the profile cache only if every rank found
it (`all_true`), since a measurement runs collectives that every rank must join.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.sched import StepVoteGroup
from deepinfer.spec import StepTimeCurve, cuda_graph_key


@dataclass(frozen=True, slots=True)
class SpecLockstep:
    """The lockstep group of a DP + EP rank.

    Attributes:
        vote: the step-kind vote's group (gloo, CPU; every rank of the EP group).
        ep_group: the expert-parallel process group (NCCL on CUDA, gloo on the CPU).
        device: where `mean_curve`'s all-reduce tensor lives (the rank's device).
        interval: `DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL`: graph keys as `cuda_graph_key`'s.
    """

    vote: StepVoteGroup
    ep_group: dist.ProcessGroup
    device: torch.device
    interval: int

    def graph_size(self, total_q: int) -> int:
        """The step's verify size: the largest `cuda_graph_key` of the ranks' total query tokens
        (`total_q` 0 = this rank has no decode row; 0 back when no rank has). Every rank calls it
        once per decode step."""
        own = cuda_graph_key(total_q, self.interval) if total_q > 0 else 0
        (negated,) = self.vote.all_reduce_min([-own])
        return -negated

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` is True on every rank."""
        (smallest,) = self.vote.all_reduce_min([1 if flag else 0])
        return smallest == 1

    def mean_curve(self, curve: StepTimeCurve) -> StepTimeCurve:
        """`curve` (the same sizes on every rank) averaged over the EP group.

        Raises:
            ValueError: the ranks measured different sizes.
        """
        count = len(curve.sizes)
        fewest, most = self.vote.all_reduce_min([count, -count])
        sizes = list(curve.sizes)
        if fewest != -most or self.vote.all_reduce_min(sizes + [-s for s in sizes]) != (*sizes, *(-s for s in sizes)):
            raise ValueError(f"the ranks measured different sizes (this one: {curve.sizes})")
        ms = torch.tensor(curve.ms, dtype=torch.float64, device=self.device)
        dist.all_reduce(ms, op=dist.ReduceOp.SUM, group=self.ep_group)
        world = dist.get_world_size(self.ep_group)
        return StepTimeCurve(curve.sizes, tuple(float(v) / world for v in ms.cpu().tolist()))
