"""Engine -> scheduler calls on single sequences: add, admit prefilled, abort, finish, append
sampled tokens, and the read-only view."""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from .config import EngineType
from .output import IgnoredSeq, PrefilledSeq
from .sequence import BRANCH_PREFIX, FinishReason, IgnoreReason, SeqStatus, Sequence, SeqView
from .state import SchedState

if TYPE_CHECKING:
    from .decode import DecodeScratch

_awaiting_first_token = attrgetter("awaiting_first_token")

_TOKEN_LIMIT = 2**31
_ENGINE_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR,
                   FinishReason.PREFILLED)   # the reasons the engine decides (`finish_seq`)


def _as_tokens(token_ids: Iterable[int], field: str) -> list[int]:
    """Token ids as a list of ints in [0, 2**31); bools, floats and nested input are refused."""
    if isinstance(token_ids, (list, tuple)) and all(type(t) is int for t in token_ids):
        _check_range(token_ids, field)
        return list(token_ids)
    array = np.asarray(token_ids if isinstance(token_ids, np.ndarray) else list(token_ids))
    if array.size == 0:
        return []
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{field} must be a 1-D sequence of ints, got shape {array.shape} {array.dtype}")
    if int(array.min()) < 0 or int(array.max()) >= _TOKEN_LIMIT:
        bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
        raise ValueError(f"{field} holds token id {bad}, outside [0, {_TOKEN_LIMIT})")
    return array.tolist()


def _shared_tokens(token_ids: object, field: str) -> list[int]:
    """The caller's list itself (share_list=True), checked as `_as_tokens` checks the ids it copies."""
    if type(token_ids) is not list or not all(type(t) is int for t in token_ids):
        raise ValueError(f"share_list=True needs {field} as a list of ints (kept, not copied), "
                         f"got {type(token_ids).__name__}")
    _check_range(token_ids, field)
    return token_ids


def _check_range(tokens: list[int] | tuple[int, ...], field: str) -> None:
    if tokens and not (0 <= min(tokens) and max(tokens) < _TOKEN_LIMIT):
        bad = next(t for t in tokens if not 0 <= t < _TOKEN_LIMIT)
        raise ValueError(f"{field} holds token id {bad}, outside [0, {_TOKEN_LIMIT})")


def _check_new(st: SchedState, seq_id: object, max_tokens: object) -> None:
    if not isinstance(seq_id, str) or not seq_id:
        raise ValueError(f"seq_id must be a non-empty str, got {seq_id!r}")
    if seq_id.startswith(BRANCH_PREFIX):
        raise ValueError(f"seq_id={seq_id!r} must not start with {BRANCH_PREFIX!r} (fork branch ids)")
    if seq_id in st.seqs:
        raise ValueError(f"seq_id={seq_id!r} is already a live sequence")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")


def add_seq(
    st: SchedState, seq_id: str, prompt_token_ids: Iterable[int], max_tokens: int, recomputable: bool = True,
    share_list: bool = False, use_prefix_cache: bool = True,
) -> None:
    if st.config.engine_type is EngineType.COMPLETION:
        raise ValueError("engine_type=COMPLETION cannot prefill; admit sequences with add_prefilled_seq")
    _check_new(st, seq_id, max_tokens)
    for name, flag in (("recomputable", recomputable), ("share_list", share_list),
                       ("use_prefix_cache", use_prefix_cache)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r} must be a bool")
    if share_list:
        tokens = _shared_tokens(prompt_token_ids, "prompt_token_ids")
    else:
        tokens = _as_tokens(prompt_token_ids, "prompt_token_ids")
    reason = None
    if not tokens:
        reason = IgnoreReason.EMPTY_PROMPT
    elif len(tokens) > st.config.max_model_len:
        reason = IgnoreReason.PROMPT_TOO_LONG
    elif st.blocks_for(len(tokens)) > st.kv.num_blocks - 1:
        reason = IgnoreReason.PROMPT_EXCEEDS_KV_CAPACITY
    if reason is not None:
        st.pending_ignored.append(IgnoredSeq(seq_id, reason))
        return
    seq = Sequence(seq_id, tokens, max_tokens, st.next_arrival(), share_list)
    seq.recomputable = recomputable
    seq.use_prefix_cache = use_prefix_cache
    st.register(seq)
    st.waiting[seq_id] = seq


