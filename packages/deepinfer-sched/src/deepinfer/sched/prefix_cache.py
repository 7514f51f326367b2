"""Prefix caching (issue #32): a new sequence takes the KV blocks and the model state of the longest
cached prefix of its tokens and prefills only the rest.

What is cached, and at which grain:
- KV blocks: every full block a prefill chunk computes gets the hash of its tokens chained over all
  earlier tokens (`deepinfer.cache.chain_hashes`, salted with `SchedulerConfig.prefix_cache_key`).
  A block keeps its hash while free, until the KV pool hands it out again (LRU among free blocks).
- State snapshots: resuming at token t needs, besides the KV of tokens < t, the per-sequence state
  the model leaves after token t − 1 (sliding-window rings, the compressors' open windows, Engram's
  look-back, draft rings). A prompt's prefill is cut at its snapshot points, and after the chunk
  ending at one the sequence's whole state slot is copied into a snapshot slot named by the hash of
  the block that ends there. The points: the prompt's last block boundary (the next turn of a chat
  resends the whole prompt), and where the prompt leaves the cached blocks when that is past its hit
  (another prompt shares that prefix — a system prompt — but no snapshot was saved there: the next
  one sharing it will hit). A recompute after preemption has none (the cache is full then).
- A hit is the longest chain of cached blocks whose last block has a snapshot, at most
  (num_tokens − 1) // block_size blocks (the last token is always computed: its logits are
  sampled): the blocks are taken by reference and the snapshot is copied into the sequence's new
  state slot instead of zeroing it.

Registrations are deferred to the end of the step's admission, so no sequence of a step hits what
another sequence of the same step is computing (its KV and state exist only after the forward).

With a host tier (host_tier.py) a hit's blocks and snapshot may also come from host memory: such
blocks are allocated anew, loaded before the forward and cached again at once (their content is in
place before anything reads it), and the snapshot is restored from host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer.cache import chain_hashes, root_hash

from .host_tier import HostTier
from .pools import HashedBlockPool
from .sequence import Hit, Sequence

__all__ = ["PrefixCacheStats"]


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Prefix-cache counters of one scheduler since it was built.

    Attributes:
        queries: prompt tokens looked up (every admission from the waiting queue: first
            scheduling and recompute after preemption).
        hits: of those, tokens served from the cache.
        num_cached_blocks: KV blocks holding a hash now (in use or free).
        num_snapshots: state snapshots held now.
        host_hits: of `hits`, tokens whose KV blocks came back from host memory.
        num_host_spills: KV blocks copied to host memory so far.
        num_host_blocks: KV blocks held in host memory now.
        num_host_snapshots: state snapshots held in host memory now.
    """

    queries: int = 0
    hits: int = 0
    num_cached_blocks: int = 0
    num_snapshots: int = 0
    host_hits: int = 0
    num_host_spills: int = 0
    num_host_blocks: int = 0
    num_host_snapshots: int = 0


