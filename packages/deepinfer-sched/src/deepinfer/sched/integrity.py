"""`Scheduler.check_integrity`: every bookkeeping invariant, checked the slow, obvious way
(run while idle and by the tests)."""

from __future__ import annotations

from collections import Counter
from typing import NoReturn

from .sequence import SeqStatus
from .state import SchedState


def _fail(message: str) -> NoReturn:
    raise RuntimeError(f"scheduler integrity: {message}")


def check_integrity(st: SchedState) -> None:
    """Raises RuntimeError naming the first broken invariant."""
    _check_queues(st)
    _check_rows(st)
    _check_references(st)


def _check_queues(st: SchedState) -> None:
    running_keys = []
    for row in st.running_rows.tolist():
        seq = st.table.seqs[row]
        if seq is None or seq.status is not SeqStatus.RUNNING:
            _fail(f"running row {row} holds {seq!r}")
        running_keys.append(seq.key)
    queued = running_keys + list(st.waiting) + list(st.prompted) + list(st.prefilling)
    duplicates = [key for key, count in Counter(queued).items() if count > 1]
    if duplicates or sorted(queued) != sorted(st.seqs):
        _fail(f"queues hold {sorted(queued)}, live sequences are {sorted(st.seqs)}")
    _check_queue_states(st)
    owned = sum(not seq.shared_list for seq in st.seqs.values())
    if owned != st.num_owned_lists:
        _fail(f"num_owned_lists={st.num_owned_lists}, {owned} live sequences own their token list")
    uncopied = [seq for seq in st.seqs.values() if seq.uncopied]
    if len(uncopied) != st.num_uncopied:
        _fail(f"num_uncopied={st.num_uncopied}, {len(uncopied)} uncopied branches live")


def _check_queue_states(st: SchedState) -> None:
    for key, seq in st.waiting.items():
        if seq.status is not SeqStatus.WAITING or seq.row >= 0:
            _fail(f"waiting {key!r} has status {seq.status.name}, row {seq.row}")
    for key, seq in st.prompted.items():
        if seq.status is not SeqStatus.PROMPTED:
            _fail(f"prompted {key!r} has status {seq.status.name}")
    for key, seq in st.prefilling.items():
        if seq.status is not SeqStatus.PREFILLING:
            _fail(f"prefilling {key!r} has status {seq.status.name}")


def _check_rows(st: SchedState) -> None:
    table = st.table
    config = st.config
    holders = [seq for seq in st.seqs.values() if seq.row >= 0]
    if len(holders) != table.num_used:
        _fail(f"{len(holders)} sequences hold rows, the table has {table.num_used} in use")
    branches = Counter(seq.parent.row for seq in st.seqs.values()
                       if seq.uncopied and seq.parent is not None and seq.parent.row >= 0)
    for seq in holders:
        row = seq.row
        if table.seqs[row] is not seq or table.ids[row] != seq.seq_id:
            _fail(f"row {row} does not point back to {seq!r}")
        seq_len, num_blocks = int(table.seq_len[row]), int(table.num_blocks[row])
        if num_blocks != st.blocks_for(seq_len):
            _fail(f"{seq.seq_id!r} holds {num_blocks} blocks for {seq_len} KV positions")
        if table.block_table[row, num_blocks:].any() or not (table.block_table[row, :num_blocks] > 0).all():
            _fail(f"{seq.seq_id!r} has a block-table row with holes or stale ids")
        num_decode_steps = int(table.pending_steps[row]) - seq.awaiting_first_token
        if num_decode_steps < 0 or table.num_inflight[row] != num_decode_steps * config.max_query_len:
            _fail(f"{seq.seq_id!r}: {int(table.num_inflight[row])} in-flight tokens, "
                  f"{num_decode_steps} decode steps pending")
        if seq_len - int(table.num_inflight[row]) > seq.num_tokens:
            _fail(f"{seq.seq_id!r} has more KV than tokens")
        if table.state_slot[row] < 1:
            _fail(f"{seq.seq_id!r} holds no state slot")
        if table.num_output[row] != seq.num_tokens - seq.num_prompt_tokens:
            _fail(f"{seq.seq_id!r} num_output is stale")
        if int(table.num_branches[row]) != branches.get(row, 0):
            _fail(f"{seq.seq_id!r} counts {int(table.num_branches[row])} uncopied branches")


def _check_references(st: SchedState) -> None:
    table = st.table
    block_refs: Counter[int] = Counter()
    slot_refs: Counter[int] = Counter()
    for seq in st.seqs.values():
        if seq.row >= 0:
            block_refs.update(table.block_ids(seq.row).tolist())
            slot_refs[int(table.state_slot[seq.row])] += 1
    for name, manager, refs in (("block", st.kv, block_refs), ("state slot", st.slots, slot_refs)):
        for block_id in range(1, manager.num_blocks):
            if manager.ref_count(block_id) != refs.get(block_id, 0):
                _fail(f"{name} {block_id} has refcount {manager.ref_count(block_id)}, "
                      f"{refs.get(block_id, 0)} holders")
        if manager.num_free != manager.num_blocks - 1 - len(refs):
            _fail(f"{manager.num_free} free {name}s, {len(refs)} in use of {manager.num_blocks - 1}")
    if st.prefix is not None:
        pools = [("snapshot slots", st.prefix.snapshots)]
        if st.prefix.host is not None:
            pools += [("host blocks", st.prefix.host.blocks), ("host snapshots", st.prefix.host.snapshots)]
        for name, pool in pools:
            if pool.num_free != pool.num_blocks - 1:          # held only within one schedule()
                _fail(f"{pool.num_blocks - 1 - pool.num_free} {name} held between steps")
            pool.check_integrity()
