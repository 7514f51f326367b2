"""The prefix cache's host-memory tier (issue #32): cached KV blocks and state snapshots that the
device pools evict are copied into a bounded pool in host memory, under the same hashes, and come
back from there on a later hit instead of being prefilled again.

Bookkeeping only (no memory): two hashed pools (`deepinfer.cache.BlockManager`s over host block and
host snapshot ids) whose entries are all free and cached at rest, so the least recently used one is
overwritten first, exactly like the device snapshot pool. The device pools record their evictions
(`BlockManager.record_evictions`); at the end of each `schedule()` `spill` gives each evicted hash a
host entry and says which copies the engine makes before the step's forward (device → host), and a
hit's host entries are held for the step (`hold`) so that no spill of the same step overwrites what
the step loads from them.
"""

from __future__ import annotations

import numpy as np

from .pools import HashedBlockPool


class HostTier:
    """Host entries of KV blocks and snapshots, by hash.

    Args:
        blocks: a `BlockManager(num_host_blocks + 1)` (id 0 unused).
        snapshots: a `BlockManager(num_host_snapshots + 1)` (id 0 unused).
    """

    def __init__(self, blocks: HashedBlockPool, snapshots: HashedBlockPool) -> None:
        self.blocks = blocks
        self.snapshots = snapshots
        self.num_spilled_blocks = 0       # KV blocks copied to host memory so far
        self.num_loaded_blocks = 0        # KV blocks copied back for a hit so far
        self._held_blocks: list[int] = []
        self._held_snapshots: list[int] = []

    def hold(self, host_block_ids: np.ndarray, host_snapshot: int) -> None:
        """Keeps a hit's host entries (and its host snapshot, 0 = none) from being overwritten by
        this step's spills, and marks them most recently used."""
        ids = [int(b) for b in host_block_ids]
        self.blocks.reuse(np.array(ids, dtype=np.int32))
        self._held_blocks += ids
        self.num_loaded_blocks += len(ids)
        if host_snapshot:
            self.snapshots.reuse(np.array([host_snapshot], dtype=np.int32))
            self._held_snapshots.append(host_snapshot)

    def spill(self, evicted_blocks: list[tuple[int, bytes]],
              evicted_snapshots: list[tuple[int, bytes]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Host entries for what the device pools evicted this step, then releases the step's holds.

        Returns:
            ([(KV block, host block)], [(snapshot slot, host snapshot)]): the copies to make before
            the step's forward overwrites the evicted blocks and slots; a hash the host holds already
            is only marked recently used, and with every host entry held the eviction is dropped.
        """
        blocks = _place(self.blocks, evicted_blocks)
        snapshots = _place(self.snapshots, evicted_snapshots)
        self.num_spilled_blocks += len(blocks)
        if self._held_blocks:
            self.blocks.free(np.array(self._held_blocks, dtype=np.int32))
            self._held_blocks.clear()
        if self._held_snapshots:
            self.snapshots.free(np.array(self._held_snapshots, dtype=np.int32))
            self._held_snapshots.clear()
        return blocks, snapshots

    def reset(self) -> None:
        """Forgets every host entry and hold (their memory is reused as free)."""
        self.spill([], [])
        self.blocks.drop_hashes()
        self.snapshots.drop_hashes()


def _place(pool: HashedBlockPool, evicted: list[tuple[int, bytes]]) -> list[tuple[int, int]]:
    copies = []
    for device_id, block_hash in evicted:
        known = pool.cached_block(block_hash)
        if known:                             # the host has it already: most recently used now
            one = np.array([known], dtype=np.int32)
            pool.reuse(one)
            pool.free(one)
            continue
        if not pool.num_free:
            continue
        host_id = int(pool.allocate(1)[0])    # the least recently used host entry loses its hash
        pool.cache_block(host_id, block_hash)
        pool.free(np.array([host_id], dtype=np.int32))
        copies.append((device_id, host_id))
    return copies
