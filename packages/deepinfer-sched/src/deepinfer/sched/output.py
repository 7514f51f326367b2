"""What `Scheduler.schedule()` hands the engine: one frozen `SchedulerOutput` per step.

Numpy arrays in it belong to the output: the scheduler keeps no reference to them, so they stay
valid after the next `schedule()` (a ZOS engine post-processes step N after scheduling N + 1).
The original design only promises "valid until the next schedule()" (docs/design.md §2); measured,
fresh arrays cost about a microsecond per step, so the stronger promise is kept.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from .sequence import IgnoreReason

__all__ = ["DecodeBatch", "IgnoredSeq", "PrefillChunk", "PrefilledSeq", "SchedulerOutput", "StepKind"]


class StepKind(enum.Enum):
    """The kind of forward this rank runs this step.

    PREFILL: `SchedulerOutput.prefill` holds at least one chunk.
    DECODE: `SchedulerOutput.decode` holds at least one sequence.
    EMPTY_PROMPT: another DP rank prefills, this one has nothing: run an empty prefill forward so
        the EP collectives match.
    EMPTY_DECODE: another DP rank decodes, this one has nothing running: run a padding-only decode.
    IDLE: no rank of the DP group runs a forward this step.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    EMPTY_PROMPT = "empty_prompt"
    EMPTY_DECODE = "empty_decode"
    IDLE = "idle"


@dataclass(frozen=True, slots=True, eq=False)
class PrefillChunk:
    """One sequence's part of a prefill step.

    Attributes:
        seq_id: the sequence.
        start: first token position of the chunk (= tokens already computed before this step).
        end: one past the last position; the chunk is the sequence's tokens [start, end).
        completes_prefill: True when end reaches the sequence's known tokens (its whole prompt, or
            prompt + output for a recomputed sequence): the engine samples the next token and
            calls `append_tokens` with it.
        token_ids: [end - start] int32 token ids of the chunk.
        block_table: [ceil(end / block_size)] int32 block ids covering positions [0, end).
        state_slot: the sequence's state slot (>= 1).
        num_cached_tokens: on the chunk that admits a sequence from the waiting queue, the tokens
            served by the prefix cache (= start; its state slot is restored from a snapshot, see
            `SchedulerOutput.restore_states`); 0 on every other chunk.
    """

    seq_id: str
    start: int
    end: int
    completes_prefill: bool
    token_ids: np.ndarray
    block_table: np.ndarray
    state_slot: int
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True, eq=False)
class DecodeBatch:
    """The sequences of a decode step, sorted by seq_lens descending (ties keep the previous
    step's order, newcomers after).

    Attributes:
        seq_ids: [num_seqs] ids.
        rows: [num_seqs] int32 scheduler row of each sequence: stable while the sequence holds KV,
            reused after it finishes (a cheap key for the engine's per-sequence buffers).
        query_lens: [num_seqs] int32 query tokens to feed, in [1, nextn + 1]; the last sampled
            token plus drafts. Each sequence reserved nextn + 1 positions regardless.
        seq_lens: [num_seqs] int32 K length after this step: positions [seq_len - nextn - 1,
            seq_len) are this step's reserved query positions.
        block_tables: [num_seqs, max_num_blocks] int32 block ids, 0-padded (block 0 = empty).
        state_slots: [num_seqs] int32 state slot of each sequence (>= 1).
        last_token_ids: [num_seqs] int32 last known token of each sequence; meaningless where
            `in_flight` (the engine takes those rows' input tokens from their step in flight).
        table_versions: [num_seqs] int64 version of each row's block table: equal in two decode
            batches only if the row's table changed in between by appended blocks alone (no new
            sequence in the row, copy-on-write or trim), so a per-row copy kept elsewhere can be
            brought up to date by copying the appended entries (never reused; 0 = none).
        in_flight: [num_seqs] bool, True where an earlier decode step of the sequence is still in
            flight (ZOS: its tokens have not been appended yet), so its last token is on the device.
        rows_generation: changes whenever the step's rows or their ids differ from the previous
            decode step's (unique over the process); equal in two batches only when both have the
            same sequences in the same rows, in the same order (`seq_ids` is then the same tuple).
    """

    seq_ids: tuple[str, ...]
    rows: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    state_slots: np.ndarray
    last_token_ids: np.ndarray
    table_versions: np.ndarray
    in_flight: np.ndarray
    rows_generation: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


@dataclass(frozen=True, slots=True)
class IgnoredSeq:
    """A waiting sequence dropped without running; it holds nothing and is forgotten."""

    seq_id: str
    reason: IgnoreReason