def add_prefilled_seq(
    st: SchedState, seq_id: str, prompt_token_ids: Iterable[int], first_token_id: int, max_tokens: int,
    share_list: bool = False,
) -> PrefilledSeq | None:
    _check_new(st, seq_id, max_tokens)
    if not isinstance(share_list, bool):
        raise ValueError(f"share_list={share_list!r} must be a bool")
    (first,) = _as_tokens([first_token_id], "first_token_id")
    if share_list:
        tokens = _shared_tokens(prompt_token_ids, "prompt_token_ids")
        if not tokens or tokens[-1] != first:
            raise ValueError("share_list=True: prompt_token_ids must hold the prompt followed by first_token_id")
        num_prompt_tokens = len(tokens) - 1
    else:
        tokens = _as_tokens(prompt_token_ids, "prompt_token_ids")
        num_prompt_tokens = len(tokens)
    if not 1 <= num_prompt_tokens <= st.config.max_model_len:
        raise ValueError(
            f"len(prompt_token_ids)={num_prompt_tokens} out of range: must be in [1, {st.config.max_model_len}]"
        )
    num_blocks = st.blocks_for(num_prompt_tokens)
    if st.table.num_used >= st.config.max_num_seqs or st.slots.num_free < 1 or st.kv.num_free < num_blocks:
        return None
    if not share_list:
        tokens.append(first)
    seq = Sequence(seq_id, tokens, max_tokens, st.next_arrival(), share_list)
    seq.num_prompt_tokens = num_prompt_tokens
    seq.status = SeqStatus.PROMPTED
    table = st.table
    row = table.acquire(seq)
    table.state_slot[row] = int(st.slots.allocate(1)[0])
    table.append_blocks(row, st.kv.allocate(num_blocks))
    table.seq_len[row] = num_prompt_tokens
    table.last_token[row] = first
    table.num_output[row] = 1
    st.register(seq)
    st.prompted[seq_id] = seq
    return PrefilledSeq(seq_id, table.block_ids(row).copy(), int(table.state_slot[row]))


def abort_seq(st: SchedState, seq_id: str) -> None:
    seq = st.lookup(seq_id)
    if seq.status is SeqStatus.WAITING:
        st.pending_ignored.append(IgnoredSeq(seq.seq_id, IgnoreReason.ABORTED))
    st.drop(seq)


def finish_seq(st: SchedState, seq_id: str, reason: FinishReason) -> None:
    try:
        known: FinishReason | None = FinishReason(reason)
    except ValueError:
        known = None
    if known not in _ENGINE_REASONS:
        allowed = ", ".join(r.value for r in _ENGINE_REASONS)
        raise ValueError(f"reason must be one of {allowed} (preemption is the scheduler's decision)")
    st.drop(st.lookup(seq_id))


def append_tokens(st: SchedState, seq_id: str, token_ids: Iterable[int]) -> None:
    seq = st.lookup(seq_id)
    table = st.table
    row = seq.row
    if row < 0 or table.pending_steps[row] == 0:
        raise ValueError(f"seq_id={seq_id!r} has no step in flight to append tokens for")
    tokens = _as_tokens(token_ids, "token_ids")
    if seq.shared_list and seq.token_ids[seq.num_prompt_tokens + int(table.num_output[row]):] != tokens:
        raise ValueError(f"seq_id={seq_id!r} shares its token list (share_list=True): append token_ids to "
                         "that list first, then hand them to append_tokens")
    if seq.awaiting_first_token:
        if len(tokens) != 1:
            raise ValueError(
                f"len(token_ids)={len(tokens)}: after its last prefill chunk {seq_id!r} takes exactly 1 token"
            )
        seq.awaiting_first_token = False
    else:
        query_len = st.config.max_query_len
        if not 1 <= len(tokens) <= query_len:
            raise ValueError(f"len(token_ids)={len(tokens)} out of range: must be in [1, {query_len}]")
        table.num_inflight[row] -= query_len
        table.seq_len[row] -= query_len - len(tokens)
        if len(tokens) < query_len:
            _trim_blocks(st, row)
    table.pending_steps[row] -= 1
    if not seq.shared_list:
        seq.token_ids.extend(tokens)
    table.num_output[row] += len(tokens)
    table.last_token[row] = tokens[-1]


