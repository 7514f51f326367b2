"""Sequence records: statuses, finish and ignore reasons, the internal record and its public view."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

__all__ = ["BranchId", "FinishReason", "IgnoreReason", "SeqStatus", "SeqView", "TokenLog", "seq_key"]

BRANCH_PREFIX = "_"     # how a `BranchId` is spelled; no other sequence id starts with it (`add_seq` refuses)


@dataclass(frozen=True, slots=True)
class Hit:
    """A sequence's longest usable cached prefix: its blocks and the snapshot at its end, each on
    the device or in the host tier (host_tier.py)."""

    num_tokens: int
    block_ids: np.ndarray     # [num_tokens // block_size] int32 KV blocks; 0 = in host memory only
    snapshot: int             # snapshot slot id (>= 1), or 0: the snapshot is in host memory
    num_free_blocks: int      # of block_ids, those on the free list (they leave it when taken)
    host_block_ids: np.ndarray | None = None   # [num_tokens // block_size] int32 host block where block_ids is 0
    host_snapshot: int = 0    # host snapshot id where snapshot is 0

    @property
    def num_device_blocks(self) -> int:
        """Blocks taken by reference (the rest are allocated and loaded from host memory)."""
        return int(np.count_nonzero(self.block_ids))


class SeqStatus(enum.Enum):
    """Where a sequence is in its life.

    WAITING: queued for prefill (nothing computed, or everything freed for a recompute).
    PREFILLING: part of its prompt is computed; its next chunk goes first in the next prefill step.
    PROMPTED: prefill done (or forked, or admitted prefilled); joins the running set at the next
        decode step.
    RUNNING: decoding.
    """

    WAITING = "waiting"
    PREFILLING = "prefilling"
    PROMPTED = "prompted"
    RUNNING = "running"


class FinishReason(str, enum.Enum):
    """Why a sequence (and the engine's request) finished: one type for the scheduler and the engine,
    whose outputs carry it; a str whose value is the reason's name as users see it ("stop", ...).

    The engine decides STOP, LENGTH, ABORT, ERROR (a fault, a token its grammar rejected) and PREFILLED
    (a PROMPT engine handed the request on) and tells the scheduler through `Scheduler.finish_seq`; the
    scheduler decides PREEMPTED (the cache is full) and IGNORED (`SchedulerOutput.ignored`).
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    PREEMPTED = "preempted"
    IGNORED = "ignored"
    ERROR = "error"
    PREFILLED = "prefilled"

    def __str__(self) -> str:
        return self.value


class IgnoreReason(str, enum.Enum):
    """Why a waiting sequence was dropped without running."""

    EMPTY_PROMPT = "empty prompt"
    PROMPT_TOO_LONG = "prompt longer than max_model_len"
    PROMPT_EXCEEDS_KV_CAPACITY = "prompt needs more KV blocks than the cache holds"
    ABORTED = "aborted"


class TokenLog(list):
    """A sequence's token history (its prompt, then each output token kept), kept once and shared
    with the scheduler: `Scheduler.add_seq(..., share_list=True)`, `add_prefilled_seq(...,
    share_list=True)` and `fork_seq(..., branch_lists=...)` take it as the sequence's history and read
    it in place (prefill chunks, a recompute after preemption, a fork), never writing it.

    It has one writer, its owner (the engine's request): each token the owner keeps is appended here
    before the owner hands it to `append_tokens` / `append_decode_tokens`, which then only count it
    (`check_integrity` checks each log's length). The scheduler takes no other list in place: a plain
    list given with share_list=True is refused."""

    __slots__ = ()


class BranchId(str):
    """The id of a fork branch whose copy-on-write is still pending (docs/design.md §3.4):
    `BranchId(key)` for the branch stored under `key`, spelled "_" + key. Once the branch has its own
    state slot and last block, its id is its key alone (`Sequence.seq_id`).

    It is a `str`, so it keys dicts, compares equal to its spelling and travels wherever an id does;
    `seq_key` maps either id of a branch (this one, its spelling as a plain str, or its key) to the key.
    """

    __slots__ = ()

    def __new__(cls, key: str) -> BranchId:
        return super().__new__(cls, BRANCH_PREFIX + key)

    def __getnewargs__(self) -> tuple[str]:      # pickle and copy rebuild it from its key
        return (self.key,)

    @property
    def key(self) -> str:
        """The key the branch is stored under, and its id once copied."""
        return self[len(BRANCH_PREFIX):]


def seq_key(seq_id: str) -> str:
    """The key a sequence is stored under, from any of its ids: a fork branch's `BranchId` (or its
    spelling as a plain str) gives the branch's key; every other id is its own key."""
    return seq_id[len(BRANCH_PREFIX):] if seq_id.startswith(BRANCH_PREFIX) else seq_id


class Sequence:
    """Mutable per-sequence record owned by the scheduler (never handed out; see `SeqView`).

    `token_ids` is the sequence's one token history (prompt, then outputs): what a prefill chunk and
    a recompute read and a fork copies.

    Counters the decode hot path touches (KV length, blocks, in-flight steps, ...) live in the
    flat arrays of `SeqTable`, at index `row`; a sequence holds a row only while it holds KV.
    """

    __slots__ = (
        "key",
        "token_ids",
        "num_prompt_tokens",
        "max_tokens",
        "status",
        "row",
        "arrival",
        "awaiting_first_token",
        "uncopied",
        "parent",
        "num_forks",
        "recomputable",
        "shared_list",
        "block_hashes",
        "hit",
        "use_prefix_cache",
        "snapshot_points",
    )

    def __init__(
        self, key: str, token_ids: list[int], max_tokens: int, arrival: int, shared_list: bool = False
    ) -> None:
        self.key = key
        self.token_ids = token_ids            # prompt followed by output tokens
        # True: token_ids is the caller's list (`share_list`), which the caller appends to and the
        # scheduler only reads; False: the scheduler's own copy, appended by `append_*`.
        self.shared_list = shared_list
        self.num_prompt_tokens = len(token_ids)
        self.max_tokens = max_tokens
        self.status = SeqStatus.WAITING
        self.row = -1                         # SeqTable row; -1 = holds no KV
        self.arrival = arrival                # admission order, for deterministic tie-breaks
        self.awaiting_first_token = False     # prefill done, its sampled token not appended yet
        self.uncopied = False                 # fork branch still sharing its parent's state slot
        self.parent: Sequence | None = None   # set for fork branches
        self.num_forks = 0                    # branches made from this sequence so far
        self.recomputable = True              # a preemption may queue it for recompute
        self.block_hashes: list[bytes] = []   # prefix caching: chain hashes of its first full blocks
        self.hit: Hit | None = None           # prefix caching: the cached prefix planned for admission
        self.use_prefix_cache = True          # False: never starts from a cached prefix
        self.snapshot_points: tuple[int, ...] = ()   # prefix caching: where its prefill saves its state

    @property
    def seq_id(self) -> str:
        """The sequence's id: its key, or a `BranchId` while it is a fork branch awaiting its copy."""
        return BranchId(self.key) if self.uncopied else self.key

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, row={self.row})"


@dataclass(frozen=True, slots=True)
class SeqView:
    """Snapshot of one live sequence, as returned by `Scheduler.get_seq`.

    Attributes:
        seq_id: current id (a `BranchId` while a fork branch awaits its copy-on-write).
        status: where the sequence is (`SeqStatus`).
        prompt_token_ids: the prompt's token ids.
        output_token_ids: the tokens appended so far (sampled first token included).
        max_tokens: output limit given at add time (the engine enforces it).
        num_computed_tokens: tokens whose KV is confirmed in the cache.
        num_inflight_tokens: query tokens reserved by decode steps not yet followed by
            `append_tokens` (ZOS keeps one step in flight).
        block_ids: the block table (no padding); empty while it holds no KV.
        state_slot: state slot id; 0 = none yet (the dummy slot).
    """

    seq_id: str
    status: SeqStatus
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    max_tokens: int
    num_computed_tokens: int
    num_inflight_tokens: int
    block_ids: tuple[int, ...]
    state_slot: int
