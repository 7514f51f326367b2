"""Prefix caching in the scheduler: hits, snapshot points, deferred registration, eviction, reset,
preemption and fork (exact block ids, slots and snapshot ids)."""

from __future__ import annotations

import pytest

from deepinfer.cache import BlockManager
from deepinfer.sched import ConfigError, PrefixCacheStats, Scheduler, SchedulerConfig, StepKind, seq_key

A = list(range(100, 110))            # 10 tokens: blocks [100..103], [104..107], then 2 tokens


def chunks_of(out):
    return [(c.seq_id, c.start, c.end, c.completes_prefill, c.num_cached_tokens) for c in out.prefill]


def finish_prefill(sched, out, token=7):
    for chunk in out.prefill:
        if chunk.completes_prefill:
            sched.append_tokens(chunk.seq_id, [token])


def run_prefill(sched):
    out = sched.schedule()
    assert out.kind is StepKind.PREFILL
    finish_prefill(sched, out)
    return out


def cached(make_sched, **config):
    return make_sched(enable_prefix_caching=True, **config)


def test_a_prompt_is_cut_at_its_last_block_boundary_and_snapshotted_there(make_sched) -> None:
    sched = cached(make_sched)
    sched.add_seq("a", A, 4)
    out = run_prefill(sched)
    assert chunks_of(out) == [("a", 0, 8, False, 0)]
    assert out.zero_states.tolist() == [1] and out.save_states.tolist() == [[1, 1, 8]]   # slot 1 -> snapshot 1 at 8
    out = run_prefill(sched)
    assert chunks_of(out) == [("a", 8, 10, True, 0)] and not len(out.save_states)
    assert sched.prefix_cache_stats == PrefixCacheStats(queries=10, hits=0, num_cached_blocks=2, num_snapshots=1)
    sched.check_integrity()


def test_a_later_prompt_takes_the_cached_blocks_and_restores_the_snapshot(make_sched) -> None:
    sched = cached(make_sched)
    sched.add_seq("a", A, 4)
    run_prefill(sched), run_prefill(sched)
    sched.add_seq("b", A[:8] + [1, 2, 3], 4)
    out = run_prefill(sched)
    assert chunks_of(out) == [("b", 8, 11, True, 8)]
    assert out.prefill[0].block_table.tolist() == [1, 2, 4]            # a holds 1, 2, 3
    assert out.restore_states.tolist() == [[1, 2, 8]] and not len(out.zero_states)
    assert sched.get_seq("b").num_computed_tokens == 11
    assert sched.prefix_cache_stats.hits == 8 and sched.prefix_cache_stats.queries == 21
    sched.check_integrity()
    sched.finish_seq("a", "stop")
    sched.finish_seq("b", "stop")
    sched.check_integrity()


def test_the_last_token_is_always_computed(make_sched) -> None:
    sched = cached(make_sched)
    sched.add_seq("a", A[:8], 4)                           # two full blocks: no cut, snapshot at 8
    out = run_prefill(sched)
    assert chunks_of(out) == [("a", 0, 8, True, 0)] and out.save_states.tolist() == [[1, 1, 8]]
    sched.add_seq("same", A[:8], 4)                        # a hit at 8 would leave nothing to sample: the
    out = run_prefill(sched)                               # blocks it may take end at 4, where no snapshot
    assert chunks_of(out) == [("same", 0, 4, False, 0)]    # is: it saves one there
    assert out.save_states.tolist() == [[2, 2, 4]]
    assert chunks_of(run_prefill(sched)) == [("same", 4, 8, True, 0)]
    sched.add_seq("again", A[:8], 4)
    assert chunks_of(run_prefill(sched)) == [("again", 4, 8, True, 4)]
    sched.check_integrity()


