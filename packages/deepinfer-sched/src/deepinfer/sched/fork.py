"""Fork (docs/design.md §3.4): branches share the parent's block table and state slot (references
pinned); the copy-on-write of the state slot and of the last, partly written block happens when a
branch is first scheduled. Until then a branch's id is a `BranchId` ("_" + its key)."""

from __future__ import annotations

import numpy as np

from .sequence import BranchId, SeqStatus, Sequence, TokenLog
from .state import SchedState


def fork_seq(
    st: SchedState, parent: Sequence, num_branches: int, branch_lists: list[TokenLog] | None = None
) -> tuple[BranchId, ...]:
    """Makes `num_branches` PROMPTED copies of `parent` sharing its KV; returns their `BranchId`s.
    `branch_lists`: the branches' shared token lists (each equal to the parent's tokens), or None
    for copies of their own."""
    if isinstance(num_branches, bool) or not isinstance(num_branches, int) or num_branches < 1:
        raise ValueError(f"num_branches={num_branches!r} must be an int >= 1")
    if branch_lists is not None:
        _check_branch_lists(parent, num_branches, branch_lists)
    if parent.status not in (SeqStatus.PROMPTED, SeqStatus.RUNNING) or parent.uncopied:
        raise ValueError(
            f"cannot fork {parent.seq_id!r} in status {parent.status.name}"
            f"{' (its own copy-on-write is pending)' if parent.uncopied else ''}: "
            "only a prefilled, copied sequence (PROMPTED or RUNNING) can be forked"
        )
    table = st.table
    row = parent.row
    if table.num_inflight[row]:
        raise ValueError(
            f"cannot fork {parent.seq_id!r} with a decode step in flight; "
            "append its sampled tokens first"
        )
    keys = [f"{parent.key}.{parent.num_forks + index}" for index in range(1, num_branches + 1)]
    taken = [key for key in keys if key in st.seqs]
    if taken:
        raise ValueError(f"fork ids {taken} are already live sequences")
    num_computed = int(table.seq_len[row])
    shared = table.block_ids(row)[: st.blocks_for(num_computed)].copy()
    slot = np.array([table.state_slot[row]], dtype=np.int32)
    for index, key in enumerate(keys):
        if branch_lists is None:
            branch = Sequence(key, list(parent.token_ids), parent.max_tokens, st.next_arrival())
        else:
            branch = Sequence(key, branch_lists[index], parent.max_tokens, st.next_arrival(), shared_list=True)
        branch.recomputable = parent.recomputable
        branch.num_prompt_tokens = parent.num_prompt_tokens
        branch.awaiting_first_token = parent.awaiting_first_token
        branch.uncopied = True
        branch.parent = parent
        branch.status = SeqStatus.PROMPTED
        branch_row = table.acquire(branch)
        st.kv.pin(shared)
        st.slots.pin(slot)
        table.append_blocks(branch_row, shared)
        table.seq_len[branch_row] = num_computed
        table.state_slot[branch_row] = slot[0]
        table.pending_steps[branch_row] = table.pending_steps[row]
        table.last_token[branch_row] = table.last_token[row]
        table.num_output[branch_row] = table.num_output[row]
        table.num_branches[row] += 1
        st.num_uncopied += 1
        st.register(branch)
        st.prompted[key] = branch
    parent.num_forks += num_branches
    return tuple(map(BranchId, keys))


def _check_branch_lists(parent: Sequence, num_branches: int, branch_lists: list[TokenLog]) -> None:
    if len(branch_lists) != num_branches:
        raise ValueError(f"branch_lists must hold one list per branch ({num_branches})")
    if len({id(tokens) for tokens in branch_lists}) != num_branches or \
            any(tokens is parent.token_ids for tokens in branch_lists):
        raise ValueError("branch_lists must be distinct lists, none of them the parent's")
    if any(type(tokens) is not TokenLog or tokens != parent.token_ids for tokens in branch_lists):
        raise ValueError(f"each of branch_lists must be a TokenLog equal to {parent.seq_id!r}'s "
                         f"{parent.num_tokens} tokens now")


def copy_on_write(st: SchedState, branch: Sequence) -> bool:
    """Gives `branch` its own state slot and last block (if partly written), emitting the copies.

    Returns False (nothing changed) when a slot or block is not free: the branch waits (LATER).
    """
    table = st.table
    row = branch.row
    partial = int(table.seq_len[row]) % st.config.block_size != 0
    if st.slots.num_free < 1 or (partial and st.kv.num_free < 1):
        return False
    old_slot = int(table.state_slot[row])
    new_slot = int(st.slots.allocate(1)[0])
    st.clone_states.append((old_slot, new_slot))
    st.slots.free(np.array([old_slot], dtype=np.int32))
    table.state_slot[row] = new_slot
    if partial:
        last = int(table.num_blocks[row]) - 1
        old_block = int(table.block_table[row, last])
        new_block = int(st.kv.allocate(1)[0])
        st.clone_blocks.append((old_block, new_block))
        st.kv.free(np.array([old_block], dtype=np.int32))
        table.block_table[row, last] = new_block
        table.new_table_version(row)
    parent = branch.parent
    if parent is not None and parent.row >= 0:
        table.num_branches[parent.row] -= 1
    branch.uncopied = False
    branch.parent = None
    st.num_uncopied -= 1
    table.rename(row, branch.seq_id)
    return True
