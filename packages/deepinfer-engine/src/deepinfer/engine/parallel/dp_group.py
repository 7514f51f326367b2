"""The DP step-kind vote over a gloo CPU process group (docs/design.md §3.1).

`deepinfer.sched.Scheduler` votes through any `deepinfer.sched.StepVoteGroup`; this one runs the
MIN all-reduce with torch.distributed on CPU tensors over gloo, so the vote never synchronises
the GPU (ZOS) even when the default process group is NCCL.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["GlooStepVoteGroup"]


class GlooStepVoteGroup:
    """A `deepinfer.sched.StepVoteGroup` over a gloo process group.

    Args:
        group: a gloo process group this rank belongs to; None = the default group, which must
            then use gloo (use `new_group` to get a gloo group beside an NCCL default group).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the group's backend is not gloo, or this rank is not a member.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised (init_process_group) first")
        if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this rank is not a member of the given process group")
        backend = dist.get_backend(group)
        if backend != dist.Backend.GLOO:
            raise ValueError(f"the vote group's backend is {backend!r}; it must be 'gloo' (CPU, no GPU sync)")
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @classmethod
    def new_group(cls, ranks: Sequence[int] | None = None, timeout_s: float = 60.0) -> GlooStepVoteGroup | None:
        """Creates a gloo group over `ranks` (None = all ranks) of the default process group.

        Every rank of the default group must call it (torch.distributed.new_group's rule).

        Args:
            ranks: global ranks of the DP group; None = every rank.
            timeout_s: collective timeout in seconds, > 0: a rank that stops voting makes the
                others raise instead of hanging.

        Returns:
            The vote group, or None on a rank outside `ranks`.

        Raises:
            RuntimeError: torch.distributed is not initialised.
            ValueError: timeout_s <= 0.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised (init_process_group) first")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        group = dist.new_group(ranks=None if ranks is None else list(ranks), backend="gloo",
                               timeout=timedelta(seconds=timeout_s))
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            return None
        return cls(group)

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._world_size

    @property
    def rank(self) -> int:
        """This rank's index in the group, in [0, world_size)."""
        return self._rank

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The gloo process group the vote runs over (None = the default group)."""
        return self._group

    def any_true(self, flag: bool) -> bool:
        """Whether `flag` is True on some rank; blocks until all ranks call (one MIN all-reduce)."""
        return self.all_reduce_min([0 if flag else 1])[0] == 0

    def all_reduce_min(self, values: Sequence[int]) -> tuple[int, ...]:
        """Element-wise minimum of `values` (int64) over the group; blocks until all ranks call.

        Returns:
            len(values) ints.

        Raises:
            RuntimeError: a peer did not join within the group's timeout.
        """
        tensor = torch.tensor([int(value) for value in values], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._group)
        return tuple(tensor.tolist())