def test_a_shared_prefix_gets_a_snapshot_where_a_prompt_leaves_it(make_sched) -> None:
    sched = cached(make_sched)
    system = [9] * 8
    sched.add_seq("a", system + [1, 2, 3, 4, 5], 4)
    assert chunks_of(run_prefill(sched)) == [("a", 0, 12, False, 0)]    # its last block boundary
    run_prefill(sched)
    sched.add_seq("b", system + [6, 7, 8, 9, 10], 4)      # shares 2 cached blocks, no snapshot at 8:
    out = run_prefill(sched)                               # cut there and save one
    assert chunks_of(out) == [("b", 0, 8, False, 0)] and len(out.save_states) == 1
    run_prefill(sched), run_prefill(sched)                 # [8, 12) to its last boundary, then [12, 13)
    sched.add_seq("c", system + [11, 12], 4)
    assert chunks_of(run_prefill(sched)) == [("c", 8, 10, True, 8)]
    sched.check_integrity()


def test_snapshot_cuts_let_other_prompts_join_the_step(make_sched) -> None:
    sched = cached(make_sched)
    sched.add_seq("a", A, 4)
    sched.add_seq("c", [5, 6, 7, 8, 9, 10, 11], 4)
    out = run_prefill(sched)
    assert chunks_of(out) == [("a", 0, 8, False, 0), ("c", 0, 4, False, 0)]
    assert out.save_states.tolist() == [[1, 1, 8], [2, 2, 4]]
    out = run_prefill(sched)
    assert chunks_of(out) == [("a", 8, 10, True, 0), ("c", 4, 7, True, 0)]
    sched.check_integrity()


def test_nothing_registered_in_a_step_is_hit_in_the_same_step(make_sched) -> None:
    sched = cached(make_sched)
    sched.add_seq("a", A[:8], 4)
    sched.add_seq("b", A[:8] + [1], 4)
    out = run_prefill(sched)
    assert chunks_of(out) == [("a", 0, 8, True, 0), ("b", 0, 8, False, 0)]
    assert out.save_states.tolist() == [[1, 1, 8]]         # b's snapshot point is a's: saved once
    out = run_prefill(sched)
    assert chunks_of(out) == [("b", 8, 9, True, 0)]
    sched.check_integrity()


def test_an_evicted_prefix_is_prefilled_again(make_sched) -> None:
    sched = cached(make_sched, num_blocks=5)               # usable 1..4
    sched.add_seq("a", A, 4)
    run_prefill(sched), run_prefill(sched)
    sched.finish_seq("a", "stop")                          # freed last first: free list 4, 3, 2, 1
    sched.add_seq("x", [1] * 5, 4)                         # takes 4 (uncached) and 3
    run_prefill(sched), run_prefill(sched)
    sched.finish_seq("x", "stop")
    assert sched.prefix_cache_stats.num_cached_blocks == 3     # 2 of a's, 1 of x's
    sched.add_seq("y", [2] * 9, 4)                         # 3 blocks: evicts a's block 2 (LRU) first
    run_prefill(sched), run_prefill(sched)
    sched.finish_seq("y", "stop")
    sched.add_seq("b", A, 4)
    out = run_prefill(sched)
    assert chunks_of(out) == [("b", 0, 8, False, 0)]       # a's second block is gone: no snapshot to resume
    sched.check_integrity()


def test_reset_forgets_every_cached_block_and_snapshot(make_sched) -> None:
    sched = cached(make_sched)
    sched.add_seq("a", A, 4)
    run_prefill(sched), run_prefill(sched)
    assert sched.reset_prefix_cache()
    assert sched.prefix_cache_stats.num_cached_blocks == sched.prefix_cache_stats.num_snapshots == 0
    sched.add_seq("b", A, 4)
    assert chunks_of(run_prefill(sched)) == [("b", 0, 8, False, 0)]
    assert not make_sched().reset_prefix_cache()           # caching off: nothing to reset


