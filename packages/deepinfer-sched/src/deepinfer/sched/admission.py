"""Prefill admission (docs/design.md §3.2): FIFO over the waiting queue under the
token, prompt-count and sum-of-K-lengths budgets, with blocks and the state slot allocated
together at a sequence's first scheduling."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np

from .chunking import chunk_len
from .output import PrefillChunk
from .sequence import SeqStatus, Sequence
from .state import SchedState

_NO_LIMIT = 2**62


def _candidates(st: SchedState, limit: int) -> Iterator[Sequence]:
    """The sequence mid-prefill first, then the waiting queue in order (at most `limit`)."""
    if st.prefilling is not None:
        yield st.prefilling
        limit -= 1
    yield from list(islice(st.waiting.values(), limit))


def _num_computed(st: SchedState, seq: Sequence) -> int:
    return int(st.table.seq_len[seq.row]) if seq.row >= 0 else 0


def plan_chunk(st: SchedState, seq: Sequence, tokens_left: int, sum_k_left: int, step_is_empty: bool) -> int:
    """Tokens of `seq` that fit this step, 0 if none (budgets, checkpoints, capacity: LATER)."""
    config = st.config
    first = seq.row < 0
    if first and (st.table.num_used >= config.max_num_seqs or st.slots.num_free < 1):
        return 0
    num_computed = _num_computed(st, seq)
    budget = min(tokens_left, sum_k_left - num_computed)
    num_tokens = chunk_len(
        num_computed, seq.num_tokens - num_computed, budget, config.chunk_checkpoints, step_is_empty
    )
    if num_tokens == 0:
        return 0
    held = int(st.table.num_blocks[seq.row]) if not first else 0
    if st.blocks_for(num_computed + num_tokens) - held > st.kv.num_free:
        return 0
    return num_tokens


def wants_prefill(st: SchedState, has_running: bool) -> bool:
    """This rank's round-one wish: the head of the queue is schedulable now and, while something
    is running, KV usage is at most max_cache_usage_for_prefill."""
    head = next(_candidates(st, 1), None)
    if head is None:
        return False
    if has_running and st.kv.usage > st.config.max_cache_usage_for_prefill:
        return False
    return plan_chunk(st, head, st.config.max_num_batched_tokens, _sum_k_limit(st), True) > 0


def _sum_k_limit(st: SchedState) -> int:
    limit = st.config.prefill_max_sum_seqlen_k
    return _NO_LIMIT if limit is None else limit


def schedule_prefill(st: SchedState) -> tuple[PrefillChunk, ...]:
    """Admits chunks FIFO until a budget, the prompt count, capacity or a chunk cut stops it."""
    config = st.config
    chunks: list[PrefillChunk] = []
    tokens_left = config.max_num_batched_tokens
    sum_k_left = _sum_k_limit(st)
    for seq in _candidates(st, config.prompt_limit):
        num_tokens = plan_chunk(st, seq, tokens_left, sum_k_left, not chunks)
        if num_tokens == 0:
            break
        chunk = _commit_chunk(st, seq, num_tokens)
        chunks.append(chunk)
        tokens_left -= num_tokens
        sum_k_left -= chunk.end
        if not chunk.completes_prefill:
            break   # once a request is chunked, no other request joins the step
    return tuple(chunks)


def _commit_chunk(st: SchedState, seq: Sequence, num_tokens: int) -> PrefillChunk:
    table = st.table
    if seq.row < 0:
        row = table.acquire(seq)
        slot = int(st.slots.allocate(1)[0])
        table.state_slot[row] = slot
        table.num_output[row] = seq.num_tokens - seq.num_prompt_tokens   # > 0 after a recompute
        st.zero_states.append(slot)
    row = seq.row
    start = int(table.seq_len[row])
    end = start + num_tokens
    num_new_blocks = st.blocks_for(end) - int(table.num_blocks[row])
    if num_new_blocks > 0:
        table.append_blocks(row, st.kv.allocate(num_new_blocks))
    table.seq_len[row] = end
    st.unlink(seq)
    completes = end == seq.num_tokens
    if completes:
        seq.status = SeqStatus.PROMPTED
        seq.awaiting_first_token = True
        table.pending_steps[row] += 1
        table.last_token[row] = seq.token_ids[-1]
        st.prompted[seq.key] = seq
    else:
        seq.status = SeqStatus.PREFILLING
        st.prefilling = seq
    return PrefillChunk(
        seq_id=seq.seq_id,
        start=start,
        end=end,
        completes_prefill=completes,
        token_ids=np.array(seq.token_ids[start:end], dtype=np.int32),
        block_table=table.block_ids(row).copy(),
        state_slot=int(table.state_slot[row]),
    )
