"""Numpy twin of `deepinfer/sched/_decode_core.pyx`: the per-step decode bookkeeping over rows.

Both versions take the same arrays, mutate them the same way and return the same values; the
tests run the scheduler over each.
"""

from __future__ import annotations

import numpy as np


def count_new_blocks(
    rows: np.ndarray,
    seq_len: np.ndarray,
    num_blocks: np.ndarray,
    query_len: int,
    block_size: int,
    max_blocks: int,
    need_out: np.ndarray,
) -> int:
    """need_out[i] = blocks row rows[i] must add to hold seq_len + query_len tokens.

    Returns the total, or -1 - i for the first i whose block count would pass max_blocks (then
    need_out is unspecified).
    """
    wanted = (seq_len[rows] + (query_len + block_size - 1)) // block_size
    too_long = np.flatnonzero(wanted > max_blocks)
    if len(too_long):
        return -1 - int(too_long[0])
    np.subtract(wanted, num_blocks[rows], out=need_out[: len(rows)])
    return int(need_out[: len(rows)].sum())


def commit_decode(
    rows: np.ndarray,
    need: np.ndarray,
    new_block_ids: np.ndarray,
    query_len: int,
    seq_len: np.ndarray,
    num_inflight: np.ndarray,
    pending_steps: np.ndarray,
    num_blocks: np.ndarray,
    block_table: np.ndarray,
    state_slot: np.ndarray,
    last_token: np.ndarray,
    out_seq_lens: np.ndarray,
    out_state_slots: np.ndarray,
    out_last_tokens: np.ndarray,
) -> int:
    """Reserves one decode step for every row and fills the per-row outputs.

    Appends new_block_ids (consumed in row order, need[i] for rows[i]) to the block-table rows,
    sorts `rows` in place by seq_len descending (stable), then per row in that order emits the
    last token (-1 while a step is in flight), adds query_len to seq_len and num_inflight, one to
    pending_steps, and emits seq_len and state slot. Returns the most blocks of any row.
    """
    num_rows = len(rows)
    offset = 0
    for index in np.flatnonzero(need[:num_rows]):
        row = rows[index]
        count = int(need[index])
        start = int(num_blocks[row])
        block_table[row, start : start + count] = new_block_ids[offset : offset + count]
        num_blocks[row] = start + count
        offset += count
    order = np.argsort(-seq_len[rows], kind="stable")
    rows[:] = rows[order]
    out_last_tokens[:num_rows] = np.where(pending_steps[rows] > 0, -1, last_token[rows])
    seq_len[rows] += query_len
    num_inflight[rows] += query_len
    pending_steps[rows] += 1
    out_seq_lens[:num_rows] = seq_len[rows]
    out_state_slots[:num_rows] = state_slot[rows]
    return int(num_blocks[rows].max()) if num_rows else 0


def gather_block_tables(rows: np.ndarray, block_table: np.ndarray, out: np.ndarray) -> None:
    """out[i] = block_table[rows[i], :out.shape[1]] for out of shape [len(rows), width]."""
    out[:] = block_table[rows, : out.shape[1]]
