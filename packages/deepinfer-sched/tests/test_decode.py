"""Decode: reservations, output order, ZOS in-flight steps, drafts, LCFS preemption (exact values)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.sched import FinishReason, StepKind


def prefill_all(sched, first_token=7, decode_token=None):
    """Runs prefill steps until another kind is chosen, appending each completed prompt's first
    token; returns that step's output (its decode tokens appended only if decode_token is set)."""
    while True:
        out = sched.schedule()
        if out.kind is not StepKind.PREFILL:
            if decode_token is not None and out.decode is not None:
                for seq_id in out.decode.seq_ids:
                    sched.append_tokens(seq_id, [decode_token])
                sched.check_integrity()
            return out
        for chunk in out.prefill:
            if chunk.completes_prefill:
                sched.append_tokens(chunk.seq_id, [first_token])


def decode_step(sched, token=9):
    out = sched.schedule()
    if out.decode is not None:
        for seq_id in out.decode.seq_ids:
            sched.append_tokens(seq_id, [token])
    sched.check_integrity()
    return out


def test_decode_reserves_blocks_and_sorts_by_length(make_sched) -> None:
    sched = make_sched()
    sched.add_seq("a", [1] * 5, 16)     # blocks 1, 2
    sched.add_seq("b", [2] * 8, 16)     # blocks 3, 4
    sched.add_seq("c", [3] * 6, 16)     # blocks 5, 6
    out = prefill_all(sched, first_token=7)
    batch = out.decode
    assert out.kind is StepKind.DECODE and out.num_decode_steps == 1
    assert batch.seq_ids == ("b", "c", "a")                 # KV length 9, 7, 6
    assert batch.seq_lens.tolist() == [9, 7, 6]
    assert batch.query_lens.tolist() == [1, 1, 1]
    assert batch.block_tables.tolist() == [[3, 4, 7], [5, 6, 0], [1, 2, 0]]   # b crossed into block 7
    assert batch.state_slots.tolist() == [2, 3, 1]
    assert batch.last_token_ids.tolist() == [7, 7, 7]
    assert batch.rows.tolist() == [1, 2, 0]
    for seq_id in batch.seq_ids:
        sched.append_tokens(seq_id, [8])
    view = sched.get_seq("b")
    assert view.output_token_ids == (7, 8) and view.num_computed_tokens == 9
    assert view.num_inflight_tokens == 0 and view.block_ids == (3, 4, 7)


def test_ties_keep_the_previous_order(make_sched) -> None:
    sched = make_sched()
    for name in "xyz":
        sched.add_seq(name, [1, 2, 3], 16)
    assert prefill_all(sched).decode.seq_ids == ("x", "y", "z")
    assert decode_step(sched).decode.seq_ids == ("x", "y", "z")


def test_zos_keeps_one_step_in_flight(make_sched) -> None:
    sched = make_sched()
    sched.add_seq("a", [1, 2, 3], 16)
    first = prefill_all(sched, first_token=7).decode        # step 1 in flight
    assert first.last_token_ids.tolist() == [7] and first.seq_lens.tolist() == [4]
    assert first.in_flight.tolist() == [False]
    second = sched.schedule().decode                        # step 2 scheduled before step 1's tokens
    assert second.in_flight.tolist() == [True] and second.seq_lens.tolist() == [5]
    assert second.rows_generation == first.rows_generation   # the same row, the same id
    assert sched.get_seq("a").num_inflight_tokens == 2
    sched.append_tokens("a", [8])                           # step 1
    sched.append_tokens("a", [9])                           # step 2
    with pytest.raises(ValueError, match="no step in flight"):
        sched.append_tokens("a", [10])
    view = sched.get_seq("a")
    assert view.num_computed_tokens == 5 and view.output_token_ids == (7, 8, 9)
    sched.check_integrity()


def test_drafts_reserve_nextn_plus_one_and_rejections_give_blocks_back(make_sched) -> None:
    sched = make_sched(nextn=3)
    sched.add_seq("a", [1, 2, 3], 16)       # 1 block
    batch = prefill_all(sched).decode
    assert batch.query_lens.tolist() == [4] and batch.seq_lens.tolist() == [7]
    assert batch.block_tables.tolist() == [[1, 2]]
    sched.append_tokens("a", [5])           # only the bonus token: 3 drafts rejected
    view = sched.get_seq("a")
    assert view.num_computed_tokens == 4 and view.block_ids == (1,)   # block 2 given back
    sched.check_integrity()
    batch = sched.schedule().decode
    # block 2 went to the tail of the free list: the head, block 3, comes next
    assert batch.seq_lens.tolist() == [8] and batch.block_tables.tolist() == [[1, 3]]
    sched.append_tokens("a", [6, 7, 8, 9])  # all accepted
    assert sched.get_seq("a").num_computed_tokens == 8
    sched.schedule()
    with pytest.raises(ValueError, match=r"must be in \[1, 4\]"):
        sched.append_tokens("a", [1, 2, 3, 4, 5])