def test_a_recomputed_sequence_resumes_from_its_own_cached_blocks(make_sched) -> None:
    sched = cached(make_sched, num_blocks=5, stop_preempted_request=False)
    sched.add_seq("a", A[:7], 8)
    run_prefill(sched), run_prefill(sched)                 # [0, 4) then [4, 7): blocks 1, 2
    sched.add_seq("b", [3] * 7, 8)
    run_prefill(sched), run_prefill(sched)                 # blocks 3, 4
    out = sched.schedule()                                 # decode: a needs no block, b's 8th fits
    sched.append_decode_tokens(out.decode.seq_ids, [[1], [1]], [1, 1])
    out = sched.schedule()                                 # both need a 3rd block: a is preempted
    assert out.recomputed_seq_ids == ("a",) and out.decode.seq_ids == ("b",)
    sched.append_decode_tokens(out.decode.seq_ids, [[1]], [1])
    sched.finish_seq("b", "stop")
    out = run_prefill(sched)                               # 7 prompt + 2 output tokens: its cached first
    assert chunks_of(out) == [("a", 4, 9, True, 4)]        # block and the snapshot at 4 (a recompute is
    assert out.prefill[0].block_table.tolist() == [1, 2, 4]    # not cut at its last block boundary)
    sched.check_integrity()


def test_fork_branches_share_cached_blocks(make_sched) -> None:
    sched = cached(make_sched)
    sched.add_seq("a", A, 4)
    run_prefill(sched), run_prefill(sched)
    branches = sched.fork_seq("a", 2)
    out = sched.schedule()
    assert out.kind is StepKind.DECODE and len(out.clone_blocks) == 2     # each copies the partial block 3
    sched.append_decode_tokens(out.decode.seq_ids, [[1]] * 3, [1] * 3)
    for seq_id in ("a", *[seq_key(b) for b in branches]):
        sched.finish_seq(seq_id, "stop")
    sched.check_integrity()
    sched.add_seq("b", A[:8] + [4], 4)
    assert chunks_of(run_prefill(sched)) == [("b", 8, 9, True, 8)]


def test_config_and_constructor_checks() -> None:
    with pytest.raises(ConfigError, match="prefix_cache_key must be bytes"):
        SchedulerConfig(block_size=4, max_model_len=8, prefix_cache_key="x")
    with pytest.raises(ValueError, match="needs kv_blocks and snapshot_slots with a hash index"):
        Scheduler(SchedulerConfig(block_size=4, max_model_len=8, enable_prefix_caching=True),
                  BlockManager(4), BlockManager(3))


def test_a_shared_prefix_is_cut_once_per_step(make_sched) -> None:
    sched = cached(make_sched)
    system = [9] * 8
    sched.add_seq("a", system + [1, 2, 3, 4, 5], 4)
    run_prefill(sched), run_prefill(sched)
    sched.add_seq("b", system + [6, 7, 8, 9, 10], 4)
    sched.add_seq("c", system + [11, 12, 13, 14, 15], 4)
    out = run_prefill(sched)                               # c would save b's snapshot again: not cut at 8
    assert chunks_of(out) == [("b", 0, 8, False, 0), ("c", 0, 12, False, 0)]
    assert out.save_states.tolist() == [[2, 2, 8], [3, 3, 12]]


def test_the_rest_of_a_prompt_cut_at_a_snapshot_point_does_not_wait_for_an_attempt_point(make_sched) -> None:
    sched = cached(make_sched)
    sched.add_seq("a", [1, 2, 3], 50)
    run_prefill(sched)
    out = sched.schedule()                                 # decode step 0; step 1 is no attempt point
    sched.append_decode_tokens(out.decode.seq_ids, [[1]], [1])
    sched.finish_seq("a", "stop")
    sched.add_seq("c", [4, 5, 6], 50)
    sched.add_seq("b", A, 4)
    assert chunks_of(run_prefill(sched)) == [("c", 0, 3, True, 0), ("b", 0, 8, False, 0)]   # nothing ran
    out = sched.schedule()                                 # c runs now, yet b's rest goes at once
    assert out.kind is StepKind.PREFILL and chunks_of(out) == [("b", 8, 10, True, 0)]
    finish_prefill(sched, out)
    assert sched.schedule().kind is StepKind.DECODE
