# The free list of the Cython BlockManager: a C struct and inline nogil operations on it.
# pxd-only (no .pyx): the functions are inlined into _block_pool, nothing is imported at run time.
# Callers validate ids (range [1, num_blocks)) and counts before calling; these never raise.
from libc.stdint cimport int32_t, int64_t


cdef struct FreeList:
    # Circular doubly linked free list over ids 1..num_blocks-1 with a sentinel at index
    # num_blocks: next_free[sentinel] is the head, prev_free[sentinel] the tail. A block outside the
    # list has next_free == prev_free == -1. Arrays hold num_blocks + 1 entries.
    int32_t* ref_counts
    int32_t* next_free
    int32_t* prev_free
    int32_t num_blocks
    int32_t num_free


cdef enum:
    NOT_LINKED = -1
    INT32_MAX = 2147483647


cdef inline void pop_head(FreeList* fl, int32_t* out, Py_ssize_t count) noexcept nogil:
    cdef int32_t sentinel = fl.num_blocks
    cdef int32_t block, head
    cdef Py_ssize_t i
    for i in range(count):
        block = fl.next_free[sentinel]
        head = fl.next_free[block]
        fl.next_free[sentinel] = head
        fl.prev_free[head] = sentinel
        fl.next_free[block] = NOT_LINKED
        fl.prev_free[block] = NOT_LINKED
        fl.ref_counts[block] = 1
        out[i] = block
    fl.num_free -= <int32_t>count


cdef inline void push_tail(FreeList* fl, int32_t block) noexcept nogil:
    cdef int32_t sentinel = fl.num_blocks
    cdef int32_t tail = fl.prev_free[sentinel]
    fl.next_free[tail] = block
    fl.prev_free[block] = tail
    fl.next_free[block] = sentinel
    fl.prev_free[sentinel] = block
    fl.num_free += 1


cdef inline void unlink_block(FreeList* fl, int32_t block) noexcept nogil:
    # Takes a listed block out of the free list wherever it is (a cached block reused by a hit).
    cdef int32_t before = fl.prev_free[block]
    cdef int32_t after = fl.next_free[block]
    fl.next_free[before] = after
    fl.prev_free[after] = before
    fl.next_free[block] = NOT_LINKED
    fl.prev_free[block] = NOT_LINKED
    fl.num_free -= 1


cdef inline void pop_tail(FreeList* fl) noexcept nogil:
    cdef int32_t sentinel = fl.num_blocks
    cdef int32_t block = fl.prev_free[sentinel]
    cdef int32_t tail = fl.prev_free[block]
    fl.next_free[tail] = sentinel
    fl.prev_free[sentinel] = tail
    fl.next_free[block] = NOT_LINKED
    fl.prev_free[block] = NOT_LINKED
    fl.num_free -= 1


cdef inline void id_range(const int32_t* ids, Py_ssize_t count, int64_t* low, int64_t* high) noexcept nogil:
    cdef Py_ssize_t i
    cdef int64_t value
    low[0] = ids[0]
    high[0] = ids[0]
    for i in range(1, count):
        value = ids[i]
        if value < low[0]:
            low[0] = value
        elif value > high[0]:
            high[0] = value


cdef inline Py_ssize_t release(
    FreeList* fl, const int32_t* ids, Py_ssize_t count, Py_ssize_t* num_released
) noexcept nogil:
    """Drops one reference per id in order; returns -1, or the index of the first over-free after
    undoing everything done before it. Ids must already be in [1, num_blocks)."""
    cdef Py_ssize_t i, j
    cdef int32_t block
    num_released[0] = 0
    for i in range(count):
        block = ids[i]
        if fl.ref_counts[block] == 0:
            for j in range(i - 1, -1, -1):  # undo in reverse: a re-freed block is the tail again
                block = ids[j]
                if fl.ref_counts[block] == 0:
                    pop_tail(fl)
                fl.ref_counts[block] += 1
            num_released[0] = 0
            return i
        fl.ref_counts[block] -= 1
        if fl.ref_counts[block] == 0:
            push_tail(fl, block)
            num_released[0] += 1
    return -1


cdef inline Py_ssize_t add_refs(FreeList* fl, const int32_t* ids, Py_ssize_t count) noexcept nogil:
    """Adds one reference per id; returns -1, or the index of the first bad id (free block or
    int32 overflow) after undoing the earlier ones. Ids must already be in [1, num_blocks)."""
    cdef Py_ssize_t i, j
    cdef int32_t block
    for i in range(count):
        block = ids[i]
        if fl.ref_counts[block] == 0 or fl.ref_counts[block] == INT32_MAX:
            for j in range(i):
                fl.ref_counts[ids[j]] -= 1
            return i
        fl.ref_counts[block] += 1
    return -1
