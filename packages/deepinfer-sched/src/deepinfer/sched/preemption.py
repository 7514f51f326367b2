"""Decode preemption (docs/design.md §3.3): sequences are picked from the short-output
end (LCFS) and, when blocks run out, victims are taken from the long-output end."""

from __future__ import annotations

import numpy as np

from .sequence import SeqStatus, Sequence
from .state import SchedState


def lcfs_order(st: SchedState, rows: np.ndarray) -> np.ndarray:
    """`rows` sorted by output length descending (ties keep running order): picks come from the
    end, victims from the front."""
    return rows[np.argsort(-st.table.num_output[rows], kind="stable")]


def fit_by_preemption(st: SchedState, rows: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Preempts until the remaining rows' block needs fit the free blocks.

    Args:
        rows: [n] int32 running rows (running order); need: [n] int32 blocks each must add.

    Returns:
        Boolean mask [n] over `rows` of the sequences kept; the others were preempted.
    """
    need_of = dict(zip(rows.tolist(), need[: len(rows)].tolist()))
    order = lcfs_order(st, rows).tolist()
    kept: set[int] = set()
    reserved = 0
    low, high = 0, len(order) - 1
    while low <= high:
        row = order[high]
        if need_of[row] <= st.kv.num_free - reserved:
            reserved += need_of[row]
            kept.add(row)
            high -= 1
        else:
            preempt(st, st.table.seqs[order[low]])   # may be `row` itself when it is the last
            low += 1
    return np.fromiter((row in kept for row in rows.tolist()), dtype=bool, count=len(rows))


def preempt(st: SchedState, seq: Sequence) -> None:
    """Frees a running sequence: finished as "preempted" (stop_preempted_request, a sequence added
    as not recomputable, or one whose tokens plus its next decode step could never fit the cache
    again, so that a recompute would only be preempted once more) or queued at the front of the
    waiting queue to be recomputed from its prompt and output tokens."""
    st.preempted.append(seq.seq_id)
    never_fits = st.blocks_for(seq.num_tokens + st.config.max_query_len) > st.kv.num_blocks - 1
    if st.config.stop_preempted_request or not seq.recomputable or never_fits:
        st.drop(seq)
        return
    st.recomputed.append(seq.seq_id)
    st.unlink(seq)
    st.release_kv(seq)
    seq.status = SeqStatus.WAITING
    seq.awaiting_first_token = False
    st.waiting[seq.key] = seq
    st.waiting.move_to_end(seq.key, last=False)