EMPTY_PAIRS = np.zeros((0, 2), dtype=np.int32)
EMPTY_PAIRS.flags.writeable = False
EMPTY_TRIPLES = np.zeros((0, 3), dtype=np.int32)
EMPTY_TRIPLES.flags.writeable = False
EMPTY_SLOTS = np.zeros(0, dtype=np.int32)
EMPTY_SLOTS.flags.writeable = False


@dataclass(frozen=True, slots=True, eq=False)
class SchedulerOutput:
    """Everything the engine needs for one step.

    Before the forward, in this order: `spill_blocks` and `spill_snapshots` (copies out of what the
    step overwrites), `load_blocks`, `clone_states`, `clone_blocks`, `zero_states`, `restore_states`
    and `restore_host_states`; after it, `save_states`. The prefix-cache lists are empty with prefix
    caching off, and the host ones without its host tier. A snapshot keeps only what a sequence
    standing at a block boundary needs, so restoring and saving one names that position.

    Attributes:
        kind: the forward to run (`StepKind`).
        prefill: chunks of a PREFILL step, in admission (FIFO) order; empty otherwise.
        decode: the batch of a DECODE step; None otherwise.
        clone_states: [k, 2] int32 (src, dst) state slot copies (fork copy-on-write).
        clone_blocks: [k, 2] int32 (src, dst) KV block copies (fork copy-on-write of the last,
            partly written block).
        zero_states: [k] int32 state slots to zero (sequences admitted fresh this step).
        restore_states: [k, 3] int32 (snapshot slot, state slot, position): prefix-cache hits; put
            the snapshot, saved at that position, into the sequence's new state slot (instead of
            zeroing it).
        restore_host_states: [k, 3] int32 (host snapshot, state slot, position): the same from the
            host tier's snapshot pool.
        save_states: [k, 3] int32 (state slot, snapshot slot, position): prefix-cache snapshots;
            save the state a prefill chunk leaves (it ends on a block boundary, at that position)
            into the snapshot slot once the step's forward has run. Snapshot slots are ids of the
            scheduler's snapshot `BlockManager` (1 .. num_snapshots), not state slots.
        spill_blocks: [k, 2] int32 (KV block, host block): cached blocks evicted this step, copied
            into the host tier's block pool before anything overwrites them.
        spill_snapshots: [k, 2] int32 (snapshot slot, host snapshot): the same for snapshots.
        load_blocks: [k, 2] int32 (host block, KV block): a hit's blocks from the host tier, copied
            into their new KV blocks.
        ignored: waiting sequences dropped since the last step, with reasons.
        preempted_seq_ids: sequences preempted this step (in preemption order). Those not in
            `recomputed_seq_ids` are finished (reason "preempted"); the engine drops results of
            the in-flight steps of all of them.
        recomputed_seq_ids: the preempted sequences that were freed and queued at the front of the
            waiting queue for recompute (stop_preempted_request=False, a recomputable sequence
            that fits the cache with its next step); a subset of preempted_seq_ids, same order.
        num_decode_steps: decode steps the DP group has run so far (drives the attempt points).
    """

    kind: StepKind
    prefill: tuple[PrefillChunk, ...] = ()
    decode: DecodeBatch | None = None
    clone_states: np.ndarray = field(default_factory=lambda: EMPTY_PAIRS)
    clone_blocks: np.ndarray = field(default_factory=lambda: EMPTY_PAIRS)
    zero_states: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    restore_states: np.ndarray = field(default_factory=lambda: EMPTY_TRIPLES)
    save_states: np.ndarray = field(default_factory=lambda: EMPTY_TRIPLES)
    restore_host_states: np.ndarray = field(default_factory=lambda: EMPTY_TRIPLES)
    spill_blocks: np.ndarray = field(default_factory=lambda: EMPTY_PAIRS)
    spill_snapshots: np.ndarray = field(default_factory=lambda: EMPTY_PAIRS)
    load_blocks: np.ndarray = field(default_factory=lambda: EMPTY_PAIRS)
    ignored: tuple[IgnoredSeq, ...] = ()
    preempted_seq_ids: tuple[str, ...] = ()
    recomputed_seq_ids: tuple[str, ...] = ()
    num_decode_steps: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class PrefilledSeq:
    """Where the transferred KV and state of a sequence admitted by `add_prefilled_seq` go.

    Attributes:
        seq_id: the sequence.
        block_table: [ceil(num_prompt_tokens / block_size)] int32 block ids for positions
            [0, num_prompt_tokens).
        state_slot: its state slot (>= 1).
    """

    seq_id: str
    block_table: np.ndarray
    state_slot: int
