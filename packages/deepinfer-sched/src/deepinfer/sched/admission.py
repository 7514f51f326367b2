"""Prefill admission (docs/design.md §3.2): FIFO over the waiting queue under the
token, prompt-count and sum-of-K-lengths budgets, with blocks and the state slot allocated
together at a sequence's first scheduling. With prefix caching (prefix_cache.py) a sequence starts
from its longest cached prefix, and its prefill is cut at its snapshot points (prefix_cache.py) —
cuts that, unlike a budget cut, let other sequences join the step."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np

from .chunking import chunk_len
from .output import PrefillChunk
from .sequence import Hit, SeqStatus, Sequence
from .state import SchedState

_NO_LIMIT = 2**62


def _candidates(st: SchedState, limit: int) -> Iterator[Sequence]:
    """The sequences mid-prefill first, then the waiting queue in order (at most `limit` in all)."""
    started = list(islice(st.prefilling.values(), limit))
    yield from started
    yield from list(islice(st.waiting.values(), limit - len(started)))


def _num_computed(st: SchedState, seq: Sequence) -> int:
    return int(st.table.seq_len[seq.row]) if seq.row >= 0 else 0


def plan_chunk(st: SchedState, seq: Sequence, tokens_left: int, sum_k_left: int, step_is_empty: bool) -> int:
    """Tokens of `seq` that fit this step, 0 if none (budgets, checkpoints, capacity: LATER)."""
    config = st.config
    first = seq.row < 0
    if first and (st.table.num_used >= config.max_num_seqs or st.slots.num_free < 1):
        return 0
    prefix = st.prefix
    hit: Hit | None = None
    if first and prefix is not None:
        hit, seq.snapshot_points = prefix.plan(seq)
    seq.hit = hit
    num_computed = _num_computed(st, seq) if hit is None else hit.num_tokens
    budget = min(tokens_left, sum_k_left - num_computed)
    num_tokens = chunk_len(
        num_computed, seq.num_tokens - num_computed, budget, config.chunk_checkpoints, step_is_empty
    )
    if num_tokens == 0:
        return 0
    for point in seq.snapshot_points:        # a snapshot point ends a chunk of its own
        if num_computed < point < num_computed + num_tokens:
            num_tokens = point - num_computed
            break
    if hit is not None:
        held, taken_free = hit.num_device_blocks, hit.num_free_blocks
    else:
        held, taken_free = (int(st.table.num_blocks[seq.row]) if not first else 0), 0
    if st.blocks_for(num_computed + num_tokens) - held + taken_free > st.kv.num_free:
        return 0
    return num_tokens


def wants_prefill(st: SchedState, has_running: bool) -> bool:
    """This rank's round-one wish: the head of the queue is schedulable now and KV usage is at most
    max_cache_usage_for_prefill — checked with nothing running too (a PROMPT engine's prefilled
    sequences hold their blocks until handed off), except for the rest of a prompt already mid-prefill
    when nothing runs (it holds blocks that only its end frees)."""
    head = next(_candidates(st, 1), None)
    if head is None:
        return False
    continuing = head.key in st.prefilling and not has_running
    if not continuing and st.kv.usage > st.config.max_cache_usage_for_prefill:
        return False
    return plan_chunk(st, head, st.config.max_num_batched_tokens, _sum_k_limit(st), True) > 0


def snapshot_tail_pending(st: SchedState) -> bool | None:
    """Prefix caching: whether a sequence mid-prefill was cut at a snapshot point (its rest should
    follow at once, not at the next attempt point); None with caching off (the vote is then the
    three-int one)."""
    if st.prefix is None:
        return None
    return any(int(st.table.seq_len[seq.row]) in seq.snapshot_points for seq in st.prefilling.values())


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
        if not chunk.completes_prefill and chunk.end not in seq.snapshot_points:
            break   # once a request is chunked (by a budget), no other request joins the step
    if st.prefix is not None:
        st.prefix.commit()
    return tuple(chunks)


def _commit_chunk(st: SchedState, seq: Sequence, num_tokens: int) -> PrefillChunk:
    table = st.table
    num_cached = 0
    if seq.row < 0:
        row = table.acquire(seq)
        slot = int(st.slots.allocate(1)[0])
        table.state_slot[row] = slot
        table.num_output[row] = seq.num_tokens - seq.num_prompt_tokens   # > 0 after a recompute
        hit, seq.hit = seq.hit, None
        if hit is not None and st.prefix is not None:      # a hit is only planned with the cache on
            block_ids, loads = st.prefix.take(seq, hit)
            table.append_blocks(row, block_ids)
            table.seq_len[row] = num_cached = hit.num_tokens
            st.load_blocks += loads
            if hit.snapshot:
                st.restore_states.append((hit.snapshot, slot, num_cached))
            else:
                st.restore_host_states.append((hit.host_snapshot, slot, num_cached))
        else:
            st.zero_states.append(slot)
        if st.prefix is not None:
            st.prefix.queries += seq.num_tokens
            st.prefix.hits += num_cached
    row = seq.row
    start = int(table.seq_len[row])
    end = start + num_tokens
    num_new_blocks = st.blocks_for(end) - int(table.num_blocks[row])
    if num_new_blocks > 0:
        table.append_blocks(row, st.kv.allocate(num_new_blocks))
    table.seq_len[row] = end
    if st.prefix is not None:
        snapshot = st.prefix.computed(seq, table.block_ids(row), start, end)
        if snapshot:
            st.save_states.append((int(table.state_slot[row]), snapshot, end))
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
        st.prefilling[seq.key] = seq
    return PrefillChunk(
        seq_id=seq.seq_id,
        start=start,
        end=end,
        completes_prefill=completes,
        token_ids=np.array(seq.token_ids[start:end], dtype=np.int32),
        block_table=table.block_ids(row).copy(),
        state_slot=int(table.state_slot[row]),
        num_cached_tokens=num_cached,
    )