class PrefixCache:
    """The hash index over the KV pool and the snapshot pool, with the step's pending registrations.

    Args:
        block_size: tokens per KV block (the matching grain).
        kv_blocks: the scheduler's KV `BlockManager` (blocks carry the hashes).
        snapshots: a `BlockManager` over snapshot slots (`BlockManager(num_snapshots + 1)`; slot 0
            unused); every snapshot is free and cached at rest, so LRU eviction needs nothing else.
        key: bytes folded into the root hash (model, KV dtype, ...).
        host: the host-memory tier, or None.
    """

    def __init__(self, block_size: int, kv_blocks: HashedBlockPool, snapshots: HashedBlockPool,
                 key: bytes, host: HostTier | None = None) -> None:
        missing = [attr for attr in ("cache_block", "match", "reuse", "cached_block", "drop_hashes")
                   if not hasattr(snapshots, attr)]
        if missing:
            raise ValueError(f"snapshot_slots must be a deepinfer.cache.BlockManager; it lacks {missing}")
        self.block_size = block_size
        self.kv = kv_blocks
        self.snapshots = snapshots
        self.root = root_hash(key)
        self.host = host
        if host is not None:
            kv_blocks.record_evictions()
            snapshots.record_evictions()
        self.queries = 0
        self.hits = 0
        self.host_hits = 0
        self._pending_blocks: list[tuple[int, bytes]] = []
        self._pending_snapshots: list[tuple[int, bytes]] = []

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of `seq`'s first num_blocks full blocks (memoised on the sequence: its
        token list only grows)."""
        known = seq.block_hashes
        if len(known) < num_blocks:
            parent = known[-1] if known else self.root
            known.extend(chain_hashes(seq.token_ids, self.block_size, parent, len(known), num_blocks - len(known)))
        return known[:num_blocks]

    def plan(self, seq: Sequence) -> tuple[Hit | None, tuple[int, ...]]:
        """For a sequence about to be admitted (nothing changes): its hit — the longest cached prefix
        ending at a snapshot, at most (num_tokens − 1) // block_size blocks (the last token is always
        computed: its logits are sampled), None without one or with `use_prefix_cache` off — and its
        snapshot points past the hit, ascending."""
        size = self.block_size
        hashes = self.hashes(seq, (seq.num_tokens - 1) // size)
        num_shared = self._num_shared(hashes)
        count = num_shared if seq.use_prefix_cache else 0
        while count and not self._snapshot_of(hashes[count - 1]):
            count -= 1
        hit = self._hit(hashes[:count]) if count else None
        if seq.num_tokens != seq.num_prompt_tokens:          # a recompute
            return hit, ()
        points = {seq.num_tokens // size * size}
        if num_shared and not any(h == hashes[num_shared - 1] for _, h in self._pending_snapshots):
            points.add(num_shared * size)                     # (not when this step saves it already)
        return hit, tuple(sorted(p for p in points if p > count * size))

    def _num_shared(self, hashes: list[bytes]) -> int:
        """Leading blocks of the chain cached on the device or in host memory."""
        count = self.kv.match(hashes)
        if self.host is not None:
            while count < len(hashes) and (self.kv.cached_block(hashes[count])
                                           or self.host.blocks.cached_block(hashes[count])):
                count += 1
        return count

    def _snapshot_of(self, block_hash: bytes) -> bool:
        return bool(self.snapshots.cached_block(block_hash)
                    or (self.host is not None and self.host.snapshots.cached_block(block_hash)))

    def _hit(self, hashes: list[bytes]) -> Hit:
        count = len(hashes)
        block_ids = np.fromiter((self.kv.cached_block(h) for h in hashes), dtype=np.int32, count=count)
        num_free = sum(self.kv.ref_count(int(b)) == 0 for b in block_ids if b)
        snapshot = self.snapshots.cached_block(hashes[-1])
        host = self.host
        if host is None:
            return Hit(count * self.block_size, block_ids, snapshot, num_free)
        host_ids = np.fromiter((0 if b else host.blocks.cached_block(h) for b, h in zip(block_ids, hashes)),
                               dtype=np.int32, count=count)
        host_snapshot = 0 if snapshot else host.snapshots.cached_block(hashes[-1])
        return Hit(count * self.block_size, block_ids, snapshot, num_free, host_ids, host_snapshot)

    def take(self, seq: Sequence, hit: Hit) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Takes a hit's blocks by reference and marks its snapshot most recently used; blocks in
        host memory get new KV blocks, cached again at once.

        Returns:
            ([num_tokens // block_size] int32 the hit's KV blocks, [(host block, KV block)] to load
            before the forward).
        """
        on_device = hit.block_ids != 0
        self.kv.reuse(hit.block_ids[on_device])
        if hit.snapshot:
            one = np.array([hit.snapshot], dtype=np.int32)
            self.snapshots.reuse(one)
            self.snapshots.free(one)
        if on_device.all() and hit.snapshot:
            return hit.block_ids, []
        assert self.host is not None and hit.host_block_ids is not None, "a host entry needs the host tier"
        block_ids = hit.block_ids.copy()
        missing = np.flatnonzero(~on_device)
        new_ids = self.kv.allocate(len(missing))
        hashes = seq.block_hashes
        for index, block in zip(missing.tolist(), new_ids.tolist()):
            self.kv.cache_block(block, hashes[index])
            block_ids[index] = block
        host_ids = hit.host_block_ids[missing]
        self.host.hold(host_ids, hit.host_snapshot)
        self.host_hits += len(missing) * self.block_size
        return block_ids, list(zip(host_ids.tolist(), new_ids.tolist()))

    def computed(self, seq: Sequence, block_ids: np.ndarray, start: int, end: int) -> int:
        """Queues the hashes of the blocks a chunk [start, end) completes, and a snapshot where it ends
        at one of the sequence's snapshot points. Returns the snapshot slot to save the state into, or
        0 for none."""
        size = self.block_size
        first, last = start // size, end // size          # full blocks [first, last) are complete now
        if last <= first:
            return 0
        hashes = self.hashes(seq, last)
        self._pending_blocks.extend((int(block_ids[i]), hashes[i]) for i in range(first, last))
        if end not in seq.snapshot_points or self.snapshots.cached_block(hashes[last - 1]) \
                or not self.snapshots.num_free:
            return 0
        if any(h == hashes[last - 1] for _, h in self._pending_snapshots):
            return 0
        snapshot = int(self.snapshots.allocate(1)[0])     # the least recently used one loses its hash
        self._pending_snapshots.append((snapshot, hashes[last - 1]))
        return snapshot

    def commit(self) -> None:
        """Publishes the step's queued hashes (called once the step's admission is done). A snapshot
        slot stays held until here, so nothing in the step can hand it out twice."""
        for block, block_hash in self._pending_blocks:   # held: nothing frees a block during admission
            self.kv.cache_block(block, block_hash)
        for snapshot, block_hash in self._pending_snapshots:
            self.snapshots.cache_block(snapshot, block_hash)
            self.snapshots.free(np.array([snapshot], dtype=np.int32))
        self._pending_blocks.clear()
        self._pending_snapshots.clear()

    def spill(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """With a host tier, at the end of a step: the copies to host memory of what the device pools
        evicted this step (`HostTier.spill`); else nothing."""
        if self.host is None:
            return [], []
        return self.host.spill(self.kv.take_evictions(), self.snapshots.take_evictions())

    def reset(self) -> None:
        """Forgets every cached block and snapshot, in host memory too (their memory is untouched and
        reused as free)."""
        self.kv.drop_hashes()
        self.snapshots.drop_hashes()
        if self.host is not None:
            self.kv.take_evictions()
            self.snapshots.take_evictions()
            self.host.reset()

    def stats(self) -> PrefixCacheStats:
        host = self.host
        if host is None:
            return PrefixCacheStats(self.queries, self.hits, self.kv.num_cached, self.snapshots.num_cached)
        return PrefixCacheStats(self.queries, self.hits, self.kv.num_cached, self.snapshots.num_cached,
                                self.host_hits, host.num_spilled_blocks, host.blocks.num_cached,
                                host.snapshots.num_cached)
