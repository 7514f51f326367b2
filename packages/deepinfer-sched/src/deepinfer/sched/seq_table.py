"""Flat per-row arrays of the sequences that hold KV (hot bookkeeping in flat arrays, docs/design.md §3).

A sequence gets a row when it first gets KV blocks and gives it back when it finishes or is freed
for recompute; rows are reused lowest-first. Arrays grow by doubling.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from .sequence import Sequence

_COUNTERS = (
    "seq_len",        # KV positions written or reserved: computed + in-flight tokens
    "num_inflight",   # query tokens reserved by decode steps awaiting append_tokens
    "pending_steps",  # scheduled steps whose sampled token(s) are not appended yet
    "num_blocks",     # entries used in the block-table row
    "state_slot",     # 0 = none (dummy slot)
    "last_token",     # last known token id (prompt end or last appended output)
    "num_output",     # output tokens appended so far
    "num_branches",   # fork branches still waiting for their copy-on-write (parent is held)
)


class SeqTable:
    """Row-indexed int32 arrays plus the [rows, max_blocks_per_seq] block table (0 = empty)."""

    def __init__(self, capacity: int, max_blocks_per_seq: int) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.capacity = 0
        self.block_table = np.zeros((0, max_blocks_per_seq), dtype=np.int32)
        for name in _COUNTERS:
            setattr(self, name, np.zeros(0, dtype=np.int32))
        self.seqs: list[Sequence | None] = []
        self.ids = np.empty(0, dtype=object)   # row -> current seq id (for fast id gathers)
        self.ids_version = 0                   # bumped whenever a row's id changes
        # row -> version of its block-table row: a new one whenever the row's blocks change other than
        # by appending (a new sequence in the row, a copy-on-write, a trim); never reused
        self.table_version = np.zeros(0, dtype=np.int64)
        self._num_table_versions = 0
        self._free_rows: list[int] = []
        self._grow(max(capacity, 1))

    seq_len: np.ndarray
    num_inflight: np.ndarray
    pending_steps: np.ndarray
    num_blocks: np.ndarray
    state_slot: np.ndarray
    last_token: np.ndarray
    num_output: np.ndarray
    num_branches: np.ndarray

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free_rows)

    def acquire(self, seq: Sequence) -> int:
        """Gives `seq` a zeroed row and returns it."""
        if not self._free_rows:
            self._grow(2 * self.capacity)
        row = self._free_rows.pop()
        self.seqs[row] = seq
        self.rename(row, seq.seq_id)
        self.new_table_version(row)
        seq.row = row
        return row

    def rename(self, row: int, seq_id: str | None) -> None:
        self.ids[row] = seq_id
        self.ids_version += 1

    def new_table_version(self, row: int) -> None:
        """Marks the row's block table as changed other than by appended blocks."""
        self._num_table_versions += 1
        self.table_version[row] = self._num_table_versions

    def release(self, seq: Sequence) -> None:
        """Zeroes `seq`'s row (block ids must already be freed) and returns it to the pool."""
        row = seq.row
        self.block_table[row, : self.num_blocks[row]] = 0
        for name in _COUNTERS:
            getattr(self, name)[row] = 0
        self.seqs[row] = None
        self.rename(row, None)
        self._free_rows.append(row)
        seq.row = -1

    def seqs_of(self, rows: list[int]) -> list[Sequence]:
        """The sequences of `rows`, each of which holds one (the rows of running sequences do)."""
        return cast("list[Sequence]", [self.seqs[row] for row in rows])

    def block_ids(self, row: int) -> np.ndarray:
        """[num_blocks] int32 view of the row's block ids."""
        return self.block_table[row, : self.num_blocks[row]]

    def append_blocks(self, row: int, block_ids: np.ndarray) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_seq:
            raise ValueError(
                f"sequence {self.ids[row]!r} needs {end} blocks, more than max_blocks_per_seq="
                f"{self.max_blocks_per_seq} (did the engine miss a length stop?)"
            )
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        table = np.zeros((capacity, self.max_blocks_per_seq), dtype=np.int32)
        table[:old] = self.block_table
        self.block_table = table
        for name in _COUNTERS:
            array = np.zeros(capacity, dtype=np.int32)
            array[:old] = getattr(self, name)
            setattr(self, name, array)
        versions = np.zeros(capacity, dtype=np.int64)
        versions[:old] = self.table_version
        self.table_version = versions
        ids = np.empty(capacity, dtype=object)
        ids[:old] = self.ids
        self.ids = ids
        self.seqs.extend([None] * (capacity - old))
        self._free_rows.extend(range(capacity - 1, old - 1, -1))   # pop() hands out the lowest
        self.capacity = capacity
