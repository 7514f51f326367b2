# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Cython decode core: the per-row loops of a decode step, run without the GIL.

Twin: deepinfer/sched/_pure/decode_core.py (same signatures, mutations and results; both run on
the same tests). Callers pass the scheduler's own int32 arrays; rows index them.
"""

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

cdef extern from *:
    """
    #ifndef DEEPINFER_SCHED_SOURCE_SHA256
    #define DEEPINFER_SCHED_SOURCE_SHA256 "unknown"
    #endif
    """
    const char* DEEPINFER_SCHED_SOURCE_SHA256

# sha256 of this .pyx as built (set by hatch_build.py); a test compares it with the source tree.
SOURCE_SHA256 = DEEPINFER_SCHED_SOURCE_SHA256.decode("ascii")


cdef bint _insertion_sort(int32_t* rows, Py_ssize_t n, const int32_t* key, Py_ssize_t max_shifts) noexcept nogil:
    """Stable sort of rows by key[row] descending; gives up after max_shifts moves (returns False,
    rows then hold a permutation whose equal keys keep their original order)."""
    cdef Py_ssize_t i, j, shifts = 0
    cdef int32_t row, value
    for i in range(1, n):
        row = rows[i]
        value = key[row]
        j = i - 1
        while j >= 0 and key[rows[j]] < value:
            rows[j + 1] = rows[j]
            j -= 1
        shifts += i - 1 - j
        rows[j + 1] = row
        if shifts > max_shifts:
            return False
    return True


cdef void _merge_sort(int32_t* rows, int32_t* scratch, Py_ssize_t n, const int32_t* key) noexcept nogil:
    """Bottom-up stable merge sort of rows by key[row] descending."""
    cdef int32_t* src = rows
    cdef int32_t* dst = scratch
    cdef int32_t* swap
    cdef Py_ssize_t width = 1, low, mid, high, i, j, k
    while width < n:
        low = 0
        while low < n:
            mid = low + width if low + width < n else n
            high = low + 2 * width if low + 2 * width < n else n
            i = low
            j = mid
            k = low
            while i < mid and j < high:
                if key[src[j]] > key[src[i]]:   # right wins only when strictly longer: stable
                    dst[k] = src[j]
                    j += 1
                else:
                    dst[k] = src[i]
                    i += 1
                k += 1
            while i < mid:
                dst[k] = src[i]
                i += 1
                k += 1
            while j < high:
                dst[k] = src[j]
                j += 1
                k += 1
            low += 2 * width
        swap = src
        src = dst
        dst = swap
        width *= 2
    if src != rows:
        memcpy(rows, src, n * sizeof(int32_t))


def count_new_blocks(const int32_t[::1] rows, const int32_t[::1] seq_len, const int32_t[::1] num_blocks,
                     int query_len, int block_size, int max_blocks, int32_t[::1] need_out):
    """need_out[i] = blocks row rows[i] must add to hold seq_len + query_len tokens.

    Returns the total, or -1 - i for the first i whose block count would pass max_blocks (then
    need_out is unspecified).
    """
    cdef Py_ssize_t i, n = rows.shape[0], bad = -1
    cdef int32_t row, wanted
    cdef int64_t total = 0
    if need_out.shape[0] < n:
        raise ValueError(f"need_out holds {need_out.shape[0]} entries, {n} rows given")
    with nogil:
        for i in range(n):
            row = rows[i]
            wanted = (seq_len[row] + query_len + block_size - 1) // block_size
            if wanted > max_blocks:
                bad = i
                break
            need_out[i] = wanted - num_blocks[row]
            total += need_out[i]
    if bad >= 0:
        return -1 - bad
    return total


def commit_decode(int32_t[::1] rows, const int32_t[::1] need, const int32_t[::1] new_block_ids,
                  int query_len, int32_t[::1] seq_len, int32_t[::1] num_inflight,
                  int32_t[::1] pending_steps, int32_t[::1] num_blocks, int32_t[:, ::1] block_table,
                  const int32_t[::1] state_slot, const int32_t[::1] last_token,
                  int32_t[::1] out_seq_lens, int32_t[::1] out_state_slots, int32_t[::1] out_last_tokens):
    """Reserves one decode step for every row and fills the per-row outputs.

    Appends new_block_ids (consumed in row order, need[i] for rows[i]) to the block-table rows,
    sorts `rows` in place by seq_len descending (stable), then per row in that order emits the
    last token (-1 while a step is in flight), adds query_len to seq_len and num_inflight, one to
    pending_steps, and emits seq_len and state slot. Returns the most blocks of any row.
    """
    cdef Py_ssize_t n = rows.shape[0], i, offset = 0, width = 0
    cdef int32_t row, count, start
    cdef int32_t* scratch
    if need.shape[0] < n or out_seq_lens.shape[0] < n or out_state_slots.shape[0] < n \
            or out_last_tokens.shape[0] < n:
        raise ValueError(f"output arrays are smaller than the {n} rows given")
    if n == 0:
        return 0
    with nogil:
        for i in range(n):
            count = need[i]
            if count:
                row = rows[i]
                start = num_blocks[row]
                memcpy(&block_table[row, start], &new_block_ids[offset], count * sizeof(int32_t))
                num_blocks[row] = start + count
                offset += count
        if not _insertion_sort(&rows[0], n, &seq_len[0], 32 * n):
            scratch = <int32_t*>malloc(n * sizeof(int32_t))
            if scratch == NULL:
                with gil:
                    raise MemoryError("decode sort scratch")
            _merge_sort(&rows[0], scratch, n, &seq_len[0])
            free(scratch)
        for i in range(n):
            row = rows[i]
            out_last_tokens[i] = -1 if pending_steps[row] > 0 else last_token[row]
            seq_len[row] += query_len
            num_inflight[row] += query_len
            pending_steps[row] += 1
            out_seq_lens[i] = seq_len[row]
            out_state_slots[i] = state_slot[row]
            if num_blocks[row] > width:
                width = num_blocks[row]
    return width


def gather_block_tables(const int32_t[::1] rows, const int32_t[:, ::1] block_table, int32_t[:, ::1] out):
    """out[i] = block_table[rows[i], :out.shape[1]] for out of shape [len(rows), width]."""
    cdef Py_ssize_t n = rows.shape[0], i
    cdef Py_ssize_t width = out.shape[1]
    if out.shape[0] != n or width > block_table.shape[1]:
        raise ValueError(f"out has shape ({out.shape[0]}, {width}); expected ({n}, <= {block_table.shape[1]})")
    if n == 0 or width == 0:
        return
    with nogil:
        for i in range(n):
            memcpy(&out[i, 0], &block_table[rows[i], 0], width * sizeof(int32_t))