def _trim_blocks(st: SchedState, row: int) -> None:
    """Frees tail blocks left unused by rejected drafts (never shared: fork shares only computed KV)."""
    table = st.table
    keep = st.blocks_for(int(table.seq_len[row]))
    held = int(table.num_blocks[row])
    if held > keep:
        st.kv.free(table.block_table[row, keep:held].copy())
        table.block_table[row, keep:held] = 0
        table.num_blocks[row] = keep
        table.new_table_version(row)


def view(st: SchedState, seq: Sequence) -> SeqView:
    row = seq.row
    table = st.table
    if row >= 0:
        inflight = int(table.num_inflight[row])
        computed = int(table.seq_len[row]) - inflight
        block_ids = tuple(table.block_ids(row).tolist())
        slot = int(table.state_slot[row])
    else:
        inflight = computed = slot = 0
        block_ids = ()
    return SeqView(
        seq_id=seq.seq_id,
        status=seq.status,
        prompt_token_ids=tuple(seq.token_ids[: seq.num_prompt_tokens]),
        output_token_ids=tuple(seq.token_ids[seq.num_prompt_tokens :]),
        max_tokens=seq.max_tokens,
        num_computed_tokens=computed,
        num_inflight_tokens=inflight,
        block_ids=block_ids,
        state_slot=slot,
    )


def append_decode_tokens(
    st: SchedState, seq_ids: tuple[str, ...], token_ids: np.ndarray, num_accepted: np.ndarray,
    scratch: DecodeScratch | None = None,
) -> int:
    """Batched `append_tokens` for one decode step's sequences; see Scheduler.append_decode_tokens.
    `scratch`: the decode step's, whose last batch gives the rows when seq_ids is still its tuple."""
    tokens, accepted = _checked_decode_arrays(st, seq_ids, token_ids, num_accepted)
    if not seq_ids:
        return 0
    _check_token_range(tokens, accepted)
    query_len = st.config.max_query_len
    rows_and_seqs = None if scratch is None else scratch.last_batch(st.table, seq_ids)
    if rows_and_seqs is not None and tokens.shape[1] == 1 and query_len == 1:
        return _append_one_each(st, *rows_and_seqs, tokens[:, 0])
    targets, tokens, accepted = _running_targets(st, seq_ids, tokens, accepted)
    rows = [seq.row for seq in targets]
    row_array = np.array(rows, dtype=np.int32)
    _check_in_flight(st, targets, rows, row_array)
    if st.num_owned_lists:     # a shared list's owner has appended the kept tokens already
        _append_kept(st, targets, tokens, accepted)
    kept_counts = accepted.astype(np.int32)
    table = st.table
    table.pending_steps[row_array] -= 1
    table.num_inflight[row_array] -= query_len
    table.seq_len[row_array] -= query_len - kept_counts
    table.num_output[row_array] += kept_counts
    table.last_token[row_array] = tokens[np.arange(len(rows)), kept_counts - 1]
    for row in row_array[kept_counts < query_len].tolist():
        _trim_blocks(st, row)
    return len(rows)


