"""fork_seq: shared blocks and slot, copy-on-write at first scheduling, exact ids."""

from __future__ import annotations

import copy
import pickle

import pytest

from deepinfer.sched import BranchId, SeqStatus, StepKind, seq_key


def prefill(sched, seq_id, prompt, first_token=7):
    sched.add_seq(seq_id, prompt, 32)
    out = sched.schedule()
    assert [c.seq_id for c in out.prefill] == [seq_id]
    sched.append_tokens(seq_id, [first_token])
    return out


def test_branch_ids_are_typed_until_the_copy(make_sched) -> None:
    sched = make_sched()
    prefill(sched, "p", list(range(6)))
    branches = sched.fork_seq("p", 2)
    assert [type(b) for b in branches] == [BranchId, BranchId] and [b.key for b in branches] == ["p.1", "p.2"]
    assert BranchId("p.1") == "_p.1" and hash(BranchId("p.1")) == hash("_p.1")   # keys dicts as its spelling
    assert isinstance(sched.get_seq("p.1").seq_id, BranchId)
    for seq_id in (branches[0], "_p.1", "p.1"):                         # every id of the branch finds it
        assert seq_key(seq_id) == "p.1"
    assert seq_key("p") == "p"
    for clone in (pickle.loads(pickle.dumps(branches[0])), copy.deepcopy(branches[0])):
        assert type(clone) is BranchId and clone == "_p.1" and clone.key == "p.1"
    out = sched.schedule()                                              # the copy-on-write
    assert [type(seq_id) for seq_id in out.decode.seq_ids] == [str, str, str]
    assert type(sched.get_seq(branches[1]).seq_id) is str


def test_fork_copies_the_partial_last_block_and_the_state_slot(make_sched) -> None:
    sched = make_sched()
    prefill(sched, "p", list(range(6)))               # blocks 1, 2 (block 2 half written), slot 1
    assert sched.fork_seq("p", 2) == ("_p.1", "_p.2")
    branch = sched.get_seq("_p.1")
    assert branch.seq_id == "_p.1" and branch.status is SeqStatus.PROMPTED
    assert branch.block_ids == (1, 2) and branch.state_slot == 1
    assert branch.output_token_ids == (7,) and branch.num_computed_tokens == 6
    assert sched.get_seq("p.1") == branch              # both spellings name the branch
    sched.check_integrity()                            # refcounts: blocks 1, 2 and slot 1 held 3 times

    out = sched.schedule()
    assert out.kind is StepKind.DECODE
    assert out.clone_states.tolist() == [[1, 2], [1, 3]]
    assert out.clone_blocks.tolist() == [[2, 3], [2, 4]]
    assert out.zero_states.tolist() == []
    batch = out.decode
    assert batch.seq_ids == ("p", "p.1", "p.2")        # "_" dropped once copied; equal lengths
    assert batch.block_tables.tolist() == [[1, 2], [1, 3], [1, 4]]
    assert batch.state_slots.tolist() == [1, 2, 3]
    assert batch.last_token_ids.tolist() == [7, 7, 7]
    assert sched.get_seq("_p.2").seq_id == "p.2"
    for seq_id, token in zip(batch.seq_ids, (10, 11, 12)):
        sched.append_tokens(seq_id, [token])
    assert sched.get_seq("p.2").output_token_ids == (7, 12)
    sched.check_integrity()

    assert sched.fork_seq("p", 1) == ("_p.3",)         # numbering goes on per parent
    for seq_id in ("p", "p.1", "p.2", "_p.3"):
        sched.finish_seq(seq_id, "stop")
    sched.check_integrity()
    assert not sched.has_unfinished()


def test_fork_at_a_block_boundary_copies_only_the_state(make_sched) -> None:
    sched = make_sched()
    prefill(sched, "p", list(range(8)))               # blocks 1, 2 both full
    sched.fork_seq("p", 1)
    out = sched.schedule()
    assert out.clone_states.tolist() == [[1, 2]] and out.clone_blocks.tolist() == []
    # both write position 8 into fresh blocks: p gets 3, p.1 gets 4
    assert out.decode.block_tables.tolist() == [[1, 2, 3], [1, 2, 4]]


def test_fork_before_the_first_token_lets_each_branch_sample_its_own(make_sched) -> None:
    sched = make_sched()
    sched.add_seq("p", [1, 2, 3], 8)
    sched.schedule()                                   # prefill; first token not appended yet
    assert sched.fork_seq("p", 1) == ("_p.1",)
    sched.append_tokens("p", [40])
    sched.append_tokens("_p.1", [41])
    batch = sched.schedule().decode
    assert batch.seq_ids == ("p", "p.1") and batch.last_token_ids.tolist() == [40, 41]


def test_a_branch_without_a_free_slot_waits_and_holds_its_parent(make_sched) -> None:
    sched = make_sched(num_slots=2)
    prefill(sched, "p", list(range(6)))               # slot 1
    sched.fork_seq("p", 2)
    out = sched.schedule()
    # p.1 takes slot 2; _p.2 finds no slot and waits; p waits for it (its slot is still shared).
    assert out.clone_states.tolist() == [[1, 2]]
    assert out.decode.seq_ids == ("p.1",)
    assert sched.get_seq("_p.2").status is SeqStatus.PROMPTED
    sched.append_tokens("p.1", [5])
    sched.finish_seq("p.1", "stop")                   # frees slot 2
    out = sched.schedule()
    assert out.clone_states.tolist() == [[1, 2]] and out.clone_blocks.tolist() == [[2, 4]]
    assert out.decode.seq_ids == ("p", "p.2")
    sched.check_integrity()


def test_aborting_an_uncopied_branch_drops_its_shared_references(make_sched) -> None:
    sched = make_sched()
    prefill(sched, "p", list(range(6)))
    sched.fork_seq("p", 2)
    sched.abort_seq("_p.1")
    sched.finish_seq("p", "stop")                     # the branch keeps blocks 1, 2 and slot 1
    sched.check_integrity()
    out = sched.schedule()
    assert out.clone_states.tolist() == [[1, 2]] and out.clone_blocks.tolist() == [[2, 3]]
    assert out.decode.seq_ids == ("p.2",) and out.decode.block_tables.tolist() == [[1, 3]]
    assert out.ignored == ()                           # the branch was never WAITING
    sched.finish_seq("p.2", "stop")
    sched.check_integrity()
    assert not sched.has_unfinished()


def test_fork_refuses_bad_parents(make_sched) -> None:
    sched = make_sched()
    sched.add_seq("w", [1, 2], 8)
    with pytest.raises(ValueError, match="status WAITING"):
        sched.fork_seq("w", 1)
    with pytest.raises(KeyError):
        sched.fork_seq("nope", 1)
    sched.schedule()
    sched.append_tokens("w", [3])
    sched.schedule()                                   # a decode step of w is in flight
    with pytest.raises(ValueError, match="in flight"):
        sched.fork_seq("w", 1)
    sched.append_tokens("w", [4])
    with pytest.raises(ValueError, match="num_branches"):
        sched.fork_seq("w", 0)
    (branch,) = sched.fork_seq("w", 1)
    with pytest.raises(ValueError, match="copy-on-write is pending"):
        sched.fork_seq(branch, 1)
    sched.check_integrity()
