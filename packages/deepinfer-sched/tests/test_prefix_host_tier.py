"""The prefix cache's host tier in the scheduler: cached blocks and snapshots the device pools evict
are spilled to host entries (exact pairs), a later hit loads them back into new blocks or restores
the snapshot from host memory, and the host tier's own LRU evictions are simply misses."""

from __future__ import annotations

import pytest

from deepinfer.cache import BlockManager
from deepinfer.sched import Scheduler, SchedulerConfig, StepKind

A = list(range(100, 110))            # 10 tokens: blocks [100..103], [104..107], then 2 tokens


def chunks_of(out):
    return [(c.seq_id, c.start, c.end, c.completes_prefill, c.num_cached_tokens) for c in out.prefill]


def run_prefill(sched):
    out = sched.schedule()
    assert out.kind is StepKind.PREFILL
    for chunk in out.prefill:
        if chunk.completes_prefill:
            sched.append_tokens(chunk.seq_id, [7])
    return out


def prefilled(sched, seq_id, tokens):
    """Adds a sequence, runs its prefill to the end (returning each step's output) and finishes it."""
    sched.add_seq(seq_id, tokens, 4)
    outs = []
    while sched.get_seq(seq_id).num_computed_tokens < len(tokens):
        outs.append(run_prefill(sched))
    sched.finish_seq(seq_id, "stop")
    return outs


def test_evicted_blocks_spill_to_host_and_a_hit_loads_them_back(make_sched) -> None:
    sched = make_sched(enable_prefix_caching=True, num_blocks=5, host=(4, 2))     # usable KV blocks 1..4
    prefilled(sched, "a", A)                               # blocks 1, 2 cached (+ a snapshot at 8); 3 partial
    prefilled(sched, "x", [1] * 5)                         # takes 4 and 3: free list now 2, 1, 3, 4
    outs = prefilled(sched, "y", [2] * 9)                  # takes 2 and 1: a's blocks leave the device
    assert outs[0].spill_blocks.tolist() == [[2, 1], [1, 2]]       # (KV block, host block), as evicted
    stats = sched.prefix_cache_stats
    assert (stats.num_host_spills, stats.num_host_blocks, stats.num_host_snapshots) == (2, 2, 0)
    sched.check_integrity()
    sched.add_seq("b", A[:8] + [1, 2, 3], 4)
    out = run_prefill(sched)
    assert chunks_of(out) == [("b", 8, 11, True, 8)]
    assert out.prefill[0].block_table.tolist() == [4, 3, 1]        # new blocks for the host ones, then one more
    assert out.load_blocks.tolist() == [[2, 4], [1, 3]]            # (host block, KV block)
    assert out.spill_blocks.tolist() == [[4, 3], [1, 4]]           # x's and y's first blocks, evicted for b:
    assert out.restore_states.tolist() == [[1, 4, 8]]              # copied out before anything is loaded
    assert not len(out.restore_host_states)
    stats = sched.prefix_cache_stats
    assert (stats.hits, stats.host_hits, stats.num_host_spills, stats.num_host_blocks) == (8, 8, 4, 4)
    sched.finish_seq("b", "stop")
    sched.add_seq("c", A[:8] + [5], 4)                     # the loaded blocks are cached on the device again
    out = run_prefill(sched)
    assert chunks_of(out) == [("c", 8, 9, True, 8)] and not len(out.load_blocks)
    sched.check_integrity()


def test_a_hits_host_entries_are_not_overwritten_by_the_spills_of_its_own_step(make_sched) -> None:
    sched = make_sched(enable_prefix_caching=True, num_blocks=5, host=(2, 2))
    prefilled(sched, "a", A)
    prefilled(sched, "x", [1] * 5)
    assert prefilled(sched, "y", [2] * 9)[0].spill_blocks.tolist() == [[2, 1], [1, 2]]   # the host is full
    sched.add_seq("b", A[:8] + [1, 2, 3], 4)
    out = run_prefill(sched)                               # loads host 2 and 1 while evicting two blocks:
    assert out.load_blocks.tolist() == [[2, 4], [1, 3]]    # no host entry is free for them, the loads'
    assert not len(out.spill_blocks)                       # entries are held: those evictions are dropped
    assert sched.prefix_cache_stats.num_host_blocks == 2
    sched.check_integrity()                                # (the holds end with the step)


def test_an_evicted_snapshot_is_restored_from_host_memory(make_sched) -> None:
    sched = make_sched(enable_prefix_caching=True, num_snapshots=1, host=(4, 2))
    prefilled(sched, "a", A)                               # snapshot slot 1 holds a's state at 8
    outs = prefilled(sched, "x", [1] * 5)                  # x's snapshot at 4 takes slot 1
    assert outs[0].spill_snapshots.tolist() == [[1, 1]]    # (snapshot slot, host snapshot)
    sched.add_seq("b", A[:8] + [1, 2, 3], 4)
    out = run_prefill(sched)
    assert chunks_of(out) == [("b", 8, 11, True, 8)] and not len(out.load_blocks)
    assert out.restore_host_states.tolist() == [[1, 3, 8]] and not len(out.restore_states)
    assert sched.prefix_cache_stats.host_hits == 0         # the blocks were still on the device
    sched.check_integrity()


def test_what_the_host_tier_evicts_is_prefilled_again(make_sched) -> None:
    sched = make_sched(enable_prefix_caching=True, num_blocks=5, host=(1, 1))
    prefilled(sched, "a", A)
    prefilled(sched, "x", [1] * 5)
    outs = prefilled(sched, "y", [2] * 9)                  # a's second block, then its first, into host block 1
    assert outs[0].spill_blocks.tolist() == [[2, 1], [1, 1]]
    assert sched.prefix_cache_stats.num_host_blocks == 1
    sched.add_seq("b", A[:8] + [1, 2, 3], 4)
    out = run_prefill(sched)                               # block 0 is in host memory, but no snapshot ends
    assert chunks_of(out) == [("b", 0, 4, False, 0)]       # there: prefilled from scratch, cut to save one
    assert not len(out.load_blocks)
    assert sched.reset_prefix_cache()
    assert sched.prefix_cache_stats.num_host_blocks == sched.prefix_cache_stats.num_host_snapshots == 0
    sched.check_integrity()


def test_the_host_tier_needs_both_pools() -> None:
    config = SchedulerConfig(block_size=4, max_model_len=8, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="needs host_blocks and host_snapshots"):
        Scheduler(config, BlockManager(4), BlockManager(3), snapshot_slots=BlockManager(3),
                  host_blocks=BlockManager(3))