def test_verify_policy_sets_query_lengths(make_sched) -> None:
    class ByLength:
        def __init__(self) -> None:
            self.calls = []

        def query_lens(self, seq_ids, seq_lens, max_query_len):
            self.calls.append((seq_ids, seq_lens.tolist(), max_query_len))
            return np.where(seq_lens > 8, 1, max_query_len)

    policy = ByLength()
    sched = make_sched(nextn=2, verify_policy=policy)
    sched.add_seq("long", [1] * 8, 16)
    sched.add_seq("short", [1] * 2, 16)
    batch = prefill_all(sched).decode
    assert policy.calls == [(("long", "short"), [11, 5], 3)]
    assert batch.query_lens.tolist() == [1, 3]


def test_verify_policy_out_of_range_is_refused(make_sched) -> None:
    class Bad:
        def query_lens(self, seq_ids, seq_lens, max_query_len):
            return np.full(len(seq_ids), max_query_len + 1)

    sched = make_sched(nextn=1, verify_policy=Bad())
    sched.add_seq("a", [1, 2], 4)
    with pytest.raises(ValueError, match=r"allowed range is \[1, 2\]"):
        prefill_all(sched)


def test_preemption_takes_the_longest_output_first(make_sched) -> None:
    # 6 usable blocks of 4 tokens; every decode step is an attempt point.
    sched = make_sched(num_blocks=7, prefill_attempt_interval=1, prefill_any_attempt_interval=1)
    sched.add_seq("a", [5, 5], 100)
    prefill_all(sched, decode_token=9)  # a: block 1, 3 KV positions, output 2
    for _ in range(3):
        decode_step(sched)              # a: 6 KV positions (blocks 1, 2), output 5
    sched.add_seq("b", [6] * 8, 100)
    out = prefill_all(sched, decode_token=9)   # b: blocks 3, 4; then decode a to 7, b to 9
    assert out.decode.block_tables.tolist() == [[3, 4, 5], [1, 2, 0]]
    decode_step(sched)
    assert decode_step(sched).decode.block_tables.tolist() == [[3, 4, 5], [1, 2, 6]]   # a to 9
    out = decode_step(sched)            # b 12, a 10: all 6 blocks held
    assert out.preempted_seq_ids == () and sched.get_seq("a").output_token_ids[-1] == 9
    # b (output 5) needs a 4th block; none free. Picks go from the short-output end (b); the
    # victim comes from the long end: a (output 9), whose blocks 1, 2, 6 join the free list.
    out = decode_step(sched)
    assert out.preempted_seq_ids == ("a",)
    assert out.decode.seq_ids == ("b",) and out.decode.block_tables.tolist() == [[3, 4, 5, 1]]
    with pytest.raises(KeyError):
        sched.get_seq("a")              # finished with reason "preempted"
    sched.finish_seq("b", FinishReason.STOP)
    assert not sched.has_unfinished()
    sched.check_integrity()             # every block and slot is free again


def test_several_victims_then_the_pick_itself(make_sched) -> None:
    sched = make_sched(num_blocks=6, nextn=4)      # 5 usable blocks; a decode step reserves 5
    for name in "ABC":
        sched.add_seq(name, [1] * 4, 100)          # blocks 1, 2, 3; blocks 4, 5 free
    out = prefill_all(sched)
    # Each needs 2 more blocks (4 + 5 positions = 3 blocks). Equal outputs: LCFS order A, B, C.
    # C (short end) takes 4, 5 -> B needs 2, none left -> victim A frees 1 -> still short ->
    # the next victim is B itself.
    assert out.preempted_seq_ids == ("A", "B")
    assert out.decode.seq_ids == ("C",) and out.decode.block_tables.tolist() == [[3, 4, 5]]
    sched.append_tokens("C", [1, 2])
    sched.check_integrity()


def test_a_lone_sequence_without_blocks_preempts_itself(make_sched) -> None:
    sched = make_sched(num_blocks=2)    # one usable block
    sched.add_seq("a", [1, 2, 3], 16)
    assert prefill_all(sched).decode.seq_ids == ("a",)        # 4 positions fit block 1
    sched.append_tokens("a", [1])
    out = sched.schedule()
    assert out.kind is StepKind.EMPTY_DECODE and out.preempted_seq_ids == ("a",)
    assert not sched.has_unfinished()


def test_decode_past_max_model_len_is_refused(make_sched) -> None:
    sched = make_sched(max_model_len=8)          # row width: ceil((8 + 2) / 4) = 3 blocks, 12 positions
    sched.add_seq("a", [1] * 8, 16)
    prefill_all(sched, decode_token=1)           # 9 positions: the engine should stop it now
    for _ in range(3):
        decode_step(sched)                       # 10, 11, 12 positions
    assert sched.get_seq("a").num_computed_tokens == 12
    with pytest.raises(RuntimeError, match="holds 12 KV positions.*must finish it"):
        sched.schedule()
    sched.check_integrity()                      # the bookkeeping is still consistent


