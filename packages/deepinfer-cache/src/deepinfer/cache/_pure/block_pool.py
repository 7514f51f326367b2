"""Pure-Python twin of `deepinfer/cache/_block_pool.pyx`: same API, same ids, same errors.

The free list is an array-backed, circular, doubly linked list with a sentinel at index
`num_blocks`: `_next_free[sentinel]` is the head (next to hand out) and `_prev_free[sentinel]` the
tail (last freed). A block outside the list has `_next_free == _prev_free == -1`.
Prefix caching: `_hashes[b]` is the content hash of cached block b (else None), `_by_hash` the
reverse index; a free block keeps its hash until `allocate` hands it out again.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import numpy as np

from .._slots import MAX_NUM_BLOCKS, as_id_array, check_count, check_hash, check_num_blocks, resolve_state_slots

_NOT_LINKED = -1


class BlockManager:
    """Hands out block ids 1..num_blocks-1 with refcounts; block 0 is reserved (the dummy block).

    Args:
        num_blocks: blocks in the pool, block 0 included; in [2, 2**31 - 1].

    Raises:
        ValueError: num_blocks is not an int in that range.
    """

    def __init__(self, num_blocks: int) -> None:
        total = check_num_blocks(num_blocks)
        sentinel = total
        self._num_blocks = total
        self._num_free = total - 1
        self._ref_counts = array("i", [0]) * total
        # Free list 1 -> 2 -> ... -> total-1 -> sentinel -> 1; block 0 is never linked.
        self._next_free = array("i", range(1, total + 2))
        self._prev_free = array("i", range(-1, total))
        self._next_free[0] = self._prev_free[0] = _NOT_LINKED
        self._next_free[total - 1] = sentinel
        self._next_free[sentinel] = 1
        self._prev_free[1] = sentinel
        self._prev_free[sentinel] = total - 1
        self._hashes: list[bytes | None] = [None] * total
        self._by_hash: dict[bytes, int] = {}
        self._evicted: list[tuple[int, bytes]] | None = None   # see record_evictions

    @classmethod
    def for_state_slots(cls, max_num_seqs: int, ratio: float | None = None) -> BlockManager:
        """A manager of int(max_num_seqs * ratio) + 1 state slots (slot 0 is the dummy slot).

        Args:
            max_num_seqs: most sequences running at once, >= 1.
            ratio: slots per sequence, a finite float > 0; None = 1.2 (the engine passes its
                DEEPINFER_NUM_STATE_SLOTS_RATIO setting, read by deepinfer.engine.config.env).

        Raises:
            ValueError: a bad max_num_seqs or ratio, or a product that leaves no usable slot.
        """
        return cls(resolve_state_slots(max_num_seqs, ratio))

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, reserved block 0 included."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list (refcount 0), block 0 excluded."""
        return self._num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (1..num_blocks-1) in use, in [0, 1]."""
        num_usable = self._num_blocks - 1
        return (num_usable - self._num_free) / num_usable

    def can_allocate(self, num: int) -> bool:
        """True if allocate(num) would succeed. Raises ValueError if num < 0."""
        return check_count("num", num) <= self._num_free

    def ref_count(self, block_id: int) -> int:
        """References held on block_id (0 = free); block 0 always reports 0.

        Raises:
            ValueError: block_id outside [0, num_blocks).
        """
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
            raise ValueError(f"block_id must be an int, got {type(block_id).__name__}")
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block_id={block_id} out of range [0, {self._num_blocks})")
        return self._ref_counts[block_id]

    def allocate(self, num: int) -> np.ndarray:
        """Takes num blocks from the head of the free list, each with refcount 1.

        Returns:
            [num] int32 block ids in free-list order (never 0); allocate(0) gives an empty array.

        Raises:
            ValueError: num < 0 or num > num_free; nothing is changed.
        """
        count = check_count("num", num)
        if count > self._num_free:
            raise ValueError(f"num={count} exceeds the {self._num_free} free blocks")
        out = []
        sentinel = self._num_blocks
        nxt, prv, refs = self._next_free, self._prev_free, self._ref_counts
        for _ in range(count):
            block = nxt[sentinel]
            head = nxt[block]
            nxt[sentinel] = head
            prv[head] = sentinel
            nxt[block] = prv[block] = _NOT_LINKED
            refs[block] = 1
            out.append(block)
            held = self._hashes[block]
            if held is not None:
                self._hashes[block] = None
                del self._by_hash[held]
                if self._evicted is not None:
                    self._evicted.append((block, held))
        self._num_free -= count
        return np.array(out, dtype=np.int32)

    def free(self, block_ids: Iterable[int] | np.ndarray) -> int:
        """Drops one reference per listed id, in order; a block reaching 0 joins the free list's tail.

        Args:
            block_ids: 1-D integer ids; an id may repeat as often as it has references.

        Returns:
            Number of blocks that went back to the free list.

        Raises:
            ValueError: id 0, an id outside [1, num_blocks), a free block, or an id listed more
                times than its refcount; nothing is changed.
        """
        ids = self._checked(block_ids)
        pending: dict[int, int] = {}
        for block in ids:  # first over-free in list order, as the Cython twin reports it
            pending[block] = pending.get(block, 0) + 1
            if pending[block] > self._ref_counts[block]:
                raise ValueError(
                    f"block {block} is freed {ids.count(block)} time(s) but holds "
                    f"{self._ref_counts[block]} reference(s) (unallocated block or duplicate id)"
                )
        sentinel = self._num_blocks
        nxt, prv, refs = self._next_free, self._prev_free, self._ref_counts
        num_released = 0
        for block in ids:
            refs[block] -= 1
            if refs[block] == 0:
                tail = prv[sentinel]
                nxt[tail] = block
                prv[block] = tail
                nxt[block] = sentinel
                prv[sentinel] = block
                num_released += 1
        self._num_free += num_released
        return num_released

    def pin(self, block_ids: Iterable[int] | np.ndarray) -> None:
        """Adds one reference per listed id (sharing, e.g. a forked sequence).

        Args:
            block_ids: 1-D integer ids of allocated blocks; repeats add one reference each.

        Raises:
            ValueError: id 0, an id outside [1, num_blocks), a free block, or a refcount that would
                overflow int32; nothing is changed.
        """
        ids = self._checked(block_ids)
        pending: dict[int, int] = {}
        for block in ids:
            held = self._ref_counts[block]
            if held == 0:
                raise ValueError(f"block {block} is not allocated (refcount 0); cannot pin it")
            pending[block] = pending.get(block, 0) + 1
            if held + pending[block] > MAX_NUM_BLOCKS:
                raise ValueError(f"block {block}: refcount {held} + {ids.count(block)} overflows int32")
        for block in ids:
            self._ref_counts[block] += 1

    @property
    def num_cached(self) -> int:
        """Blocks holding a content hash (free or in use)."""
        return len(self._by_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Records that allocated block `block_id` holds the content named by `block_hash` (a full
        block of KV whose tokens, and every token before them, the hash chains over). The block keeps
        the hash while in use and while free, until `allocate` hands it out again.

        Returns:
            True if recorded; False when another block already holds this hash (the block stays
            uncached) or this block already holds it.

        Raises:
            ValueError: a bad block id, a free block, a block holding another hash, or a hash that is
                not non-empty bytes; nothing is changed.
        """
        block = self._one_id(block_id)
        check_hash(block_hash)
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is not allocated (refcount 0); only a held block can be cached")
        held = self._hashes[block]
        if held is not None and held != block_hash:
            raise ValueError(f"block {block} already holds another hash; a cached block's content never changes")
        if held is not None or block_hash in self._by_hash:
            return False
        self._hashes[block] = block_hash
        self._by_hash[block_hash] = block
        return True

    def cached_block(self, block_hash: bytes) -> int:
        """The block holding `block_hash`, or 0 when none does. Raises ValueError for a bad hash."""
        return self._by_hash.get(check_hash(block_hash), 0)

    def block_hash(self, block_id: int) -> bytes | None:
        """The content hash block `block_id` holds, or None. Raises ValueError for a bad id."""
        return self._hashes[self._one_id(block_id)]

    def match(self, block_hashes: Iterable[bytes]) -> int:
        """How many of `block_hashes` (a chain, first block first) are cached, counted from the first."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._by_hash:
                break
            count += 1
        return count

    def reuse(self, block_ids: Iterable[int] | np.ndarray) -> None:
        """Adds one reference per listed id to cached blocks (a prefix-cache hit): a free one leaves
        the free list with refcount 1, a held one is shared like `pin`.

        Raises:
            ValueError: id 0, an id outside [1, num_blocks), a block without a hash, a repeated id or
                a refcount that would overflow int32; nothing is changed.
        """
        ids = self._checked(block_ids)
        if len(set(ids)) != len(ids):
            raise ValueError("reuse takes each block once; block ids repeat")
        for block in ids:
            if self._hashes[block] is None:
                raise ValueError(f"block {block} holds no hash; only a cached block can be reused")
            if self._ref_counts[block] == MAX_NUM_BLOCKS:
                raise ValueError(f"block {block}: refcount {MAX_NUM_BLOCKS} + 1 overflows int32")
        nxt, prv = self._next_free, self._prev_free
        for block in ids:
            if self._ref_counts[block] == 0:
                before, after = prv[block], nxt[block]
                nxt[before] = after
                prv[after] = before
                nxt[block] = prv[block] = _NOT_LINKED
                self._num_free -= 1
            self._ref_counts[block] += 1

    def record_evictions(self) -> None:
        """From now on `allocate` records each cached block it hands out (its hash is lost): the prefix
        cache's host tier copies their content elsewhere before it is overwritten (`take_evictions`)."""
        if self._evicted is None:
            self._evicted = []

    def take_evictions(self) -> list[tuple[int, bytes]]:
        """[(block id, hash)] of the cached blocks `allocate` handed out since the last call, oldest
        first (empty unless `record_evictions` was called)."""
        if not self._evicted:
            return []
        out, self._evicted = self._evicted, []
        return out

    def drop_hashes(self) -> int:
        """Forgets every block's hash (the blocks themselves are untouched); returns how many it held."""
        num_dropped = len(self._by_hash)
        for block in self._by_hash.values():
            self._hashes[block] = None
        self._by_hash.clear()
        return num_dropped

    def free_block_ids(self) -> np.ndarray:
        """[num_free] int32 ids on the free list, head (next handed out) first."""
        out = []
        sentinel = self._num_blocks
        block = self._next_free[sentinel]
        while block != sentinel:
            out.append(block)
            block = self._next_free[block]
        return np.array(out, dtype=np.int32)

    def check_integrity(self) -> None:
        """Walks the free list both ways and checks every invariant; O(num_blocks), for idle time.

        Raises:
            RuntimeError: a broken link, a count mismatch, or a listed block with a refcount.
        """
        sentinel = self._num_blocks
        nxt, prv, refs = self._next_free, self._prev_free, self._ref_counts
        if refs[0] != 0 or nxt[0] != _NOT_LINKED or prv[0] != _NOT_LINKED:
            raise RuntimeError("block 0 must stay unreferenced and off the free list")
        seen = 0
        block = nxt[sentinel]
        previous = sentinel
        while block != sentinel:
            if not 1 <= block < sentinel or prv[block] != previous or refs[block] != 0 or seen >= sentinel:
                raise RuntimeError(f"free list broken at block {block}")
            seen += 1
            previous, block = block, nxt[block]
        if prv[sentinel] != previous or seen != self._num_free:
            raise RuntimeError(f"free list holds {seen} blocks, num_free={self._num_free}")
        for block in range(1, sentinel):
            linked = nxt[block] != _NOT_LINKED
            if refs[block] < 0 or linked != (refs[block] == 0):
                raise RuntimeError(f"block {block}: refcount {refs[block]}, on free list: {linked}")
        num_hashed = sum(h is not None for h in self._hashes)
        if self._hashes[0] is not None or num_hashed != len(self._by_hash) or any(
                self._hashes[b] != h for h, b in self._by_hash.items()):
            raise RuntimeError(f"hash index broken: {num_hashed} hashed blocks, {len(self._by_hash)} indexed")

    def __repr__(self) -> str:
        return f"BlockManager(num_blocks={self._num_blocks}, num_free={self._num_free})"

    def _one_id(self, block_id: object) -> int:
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
            raise ValueError(f"block_id must be an int, got {type(block_id).__name__}")
        if not 1 <= block_id < self._num_blocks:
            raise ValueError(f"block_id={block_id} out of range [1, {self._num_blocks})")
        return int(block_id)

    def _checked(self, block_ids: Iterable[int] | np.ndarray) -> list[int]:
        ids = as_id_array(block_ids)
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low == 0:
                raise ValueError("block 0 is reserved and never handed out; it cannot be freed or pinned")
            if low < 1 or high >= self._num_blocks:
                bad = low if low < 1 else high
                raise ValueError(f"block id {bad} out of range [1, {self._num_blocks})")
        return ids.tolist()
