"""Decode scheduling (DESIGN.md §4 `_schedule_decode`): promote prompted sequences (copy-on-write
for fork branches), reserve nextn + 1 query positions per running sequence, preempt when blocks
run out, and emit the batch sorted by KV length descending.

The per-row loop runs in `_decode_core` (Cython, GIL released) or its numpy twin.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from .fork import copy_on_write
from .output import DecodeBatch
from .preemption import fit_by_preemption
from .sequence import SeqStatus
from .state import SchedState
from .verify import VerifyLengthPolicy, checked_query_lens


class DecodeBuffers:
    """Output buffers reused by every decode step (views valid until the next schedule())."""

    def __init__(self, capacity: int, max_blocks_per_seq: int, query_len: int) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.query_len = query_len
        self.capacity = 0
        self.ensure(capacity)

    def ensure(self, num_rows: int) -> None:
        if num_rows <= self.capacity:
            return
        self.capacity = max(num_rows, 2 * self.capacity)
        self.need = np.zeros(self.capacity, dtype=np.int32)
        self.seq_lens = np.zeros(self.capacity, dtype=np.int32)
        self.state_slots = np.zeros(self.capacity, dtype=np.int32)
        self.last_tokens = np.zeros(self.capacity, dtype=np.int32)
        self.query_lens = np.full(self.capacity, self.query_len, dtype=np.int32)
        self.block_tables = np.zeros(self.capacity * self.max_blocks_per_seq, dtype=np.int32)


def promote_prompted(st: SchedState) -> None:
    """Moves prompted sequences (FIFO) into the running set while the running count stays under
    max_num_seqs and fork branches get their copy; the first that cannot go waits, with the rest."""
    if not st.prompted:
        return
    room = st.config.max_num_seqs - len(st.running_rows)
    promoted: list[int] = []
    for seq in list(st.prompted.values()):
        if len(promoted) >= room or (seq.uncopied and not copy_on_write(st, seq)):
            break
        del st.prompted[seq.key]
        seq.status = SeqStatus.RUNNING
        promoted.append(seq.row)
    if promoted:
        st.running_rows = np.concatenate([st.running_rows, np.array(promoted, dtype=np.int32)])


def schedule_decode(
    st: SchedState, core: ModuleType, buffers: DecodeBuffers, verify_policy: VerifyLengthPolicy | None
) -> DecodeBatch | None:
    """Reserves one decode step for every running sequence it can; None if none runs."""
    _check_lengths(st)
    promote_prompted(st)
    table = st.table
    held = None
    rows = st.running_rows
    if st.num_uncopied:   # parents wait until all their branches copied their state
        free_to_run = table.num_branches[rows] == 0
        held, rows = rows[~free_to_run], rows[free_to_run]
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    num_rows = len(rows)
    if num_rows == 0:
        return None
    buffers.ensure(num_rows)
    query_len = st.config.max_query_len
    total = core.count_new_blocks(
        rows, table.seq_len, table.num_blocks, query_len, st.config.block_size,
        st.config.max_blocks_per_seq, buffers.need,
    )
    if total > st.kv.num_free:
        kept = fit_by_preemption(st, rows, buffers.need)
        rows = np.ascontiguousarray(rows[kept])
        buffers.need[: len(rows)] = buffers.need[:num_rows][kept]
        num_rows = len(rows)
        total = int(buffers.need[:num_rows].sum())
        if num_rows == 0:
            st.running_rows = held if held is not None else rows
            return None
    new_block_ids = st.kv.allocate(total)
    width = core.commit_decode(
        rows, buffers.need, new_block_ids, query_len,
        table.seq_len, table.num_inflight, table.pending_steps, table.num_blocks, table.block_table,
        table.state_slot, table.last_token,
        buffers.seq_lens, buffers.state_slots, buffers.last_tokens, buffers.block_tables,
    )
    st.running_rows = rows if held is None or not len(held) else np.concatenate([rows, held])
    return _emit(st, rows, width, buffers, verify_policy)


def _check_lengths(st: SchedState) -> None:
    """Refuses (before any change) a step that would grow a sequence past its block-table row."""
    rows = st.running_rows
    if not len(rows):
        return
    limit = st.config.max_blocks_per_seq * st.config.block_size - st.config.max_query_len
    too_long = np.flatnonzero(st.table.seq_len[rows] > limit)
    if len(too_long):
        row = int(rows[too_long[0]])
        raise RuntimeError(
            f"sequence {st.table.ids[row]!r} holds {int(st.table.seq_len[row])} KV positions; one more "
            f"decode step would pass max_model_len={st.config.max_model_len} plus two in-flight "
            "steps: the engine must finish it (reason 'length') first"
        )


def _emit(
    st: SchedState, rows: np.ndarray, width: int, buffers: DecodeBuffers,
    verify_policy: VerifyLengthPolicy | None,
) -> DecodeBatch:
    num_rows = len(rows)
    seq_ids = tuple(st.table.ids[rows].tolist())
    seq_lens = _read_only(buffers.seq_lens[:num_rows])
    query_lens = buffers.query_lens[:num_rows]
    if verify_policy is not None:
        query_lens = checked_query_lens(
            verify_policy.query_lens(seq_ids, seq_lens, st.config.max_query_len), num_rows,
            st.config.max_query_len,
        )
    return DecodeBatch(
        seq_ids=seq_ids,
        rows=_read_only(rows),
        query_lens=_read_only(query_lens),
        seq_lens=_read_only(seq_lens),
        block_tables=_read_only(buffers.block_tables[: num_rows * width].reshape(num_rows, width)),
        state_slots=_read_only(buffers.state_slots[:num_rows]),
        last_token_ids=_read_only(buffers.last_tokens[:num_rows]),
    )


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view
