"""The scheduler's mutable state, shared by the admission, decode, preemption and fork modules."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .config import SchedulerConfig
from .host_tier import HostTier
from .output import EMPTY_PAIRS, EMPTY_SLOTS, EMPTY_TRIPLES, IgnoredSeq
from .pools import BlockPool, HashedBlockPool, is_hashed
from .prefix_cache import PrefixCache
from .seq_table import SeqTable
from .sequence import SeqStatus, Sequence, seq_key


class SchedState:
    """Queues, the row table, the two BlockManagers and the per-step emit lists.

    Queues: `waiting` (FIFO, recompute victims at the front), `prefilling` (sequences cut into
    chunks, continued first, in order: the one a budget cut plus those cut at their prefix-cache
    snapshot point), `prompted` (FIFO, joins the running set at the next decode) and
    `running_rows` (rows of running sequences, kept sorted by KV length descending).
    `prefix` is the prefix cache (None when off).
    """

    def __init__(self, config: SchedulerConfig, kv_blocks: BlockPool, state_slots: BlockPool,
                 snapshot_slots: HashedBlockPool | None = None, host: HostTier | None = None) -> None:
        self.config = config
        self.kv = kv_blocks
        self.slots = state_slots
        self.prefix: PrefixCache | None = None
        if config.enable_prefix_caching:
            if snapshot_slots is None or not is_hashed(snapshot_slots) or not is_hashed(kv_blocks):
                raise ValueError("enable_prefix_caching=True needs kv_blocks and snapshot_slots with a hash index "
                                 "(deepinfer.cache.BlockManager)")
            self.prefix = PrefixCache(config.block_size, kv_blocks, snapshot_slots, config.prefix_cache_key, host)
        self.table = SeqTable(config.max_num_seqs + 1, config.max_blocks_per_seq)
        self.seqs: dict[str, Sequence] = {}
        self.waiting: OrderedDict[str, Sequence] = OrderedDict()
        self.prefilling: OrderedDict[str, Sequence] = OrderedDict()
        self.prompted: OrderedDict[str, Sequence] = OrderedDict()
        self.running_rows: np.ndarray = np.zeros(0, dtype=np.int32)
        self.num_uncopied = 0            # fork branches awaiting copy-on-write
        self.num_owned_lists = 0         # live sequences whose token list `append_*` extends (not shared)
        self.num_arrivals = 0
        self.num_decode_steps = 0
        # Emitted by the next schedule() (ignored) or by the current one (the rest).
        self.pending_ignored: list[IgnoredSeq] = []
        self.clone_states: list[tuple[int, int]] = []
        self.clone_blocks: list[tuple[int, int]] = []
        self.zero_states: list[int] = []
        # prefix caching, see SchedulerOutput
        self.restore_states: list[tuple[int, int, int]] = []       # (snapshot slot, state slot, position)
        self.restore_host_states: list[tuple[int, int, int]] = []  # (host snapshot, state slot, position)
        self.save_states: list[tuple[int, int, int]] = []          # (state slot, snapshot slot, position)
        self.load_blocks: list[tuple[int, int]] = []               # (host block, KV block)
        self.preempted: list[str] = []
        self.recomputed: list[str] = []      # the preempted ones queued for recompute

    def lookup(self, seq_id: str) -> Sequence:
        """The live sequence with this id (a fork branch's `BranchId` or its key). Raises KeyError if none."""
        if not isinstance(seq_id, str):
            raise KeyError(f"seq_id must be a str, got {type(seq_id).__name__}")
        seq = self.seqs.get(seq_key(seq_id))
        if seq is None:
            raise KeyError(f"seq_id={seq_id!r} is not a live sequence")
        return seq

    def register(self, seq: Sequence) -> None:
        """Makes `seq` live (the caller queues it)."""
        self.seqs[seq.key] = seq
        if not seq.shared_list:
            self.num_owned_lists += 1

    def next_arrival(self) -> int:
        self.num_arrivals += 1
        return self.num_arrivals

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def release_kv(self, seq: Sequence) -> None:
        """Drops every block and slot reference of `seq` and gives back its row."""
        if seq.row < 0:
            return
        row = seq.row
        block_ids = self.table.block_ids(row)
        if len(block_ids):
            # last block first: a cached chain loses its tail before its head (LRU among free blocks)
            self.kv.free(block_ids if self.prefix is None else block_ids[::-1].copy())
        slot = int(self.table.state_slot[row])
        if slot:
            self.slots.free(np.array([slot], dtype=np.int32))
        if seq.uncopied:
            self._forget_branch(seq)
        self.table.release(seq)

    def unlink(self, seq: Sequence) -> None:
        """Takes `seq` out of whichever queue holds it (status is left to the caller)."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.pop(seq.key, None)
        elif seq.status is SeqStatus.PREFILLING:
            self.prefilling.pop(seq.key, None)
        elif seq.status is SeqStatus.PROMPTED:
            self.prompted.pop(seq.key, None)
        elif seq.status is SeqStatus.RUNNING:
            self.running_rows = self.running_rows[self.running_rows != seq.row]

    def drop(self, seq: Sequence) -> None:
        """Frees everything `seq` holds and forgets it (it finished)."""
        self.unlink(seq)
        self.release_kv(seq)
        del self.seqs[seq.key]
        if not seq.shared_list:
            self.num_owned_lists -= 1

    def _forget_branch(self, seq: Sequence) -> None:
        parent = seq.parent
        if parent is not None and parent.row >= 0:
            self.table.num_branches[parent.row] -= 1
        seq.uncopied = False
        seq.parent = None
        self.num_uncopied -= 1

    def emit_lists(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This step's (clone_states [k,2], clone_blocks [k,2], zero_states [k]) as int32 arrays."""
        return _pairs(self.clone_states), _pairs(self.clone_blocks), _slots(self.zero_states)

    def emit_prefix_lists(self) -> dict[str, np.ndarray]:
        """This step's prefix-cache copies as int32 arrays, by `SchedulerOutput` field; the copies to
        host memory of what the step evicted are decided here (`PrefixCache.spill`)."""
        spill_blocks, spill_snapshots = self.prefix.spill() if self.prefix is not None else ([], [])
        return {"restore_states": _triples(self.restore_states), "save_states": _triples(self.save_states),
                "restore_host_states": _triples(self.restore_host_states), "load_blocks": _pairs(self.load_blocks),
                "spill_blocks": _pairs(spill_blocks), "spill_snapshots": _pairs(spill_snapshots)}

    def reset_step(self) -> None:
        self.clone_states.clear()
        self.clone_blocks.clear()
        self.zero_states.clear()
        self.restore_states.clear()
        self.restore_host_states.clear()
        self.save_states.clear()
        self.load_blocks.clear()
        self.preempted.clear()
        self.recomputed.clear()


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    if not pairs:
        return EMPTY_PAIRS
    return np.array(pairs, dtype=np.int32).reshape(len(pairs), 2)


def _triples(triples: list[tuple[int, int, int]]) -> np.ndarray:
    if not triples:
        return EMPTY_TRIPLES
    return np.array(triples, dtype=np.int32).reshape(len(triples), 3)


def _slots(slots: list[int]) -> np.ndarray:
    return np.array(slots, dtype=np.int32) if slots else EMPTY_SLOTS
