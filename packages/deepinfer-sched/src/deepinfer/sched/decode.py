"""Decode scheduling (docs/design.md §3.3): promote prompted sequences (copy-on-write
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
from .seq_table import SeqTable
from .sequence import SeqStatus, Sequence
from .state import SchedState
from .verify import VerifyLengthPolicy, checked_query_lens


class DecodeScratch:
    """State reused across decode steps (internal; never handed out): the per-row block-need
    array, and the last step's id tuple, reused while the rows and their ids are unchanged."""

    def __init__(self, capacity: int) -> None:
        self.need = np.zeros(max(capacity, 1), dtype=np.int32)
        self.last_rows = np.zeros(0, dtype=np.int32)
        self.last_ids_version = -1
        self.last_seq_ids: tuple[str, ...] = ()
        self._last_seqs: list[Sequence] | None = None
        self._maybe_awaiting = False

    def seq_ids(self, table: SeqTable, rows: np.ndarray) -> tuple[str, ...]:
        if table.ids_version != self.last_ids_version or not np.array_equal(rows, self.last_rows):
            self.last_seq_ids = tuple(table.ids[rows].tolist())
            self.last_rows = rows.copy()
            self.last_ids_version = table.ids_version
            self._last_seqs = None
        return self.last_seq_ids

    def last_batch(self, table: SeqTable, seq_ids: tuple[str, ...]) -> tuple[np.ndarray, list[Sequence], bool] | None:
        """(rows, sequences, whether one of them may still await its first token) of the last decode
        batch when `seq_ids` is its very tuple and no row of the table changed its sequence since
        (every one of them is then still live and running); else None. A sequence's first token can
        only become awaited again with a new row, so the flag, taken once, stays an upper bound."""
        if seq_ids is not self.last_seq_ids or table.ids_version != self.last_ids_version:
            return None
        if self._last_seqs is None:
            self._last_seqs = table.seqs_of(self.last_rows.tolist())
            self._maybe_awaiting = any(seq.awaiting_first_token for seq in self._last_seqs)
        return self.last_rows, self._last_seqs, self._maybe_awaiting

    def ensure(self, num_rows: int) -> np.ndarray:
        if num_rows > len(self.need):
            self.need = np.zeros(max(num_rows, 2 * len(self.need)), dtype=np.int32)
        return self.need


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
    st: SchedState, core: ModuleType, scratch: DecodeScratch, verify_policy: VerifyLengthPolicy | None
) -> DecodeBatch | None:
    """Reserves one decode step for every running sequence it can; None if none runs.

    Raises:
        RuntimeError: a sequence would outgrow its block-table row (the engine missed a length
            stop). Bookkeeping stays consistent, but the step's clone lists are lost: fatal.
    """
    promote_prompted(st)
    table = st.table
    held = None
    rows: np.ndarray = st.running_rows
    if st.num_uncopied:   # parents wait until all their branches copied their state
        free_to_run = table.num_branches[rows] == 0
        held, rows = rows[~free_to_run], rows[free_to_run]
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    num_rows = len(rows)
    if num_rows == 0:
        return None
    need = scratch.ensure(num_rows)
    query_len = st.config.max_query_len
    total = core.count_new_blocks(
        rows, table.seq_len, table.num_blocks, query_len, st.config.block_size,
        st.config.max_blocks_per_seq, need,
    )
    if total < 0:
        _refuse_too_long(st, int(rows[-1 - total]))
    if total > st.kv.num_free:
        kept = fit_by_preemption(st, rows, need)
        rows = np.ascontiguousarray(rows[kept])
        need[: len(rows)] = need[:num_rows][kept]
        num_rows = len(rows)
        total = int(need[:num_rows].sum())
        if num_rows == 0:
            st.running_rows = held if held is not None else rows
            return None
    new_block_ids = st.kv.allocate(total)
    seq_lens = np.empty(num_rows, dtype=np.int32)
    state_slots = np.empty(num_rows, dtype=np.int32)
    last_token_ids = np.empty(num_rows, dtype=np.int32)
    width = core.commit_decode(
        rows, need, new_block_ids, query_len,
        table.seq_len, table.num_inflight, table.pending_steps, table.num_blocks,
        table.block_table, table.state_slot, table.last_token,
        seq_lens, state_slots, last_token_ids,
    )
    block_tables = np.empty((num_rows, width), dtype=np.int32)
    core.gather_block_tables(rows, table.block_table, block_tables)
    st.running_rows = rows if held is None or not len(held) else np.concatenate([rows, held])
    seq_ids = scratch.seq_ids(table, rows)
    query_lens = np.full(num_rows, query_len, dtype=np.int32)
    if verify_policy is not None:
        query_lens = checked_query_lens(
            verify_policy.query_lens(seq_ids, seq_lens.copy(), query_len), num_rows, query_len
        )
    return DecodeBatch(
        seq_ids=seq_ids,
        rows=rows.copy(),         # running_rows is re-sorted in place by the next step
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=block_tables,
        state_slots=state_slots,
        last_token_ids=last_token_ids,
        table_versions=table.table_version[rows],
    )


def _refuse_too_long(st: SchedState, row: int) -> None:
    raise RuntimeError(
        f"sequence {st.table.ids[row]!r} holds {int(st.table.seq_len[row])} KV positions; one more "
        f"decode step would pass max_model_len={st.config.max_model_len} plus two in-flight "
        "steps: the engine must finish it (reason 'length') first"
    )
