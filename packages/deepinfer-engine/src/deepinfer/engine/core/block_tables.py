"""Block tables on the device, one row per scheduler row, brought up to date by diff (issue #17).

A decode step names its sequences' scheduler rows (`DecodeBatch.rows`, stable while a sequence holds
KV) and, per row, the version of its block table (`DecodeBatch.table_versions`), which changes
whenever the row's blocks change other than by appending (a new sequence in the row, a copy-on-write,
a trim). `RowBlockTables` keeps, per row, the version and the number of leading entries its device
row holds (every later entry is 0). A step copies only:

- for a row of the same version: the blocks appended since (columns [held, now));
- for any other row (new in this row, or rewritten): its whole table, plus zeros over whatever the
  row held past it.

The entries go to the device in one non-blocking copy from pinned memory ([2, k] int64: flat index,
block id) and one scatter; the CUDA graphs then gather their rows from `table` on the device.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..device.staging import to_device


class RowBlockTables:
    """The block tables of every scheduler row, on `device`.

    Args:
        max_blocks: the table width (blocks per sequence at most).
        device: where `table` lives.
    """

    def __init__(self, max_blocks: int, device: torch.device | str) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks={max_blocks} must be >= 1")
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        self.table = torch.zeros((0, max_blocks), dtype=torch.int32, device=self.device)  # [rows, max_blocks]
        self._versions = np.zeros(0, dtype=np.int64)     # the table version each device row holds; 0 = none
        self._num_held = np.zeros(0, dtype=np.int64)     # leading entries of each device row; the rest are 0

    def update(self, rows: np.ndarray, table_versions: np.ndarray, block_tables: np.ndarray) -> int:
        """Bring the device rows `rows` to `block_tables` (queued on the device; no wait).

        Args:
            rows: [n] distinct scheduler rows.
            table_versions: [n] int64 their block-table versions (`DecodeBatch.table_versions`).
            block_tables: [n, width] int32 their block ids, 0-padded (block 0 = empty), width <= max_blocks.
        Returns:
            The number of entries copied to the device.
        Raises:
            ValueError: mismatched shapes or a table wider than max_blocks.
        """
        num_rows, width = block_tables.shape
        if rows.shape != (num_rows,) or table_versions.shape != (num_rows,) or width > self.max_blocks:
            raise ValueError(f"rows {list(rows.shape)}, table_versions {list(table_versions.shape)} and "
                             f"block_tables {list(block_tables.shape)} must agree, width <= {self.max_blocks}")
        if not num_rows:
            return 0
        self._ensure(int(rows.max()) + 1)
        held = self._num_held[rows]
        now = np.count_nonzero(block_tables, axis=1)
        # Appended only: the same version, and no fewer blocks than held (anything else is rewritten).
        appended = (self._versions[rows] == table_versions) & (now >= held)
        starts = np.where(appended, held, 0)
        ends = np.where(appended, now, np.maximum(now, held))
        lengths = ends - starts
        total = int(lengths.sum())
        if total:
            seqs = np.repeat(np.arange(num_rows), lengths)
            columns = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths) + starts[seqs]
            values = np.zeros(total, dtype=np.int64)
            inside = columns < width               # past the batch's width: zeros over an old tail
            values[inside] = block_tables[seqs[inside], columns[inside]]
            entries = np.stack((rows[seqs].astype(np.int64) * self.max_blocks + columns, values))
            staged = to_device(entries, self.device)
            self.table.view(-1).index_copy_(0, staged[0], staged[1].to(torch.int32))
        self._versions[rows] = table_versions
        self._num_held[rows] = now
        return total

    def gather(self, rows: Tensor, out: Tensor) -> None:
        """out[i] = table[rows[i]] on the device ([n] int64 rows, out [n, max_blocks] int32 contiguous)."""
        torch.index_select(self.table, 0, rows, out=out)

    def _ensure(self, num_rows: int) -> None:
        """Grow to at least num_rows rows (doubling; new rows hold nothing)."""
        old = self.table.shape[0]
        if num_rows <= old:
            return
        capacity = max(num_rows, 2 * old, 64)
        grown = torch.zeros((capacity, self.max_blocks), dtype=torch.int32, device=self.device)
        grown[:old] = self.table
        self.table = grown
        self._versions = np.concatenate([self._versions, np.zeros(capacity - old, dtype=np.int64)])
        self._num_held = np.concatenate([self._num_held, np.zeros(capacity - old, dtype=np.int64)])