def _checked_decode_arrays(st: SchedState, seq_ids: tuple[str, ...], token_ids: np.ndarray,
                           num_accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.asarray(token_ids)
    accepted = np.asarray(num_accepted)
    num_seqs = len(seq_ids)
    query_len = st.config.max_query_len
    if tokens.ndim != 2 or tokens.shape[0] != num_seqs or not 1 <= tokens.shape[1] <= query_len \
            or tokens.dtype.kind not in "iu":
        raise ValueError(
            f"token_ids has shape {tokens.shape} dtype {tokens.dtype}; expected [{num_seqs}, k] "
            f"integers with k in [1, {query_len}]"
        )
    if accepted.shape != (num_seqs,) or accepted.dtype.kind not in "iu":
        raise ValueError(f"num_accepted has shape {accepted.shape} dtype {accepted.dtype}; expected [{num_seqs}] ints")
    return tokens, accepted


def _check_token_range(tokens: np.ndarray, accepted: np.ndarray) -> None:
    if int(accepted.min()) < 1 or int(accepted.max()) > tokens.shape[1]:
        raise ValueError(f"num_accepted holds values outside [1, {tokens.shape[1]}]")
    if int(tokens.min()) < 0 or int(tokens.max()) >= _TOKEN_LIMIT:
        raise ValueError(f"token_ids holds ids outside [0, {_TOKEN_LIMIT})")


def _running_targets(st: SchedState, seq_ids: tuple[str, ...], tokens: np.ndarray,
                     accepted: np.ndarray) -> tuple[list[Sequence], np.ndarray, np.ndarray]:
    """The sequences of `seq_ids` still running with their rows of tokens and counts (a sequence
    finished or preempted since the step was scheduled is dropped)."""
    running = SeqStatus.RUNNING
    found = list(map(st.seqs.get, seq_ids))
    targets = [seq for seq in found if seq is not None and seq.status is running]
    if len(targets) < len(found):
        kept = [i for i, seq in enumerate(found) if seq is not None and seq.status is running]
        tokens, accepted = tokens[kept], accepted[kept]
    return targets, tokens, accepted


def _check_in_flight(st: SchedState, targets: list[Sequence], rows: list[int], row_array: np.ndarray) -> None:
    stale = [seq.seq_id for seq in targets if seq.awaiting_first_token] or \
        [targets[i].seq_id for i in np.flatnonzero(st.table.pending_steps[row_array] == 0).tolist()]
    if stale:
        raise ValueError(f"seq_id={stale[0]!r} has no decode step in flight")
    if len(set(rows)) != len(rows):
        raise ValueError("seq_ids lists a sequence twice")


def _append_kept(st: SchedState, targets: list[Sequence], tokens: np.ndarray, accepted: np.ndarray) -> None:
    """Each sequence's kept tokens onto the token lists the scheduler owns."""
    if tokens.shape[1] == 1:   # one token each (nextn = 0): no per-sequence lists to build
        _append_each(st, targets, tokens[:, 0].tolist())
        return
    all_owned = st.num_owned_lists == len(st.seqs)
    for seq, row_tokens, count in zip(targets, tokens.tolist(), accepted.tolist()):
        if all_owned or not seq.shared_list:
            seq.token_ids.extend(row_tokens[:count])


def _append_one_each(
    st: SchedState, rows: np.ndarray, seqs: list[Sequence], maybe_awaiting: bool, tokens: np.ndarray
) -> int:
    """`append_decode_tokens` of one token per sequence for the rows of the last decode batch, which
    still hold the same live, running sequences (`DecodeScratch.last_batch`): no per-sequence lookups."""
    table = st.table
    if not (table.pending_steps[rows] > 0).all() or (maybe_awaiting and any(map(_awaiting_first_token, seqs))):
        stale = next(seq.seq_id for seq, row in zip(seqs, rows.tolist())
                     if seq.awaiting_first_token or table.pending_steps[row] == 0)
        raise ValueError(f"seq_id={stale!r} has no decode step in flight")
    if st.num_owned_lists:
        _append_each(st, seqs, tokens.tolist())
    query_len = st.config.max_query_len
    table.pending_steps[rows] -= 1
    table.num_inflight[rows] -= query_len
    table.seq_len[rows] -= query_len - 1
    table.num_output[rows] += 1
    table.last_token[rows] = tokens
    return len(seqs)


def _append_each(st: SchedState, seqs: list[Sequence], tokens: list[int]) -> None:
    """Appends one token to each sequence's list that the scheduler owns (a shared list's owner has
    appended it already)."""
    if st.num_owned_lists == len(st.seqs):     # no shared list: no per-sequence check
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
        return
    for seq, token in zip(seqs, tokens):
        if not seq.shared_list:
            seq.token_ids.append(token)
