# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Cython BlockManager: block ids from an array-backed doubly linked free list, with refcounts.

Twin: deepinfer/cache/_pure/block_pool.py (same API, ids and errors; both run on the same tests).
Every mutating call validates the whole request before it commits: a rejected call changes nothing.
Prefix caching: a block may carry a content hash (`cache_block`); it keeps it while free, until
`allocate` hands it out again (the free list's head is the least recently freed: LRU eviction), and
`reuse` takes cached blocks by reference, free or not.
The list walks run without the GIL; a manager still has one owner thread (it is not locked).
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t

from ._free_list cimport (
    INT32_MAX,
    NOT_LINKED,
    FreeList,
    add_refs,
    id_range,
    pop_head,
    release,
    unlink_block,
)

import numpy as np

from ._slots import as_id_array, check_count, check_hash, check_num_blocks, resolve_state_slots

cdef extern from *:
    """
    #ifndef DEEPINFER_CACHE_SOURCE_SHA256
    #define DEEPINFER_CACHE_SOURCE_SHA256 "unknown"
    #endif
    """
    const char* DEEPINFER_CACHE_SOURCE_SHA256

# sha256 of _block_pool.pyx + every .pxd of the package as built (set by hatch_build.py); a test
# compares it with the source tree to catch a stale in-place build.
SOURCE_SHA256 = DEEPINFER_CACHE_SOURCE_SHA256.decode("ascii")

_np_empty = np.empty
_np_int32 = np.int32
_np_ndarray = np.ndarray


cdef class BlockManager:
    """Hands out block ids 1..num_blocks-1 with refcounts; block 0 is reserved (the dummy block).

    Args:
        num_blocks: blocks in the pool, block 0 included; in [2, 2**31 - 1].

    Raises:
        ValueError: num_blocks is not an int in that range.
        MemoryError: the three int32 arrays of num_blocks + 1 entries cannot be allocated.
    """

    def __cinit__(self, num_blocks):
        cdef int32_t total = check_num_blocks(num_blocks)
        cdef size_t num_bytes = (<size_t>total + 1) * sizeof(int32_t)
        cdef Py_ssize_t i
        self._list.num_blocks = total
        self._list.ref_counts = <int32_t*>PyMem_Malloc(num_bytes)
        self._list.next_free = <int32_t*>PyMem_Malloc(num_bytes)
        self._list.prev_free = <int32_t*>PyMem_Malloc(num_bytes)
        if not (self._list.ref_counts and self._list.next_free and self._list.prev_free):
            raise MemoryError(f"cannot allocate the free list of num_blocks={total}")
        with nogil:
            for i in range(total):
                self._list.ref_counts[i] = 0
                self._list.next_free[i] = <int32_t>(i + 1)
                self._list.prev_free[i] = <int32_t>(i - 1)
            self._list.ref_counts[total] = 0
            self._list.prev_free[total] = total - 1
            self._list.next_free[0] = NOT_LINKED
            self._list.prev_free[0] = NOT_LINKED
            self._list.next_free[total] = 1
            self._list.prev_free[1] = total
            self._list.num_free = total - 1
        self._hashes = [None] * total
        self._by_hash = {}
        self._evicted = None

    def __dealloc__(self):
        PyMem_Free(self._list.ref_counts)
        PyMem_Free(self._list.next_free)
        PyMem_Free(self._list.prev_free)

    @classmethod
    def for_state_slots(cls, max_num_seqs, ratio=None):
        """A manager of int(max_num_seqs * ratio) + 1 state slots (slot 0 is the dummy slot).

        Args:
            max_num_seqs: most sequences running at once, >= 1.
            ratio: slots per sequence, a finite float > 0; None = 1.2 (the engine passes its
                DEEPINFER_NUM_STATE_SLOTS_RATIO setting, read by deepinfer.engine.env).

        Raises:
            ValueError: a bad max_num_seqs or ratio, or a product that leaves no usable slot.
        """
        return cls(resolve_state_slots(max_num_seqs, ratio))

    @property
    def num_blocks(self):
        """Blocks in the pool, reserved block 0 included."""
        return self._list.num_blocks

    @property
    def num_free(self):
        """Blocks on the free list (refcount 0), block 0 excluded."""
        return self._list.num_free

    @property
    def usage(self):
        """Fraction of the usable blocks (1..num_blocks-1) in use, in [0, 1]."""
        cdef double num_usable = self._list.num_blocks - 1
        return (num_usable - self._list.num_free) / num_usable

    def can_allocate(self, num):
        """True if allocate(num) would succeed. Raises ValueError if num < 0."""
        if type(num) is not int or num < 0:
            num = check_count("num", num)
        return num <= self._list.num_free

    def ref_count(self, block_id):
        """References held on block_id (0 = free); block 0 always reports 0.

        Raises:
            ValueError: block_id outside [0, num_blocks).
        """
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
            raise ValueError(f"block_id must be an int, got {type(block_id).__name__}")
        if not 0 <= block_id < self._list.num_blocks:
            raise ValueError(f"block_id={block_id} out of range [0, {self._list.num_blocks})")
        return self._list.ref_counts[<int32_t>block_id]

    def allocate(self, num):
        """Takes num blocks from the head of the free list, each with refcount 1.

        Returns:
            [num] int32 block ids in free-list order (never 0); allocate(0) gives an empty array.

        Raises:
            ValueError: num < 0 or num > num_free; nothing is changed.
        """
        if type(num) is not int or num < 0:
            num = check_count("num", num)
        if num > self._list.num_free:
            raise ValueError(f"num={num} exceeds the {self._list.num_free} free blocks")
        cdef Py_ssize_t count = num
        out = _np_empty(count, dtype=_np_int32)
        cdef int32_t[::1] view = out
        if count:
            with nogil:
                pop_head(&self._list, &view[0], count)
            if self._by_hash:
                self._evict(out)
        return out

    def free(self, block_ids):
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
        cdef const int32_t[::1] view = ids
        cdef Py_ssize_t bad = -1
        cdef Py_ssize_t num_released = 0
        if view.shape[0] == 0:
            return 0
        with nogil:
            bad = release(&self._list, &view[0], view.shape[0], &num_released)
        if bad >= 0:
            block = int(ids[bad])
            times = int((ids == block).sum())
            raise ValueError(
                f"block {block} is freed {times} time(s) but holds {self._list.ref_counts[block]} "
                "reference(s) (unallocated block or duplicate id)"
            )
        return num_released

    def pin(self, block_ids):
        """Adds one reference per listed id (sharing, e.g. a forked sequence).

        Args:
            block_ids: 1-D integer ids of allocated blocks; repeats add one reference each.

        Raises:
            ValueError: id 0, an id outside [1, num_blocks), a free block, or a refcount that would
                overflow int32; nothing is changed.
        """
        ids = self._checked(block_ids)
        cdef const int32_t[::1] view = ids
        cdef Py_ssize_t bad = -1
        if view.shape[0] == 0:
            return
        with nogil:
            bad = add_refs(&self._list, &view[0], view.shape[0])
        if bad >= 0:
            block = int(ids[bad])
            held = self._list.ref_counts[block]
            if held == 0:
                raise ValueError(f"block {block} is not allocated (refcount 0); cannot pin it")
            times = int((ids == block).sum())
            raise ValueError(f"block {block}: refcount {held} + {times} overflows int32")

    @property
    def num_cached(self):
        """Blocks holding a content hash (free or in use)."""
        return len(self._by_hash)

    def cache_block(self, block_id, block_hash):
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
        if self._list.ref_counts[block] == 0:
            raise ValueError(f"block {block} is not allocated (refcount 0); only a held block can be cached")
        held = self._hashes[block]
        if held is not None and held != block_hash:
            raise ValueError(f"block {block} already holds another hash; a cached block's content never changes")
        if held is not None or block_hash in self._by_hash:
            return False
        self._hashes[block] = block_hash
        self._by_hash[block_hash] = block
        return True

    def cached_block(self, block_hash):
        """The block holding `block_hash`, or 0 when none does. Raises ValueError for a bad hash."""
        return self._by_hash.get(check_hash(block_hash), 0)

    def block_hash(self, block_id):
        """The content hash block `block_id` holds, or None. Raises ValueError for a bad id."""
        return self._hashes[self._one_id(block_id)]

    def match(self, block_hashes):
        """How many of `block_hashes` (a chain, first block first) are cached, counted from the first."""
        by_hash = self._by_hash
        cdef Py_ssize_t count = 0
        for block_hash in block_hashes:
            if block_hash not in by_hash:
                break
            count += 1
        return count

    def reuse(self, block_ids):
        """Adds one reference per listed id to cached blocks (a prefix-cache hit): a free one leaves
        the free list with refcount 1, a held one is shared like `pin`.

        Raises:
            ValueError: id 0, an id outside [1, num_blocks), a block without a hash, a repeated id or
                a refcount that would overflow int32; nothing is changed.
        """
        ids = self._checked(block_ids)
        cdef const int32_t[::1] view = ids
        cdef Py_ssize_t i
        cdef int32_t block
        if view.shape[0] == 0:
            return
        if len(set(ids.tolist())) != view.shape[0]:
            raise ValueError("reuse takes each block once; block ids repeat")
        for i in range(view.shape[0]):
            block = view[i]
            if self._hashes[block] is None:
                raise ValueError(f"block {block} holds no hash; only a cached block can be reused")
            if self._list.ref_counts[block] == INT32_MAX:
                raise ValueError(f"block {block}: refcount {INT32_MAX} + 1 overflows int32")
        with nogil:
            for i in range(view.shape[0]):
                block = view[i]
                if self._list.ref_counts[block] == 0:
                    unlink_block(&self._list, block)
                self._list.ref_counts[block] += 1

    def record_evictions(self):
        """From now on `allocate` records each cached block it hands out (its hash is lost): the prefix
        cache's host tier copies their content elsewhere before it is overwritten (`take_evictions`)."""
        if self._evicted is None:
            self._evicted = []

    def take_evictions(self):
        """[(block id, hash)] of the cached blocks `allocate` handed out since the last call, oldest
        first (empty unless `record_evictions` was called)."""
        if not self._evicted:
            return []
        out, self._evicted = self._evicted, []
        return out

    def drop_hashes(self):
        """Forgets every block's hash (the blocks themselves are untouched); returns how many it held."""
        num_dropped = len(self._by_hash)
        for block in self._by_hash.values():
            self._hashes[block] = None
        self._by_hash.clear()
        return num_dropped

    def free_block_ids(self):
        """[num_free] int32 ids on the free list, head (next handed out) first."""
        out = _np_empty(self._list.num_free, dtype=_np_int32)
        cdef int32_t[::1] view = out
        cdef int32_t sentinel = self._list.num_blocks
        cdef int32_t block = self._list.next_free[sentinel]
        cdef Py_ssize_t i = 0
        with nogil:
            while block != sentinel and i < view.shape[0]:
                view[i] = block
                i += 1
                block = self._list.next_free[block]
        return out

    def check_integrity(self):
        """Walks the free list both ways and checks every invariant; O(num_blocks), for idle time.

        Raises:
            RuntimeError: a broken link, a count mismatch, or a listed block with a refcount.
        """
        cdef FreeList* fl = &self._list
        cdef int32_t sentinel = fl.num_blocks
        cdef int32_t block, previous
        cdef int64_t seen = 0
        if fl.ref_counts[0] != 0 or fl.next_free[0] != NOT_LINKED or fl.prev_free[0] != NOT_LINKED:
            raise RuntimeError("block 0 must stay unreferenced and off the free list")
        block = fl.next_free[sentinel]
        previous = sentinel
        while block != sentinel:
            if (not 1 <= block < sentinel or fl.prev_free[block] != previous or fl.ref_counts[block] != 0
                    or seen >= sentinel):
                raise RuntimeError(f"free list broken at block {block}")
            seen += 1
            previous = block
            block = fl.next_free[block]
        if fl.prev_free[sentinel] != previous or seen != fl.num_free:
            raise RuntimeError(f"free list holds {seen} blocks, num_free={fl.num_free}")
        for block in range(1, sentinel):
            linked = fl.next_free[block] != NOT_LINKED
            if fl.ref_counts[block] < 0 or linked != (fl.ref_counts[block] == 0):
                raise RuntimeError(
                    f"block {block}: refcount {fl.ref_counts[block]}, on free list: {linked}"
                )
        num_hashed = sum(h is not None for h in self._hashes)
        if self._hashes[0] is not None or num_hashed != len(self._by_hash) or any(
                self._hashes[b] != h for h, b in self._by_hash.items()):
            raise RuntimeError(f"hash index broken: {num_hashed} hashed blocks, {len(self._by_hash)} indexed")

    def __repr__(self):
        return f"BlockManager(num_blocks={self._list.num_blocks}, num_free={self._list.num_free})"

    cdef object _evict(self, object block_ids):
        """Blocks just handed out by `allocate` lose their hash (their content is about to change)."""
        hashes = self._hashes
        for block in block_ids.tolist():
            held = hashes[block]
            if held is not None:
                hashes[block] = None
                del self._by_hash[held]
                if self._evicted is not None:
                    self._evicted.append((block, held))

    def _one_id(self, block_id):
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
            raise ValueError(f"block_id must be an int, got {type(block_id).__name__}")
        if not 1 <= block_id < self._list.num_blocks:
            raise ValueError(f"block_id={block_id} out of range [1, {self._list.num_blocks})")
        return int(block_id)

    cdef object _checked(self, object block_ids):
        """Block ids as a contiguous 1-D int32 array, all in [1, num_blocks)."""
        cdef int64_t low, high
        cdef const int32_t[::1] view
        if (type(block_ids) is _np_ndarray and block_ids.dtype == _np_int32 and block_ids.ndim == 1
                and block_ids.flags.c_contiguous):
            view = block_ids
            if view.shape[0] == 0:
                return block_ids
            id_range(&view[0], view.shape[0], &low, &high)
            _check_range(low, high, self._list.num_blocks)
            return block_ids
        ids = as_id_array(block_ids)  # int64; range-checked before the narrowing cast
        if ids.shape[0]:
            _check_range(int(ids.min()), int(ids.max()), self._list.num_blocks)
        return ids.astype(_np_int32)


cdef inline _check_range(int64_t low, int64_t high, int32_t num_blocks):
    if low == 0:
        raise ValueError("block 0 is reserved and never handed out; it cannot be freed or pinned")
    if low < 1 or high >= num_blocks:
        raise ValueError(f"block id {low if low < 1 else high} out of range [1, {num_blocks})")
