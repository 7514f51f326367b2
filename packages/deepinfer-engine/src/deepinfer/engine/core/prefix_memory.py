"""The memory of prefix caching beside the model's cache (docs/prefix_cache.md): the device pool of
state snapshots and the host tier's pools of KV blocks and snapshots, and the copies between them
and the model's cache that a scheduler step asks for (`SchedulerOutput`'s prefix-cache lists).

All copies are issued on the current stream, in the order the step lists them, so a copy out of a
block or snapshot slot always runs before whatever the step writes there; copies to and from the
pinned host pools are asynchronous (nothing reads a host pool on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deepinfer.model import ModelCache
from deepinfer.sched import SchedulerOutput

from ..device.staging import to_device
from .cache_copies import (
    SnapshotLayout,
    block_bytes,
    gather_blocks,
    restore_snapshots,
    rows_from_host,
    rows_to_host,
    save_snapshots,
    scatter_blocks,
)


@dataclass(frozen=True, slots=True)
class HostTierSize:
    """Entries of the host tier's two pools (0 and 0: no host tier)."""

    num_blocks: int
    num_snapshots: int


def host_tier_size(host_bytes: int, block_bytes: int, snapshot_bytes: int, num_kv_blocks: int,
                   num_snapshots: int) -> HostTierSize:
    """Splits `host_bytes` between KV blocks and snapshots as the device cache splits its bytes
    (num_kv_blocks blocks of block_bytes, num_snapshots of snapshot_bytes); at least one of each, or
    nothing when that does not fit. The pools' unused row 0 is paid for too."""
    device_snapshot_bytes = num_snapshots * snapshot_bytes
    share = device_snapshot_bytes / (device_snapshot_bytes + num_kv_blocks * block_bytes)
    usable = host_bytes - block_bytes - snapshot_bytes
    host_snapshots = max(1, int(usable * share) // snapshot_bytes)
    host_blocks = (usable - host_snapshots * snapshot_bytes) // block_bytes
    if host_blocks < 1:
        return HostTierSize(0, 0)
    return HostTierSize(host_blocks, host_snapshots)


class PrefixMemory:
    """The snapshot pool on the cache's device and, optionally, the host tier's pools.

    Args:
        cache: the model's cache.
        layout: what a snapshot keeps (`SnapshotLayout.for_spec`).
        num_snapshots: device snapshots (the scheduler's snapshot ids 1..n; row 0 unused).
        host: the host tier's entries (`HostTierSize(0, 0)`: none); on CUDA in pinned memory.
        device: the cache's device.
    """

    def __init__(self, cache: ModelCache, layout: SnapshotLayout, num_snapshots: int, host: HostTierSize,
                 device: torch.device) -> None:
        self.cache = cache
        self.layout = layout
        self.device = device
        self.snapshots = torch.zeros((num_snapshots + 1, layout.num_bytes), dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        self.host_blocks = self.host_snapshots = None
        if host.num_blocks:
            num_bytes = (host.num_blocks + 1) * block_bytes(cache) + (host.num_snapshots + 1) * layout.num_bytes
            try:
                self.host_blocks = torch.empty((host.num_blocks + 1, block_bytes(cache)), dtype=torch.uint8,
                                               pin_memory=pin)
                self.host_snapshots = torch.empty((host.num_snapshots + 1, layout.num_bytes), dtype=torch.uint8,
                                                  pin_memory=pin)
            except RuntimeError as error:       # out of (pinnable) host memory
                raise RuntimeError(f"cannot allocate the prefix cache's host tier ({num_bytes} B of "
                                   f"{'pinned ' if pin else ''}host memory): lower prefix_cache_host_mb "
                                   f"(0 = no host tier): {error}") from error

    @property
    def device_bytes(self) -> int:
        """Bytes of the device snapshot pool."""
        return self.snapshots.numel()

    @property
    def host_bytes(self) -> int:
        """Bytes of the host tier's pools (0 without one)."""
        if self.host_blocks is None or self.host_snapshots is None:
            return 0
        return self.host_blocks.numel() + self.host_snapshots.numel()

    def copy_out_and_in(self, out: SchedulerOutput) -> None:
        """The step's copies to host memory of what it evicted, then its loads of host blocks (first
        thing before the forward: the spilled blocks may be the very blocks loaded into)."""
        if len(out.spill_blocks):
            pairs = _ids(out.spill_blocks, self.device)
            rows_to_host(gather_blocks(self.cache, pairs[:, 0]), self._host(self.host_blocks), out.spill_blocks[:, 1])
        if len(out.spill_snapshots):
            pairs = _ids(out.spill_snapshots, self.device)
            rows_to_host(self.snapshots[pairs[:, 0]], self._host(self.host_snapshots), out.spill_snapshots[:, 1])
        if len(out.load_blocks):
            rows = rows_from_host(self._host(self.host_blocks), out.load_blocks[:, 0], self.device)
            scatter_blocks(self.cache, _ids(out.load_blocks, self.device)[:, 1], rows)

    def restore(self, out: SchedulerOutput) -> None:
        """Hits: the snapshots into the new sequences' state slots (after the step's zeroing)."""
        if len(out.restore_states):
            ids = _ids(out.restore_states, self.device)
            restore_snapshots(self.cache, self.layout, self.snapshots[ids[:, 0]], ids[:, 1], ids[:, 2])
        if len(out.restore_host_states):
            ids = _ids(out.restore_host_states, self.device)
            rows = rows_from_host(self._host(self.host_snapshots), out.restore_host_states[:, 0], self.device)
            restore_snapshots(self.cache, self.layout, rows, ids[:, 1], ids[:, 2])

    def save(self, save_states: Tensor) -> None:
        """[k, 3] int64 (state slot, snapshot id, position) on the device: snapshots of the state the
        step's forward left (after it)."""
        self.snapshots[save_states[:, 1]] = save_snapshots(self.cache, self.layout, save_states[:, 0],
                                                           save_states[:, 2])

    @staticmethod
    def _host(pool: Tensor | None) -> Tensor:
        assert pool is not None, "the scheduler lists host copies only with a host tier"
        return pool


def _ids(array: np.ndarray, device: torch.device) -> Tensor:
    return to_device(np.asarray(array, dtype=np.int64), device)