def test_finishing_everything_frees_everything(make_sched) -> None:
    sched = make_sched()
    for index in range(5):
        sched.add_seq(f"s{index}", list(range(3 + 4 * index)), 16)
    prefill_all(sched)
    for _ in range(6):
        decode_step(sched)
    for index, reason in enumerate(["stop", "length", "abort", FinishReason.STOP, "stop"]):
        sched.finish_seq(f"s{index}", reason)
    sched.check_integrity()
    assert not sched.has_unfinished()
    assert sched.schedule().kind is StepKind.IDLE


def test_append_decode_tokens_matches_one_by_one_appends(make_sched) -> None:
    results = []
    for batched in (False, True):
        sched = make_sched(nextn=2)
        for name, length in (("a", 3), ("b", 9), ("c", 5)):
            sched.add_seq(name, [1] * length, 16)
        batch = prefill_all(sched).decode
        assert batch.seq_ids == ("b", "c", "a")
        tokens = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
        accepted = np.array([3, 1, 2])
        if batched:
            assert sched.append_decode_tokens(batch.seq_ids, tokens, accepted) == 3
        else:
            for seq_id, row, count in zip(batch.seq_ids, tokens.tolist(), accepted.tolist()):
                sched.append_tokens(seq_id, row[:count])
        sched.check_integrity()
        results.append([sched.get_seq(name) for name in "abc"])
        assert sched.schedule().decode.last_token_ids.tolist() == [12, 20, 31]   # b 15, c 9, a 8
    assert results[0] == results[1]
    assert results[1][0].output_token_ids == (7, 30, 31)
    assert results[1][2].num_computed_tokens == 6 and results[1][2].block_ids == (5, 6)


def test_steady_append_decode_tokens_matches_one_by_one_appends(make_sched) -> None:
    """One token per sequence for an unchanged batch (the same seq_ids tuple: the fast path without
    per-sequence lookups) gives the same state as one append_tokens per sequence, ZOS-style."""
    results = []
    for batched in (False, True):
        sched = make_sched()
        for name, length in (("a", 3), ("b", 9), ("c", 5)):
            sched.add_seq(name, [1] * length, 16)
        batch = prefill_all(sched).decode
        for step in range(4):
            following = sched.schedule().decode          # scheduled before this step's tokens are in
            assert following.seq_ids is batch.seq_ids   # nothing changed: the same tuple
            tokens = np.array([[40 + step], [50 + step], [60 + step]])
            if batched:
                assert sched.append_decode_tokens(batch.seq_ids, tokens, np.ones(3, dtype=np.int64)) == 3
            else:
                for seq_id, token in zip(batch.seq_ids, tokens[:, 0].tolist()):
                    sched.append_tokens(seq_id, [token])
            sched.check_integrity()
            batch = following
        results.append([sched.get_seq(name) for name in "abc"])
        if batched:
            sched.append_decode_tokens(batch.seq_ids, np.array([[1], [2], [3]]), np.ones(3, dtype=np.int64))
            with pytest.raises(ValueError, match="no decode step in flight"):   # that step is in already
                sched.append_decode_tokens(batch.seq_ids, np.array([[1], [2], [3]]), np.ones(3, dtype=np.int64))
            sched.check_integrity()
    assert results[0] == results[1]
    assert results[1][1].output_token_ids == (7, 40, 41, 42, 43)     # b is the longest: first


def test_append_decode_tokens_drops_finished_sequences_and_checks_input(make_sched) -> None:
    sched = make_sched()
    for name in "ab":
        sched.add_seq(name, [1, 2], 16)
    batch = prefill_all(sched).decode
    step_two = sched.schedule().decode               # ZOS: step two scheduled before step one's tokens
    sched.finish_seq("a", "stop")
    with pytest.raises(ValueError, match=r"expected \[2, k\]"):
        sched.append_decode_tokens(batch.seq_ids, np.array([[1], [2], [3]]), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"outside \[1, 1\]"):
        sched.append_decode_tokens(batch.seq_ids, np.array([[1], [2]]), np.array([1, 2]))
    with pytest.raises(ValueError, match="twice"):
        sched.append_decode_tokens(("b", "b"), np.array([[1], [2]]), np.array([1, 1]))
    assert sched.append_decode_tokens(batch.seq_ids, np.array([[5], [6]]), np.array([1, 1])) == 1
    assert sched.append_decode_tokens(step_two.seq_ids, np.array([[7], [8]]), np.array([1, 1])) == 1
    assert sched.get_seq("b").output_token_ids == (7, 6, 8)
    with pytest.raises(ValueError, match="no decode step in flight"):
        sched.append_decode_tokens(("b",), np.array([[1]]), np.array([1]))
    sched.check_integrity()


def test_rows_generation_changes_exactly_when_the_rows_do(make_sched) -> None:
    sched = make_sched()
    sched.add_seq("a", [1, 2, 3], 16)
    sched.add_seq("b", [4, 5], 16)
    first = prefill_all(sched, decode_token=9)
    same = decode_step(sched)
    assert same.decode.seq_ids == first.decode.seq_ids and same.decode.rows_generation == first.decode.rows_generation
    sched.finish_seq("b", FinishReason.STOP)
    fewer = decode_step(sched)
    assert fewer.decode.seq_ids == ("a",) and fewer.decode.rows_generation != same.decode.rows_generation
    assert not fewer.decode.in_flight.any()
