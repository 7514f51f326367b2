"""Prefill admission: FIFO order, budgets, chunking, capacity, ignored reasons (exact values)."""

from __future__ import annotations

import pytest

from deepinfer.sched import EngineType, IgnoredSeq, IgnoreReason, StepKind


def chunks_of(out):
    return [(c.seq_id, c.start, c.end, c.completes_prefill) for c in out.prefill]


def sample_first_tokens(sched, out, token=7):
    for chunk in out.prefill:
        if chunk.completes_prefill:
            sched.append_tokens(chunk.seq_id, [token])


def test_fifo_admission_token_budget_and_one_chunked_request_per_step(make_sched) -> None:
    sched = make_sched(max_num_batched_tokens=16)
    sched.add_seq("a", list(range(10)), 8)
    sched.add_seq("b", list(range(100, 110)), 8)
    sched.add_seq("c", [1, 2, 3], 8)

    out = sched.schedule()
    assert out.kind is StepKind.PREFILL
    # a fits whole; b is cut at the remaining budget (6) and nothing joins after a chunk.
    assert chunks_of(out) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert [c.block_table.tolist() for c in out.prefill] == [[1, 2, 3], [4, 5]]
    assert [c.state_slot for c in out.prefill] == [1, 2]
    assert out.zero_states.tolist() == [1, 2]
    assert out.prefill[1].token_ids.tolist() == list(range(100, 106))
    sample_first_tokens(sched, out)

    out = sched.schedule()   # still at decode step 0, an ANY point: the chunked b goes first
    assert chunks_of(out) == [("b", 6, 10, True), ("c", 0, 3, True)]
    assert [c.block_table.tolist() for c in out.prefill] == [[4, 5, 6], [7]]
    assert out.zero_states.tolist() == [3]
    sample_first_tokens(sched, out)
    sched.check_integrity()

    out = sched.schedule()
    assert out.kind is StepKind.DECODE
    assert out.decode.seq_ids == ("a", "b", "c")


def test_chunks_are_cut_on_checkpoints(make_sched) -> None:
    sched = make_sched(max_num_batched_tokens=10, chunk_checkpoints=(8, 16, 24))
    sched.add_seq("a", list(range(20)), 4)
    sched.add_seq("b", [5] * 5, 4)
    assert chunks_of(sched.schedule()) == [("a", 0, 8, False)]     # 10 fits, cut back to 8
    assert chunks_of(sched.schedule()) == [("a", 8, 16, False)]    # 18 fits, cut back to 16
    out = sched.schedule()
    assert chunks_of(out) == [("a", 16, 20, True), ("b", 0, 5, True)]  # the rest; b uses 5 of 6 left
    sched.check_integrity()


def test_checkpoint_out_of_reach_cuts_at_budget_only_in_an_empty_step(make_sched) -> None:
    sched = make_sched(max_num_batched_tokens=10, chunk_checkpoints=(50,))
    sched.add_seq("x", [1, 2, 3, 4], 4)
    sched.add_seq("a", list(range(20)), 4)
    out = sched.schedule()
    assert chunks_of(out) == [("x", 0, 4, True)]   # a would need a cut off-checkpoint: waits
    sample_first_tokens(sched, out)
    assert chunks_of(sched.schedule()) == [("a", 0, 10, False)]   # alone: cut at the budget
    assert chunks_of(sched.schedule()) == [("a", 10, 20, True)]


def test_max_num_prompts_limits_sequences_per_step(make_sched) -> None:
    sched = make_sched(max_num_prompts=2)
    for name in "abc":
        sched.add_seq(name, [1, 2], 4)
    assert [c.seq_id for c in sched.schedule().prefill] == ["a", "b"]
    assert [c.seq_id for c in sched.schedule().prefill] == ["c"]


def test_prefill_max_sum_seqlen_k_bounds_the_step(make_sched) -> None:
    sched = make_sched(max_model_len=16, prefill_max_sum_seqlen_k=20)
    sched.add_seq("a", [1] * 12, 4)
    sched.add_seq("b", [2] * 12, 4)
    sched.add_seq("c", [3] * 2, 4)
    assert chunks_of(sched.schedule()) == [("a", 0, 12, True), ("b", 0, 8, False)]   # 12 + 8 = 20
    # b's K length is 12 at its last chunk, leaving 8: c (K 2) joins.
    assert chunks_of(sched.schedule()) == [("b", 8, 12, True), ("c", 0, 2, True)]


def test_sum_k_counts_tokens_already_computed(make_sched) -> None:
    sched = make_sched(max_model_len=16, prefill_max_sum_seqlen_k=16, max_num_batched_tokens=6)
    sched.add_seq("a", [1] * 14, 4)
    sched.add_seq("b", [2] * 4, 4)
    assert chunks_of(sched.schedule()) == [("a", 0, 6, False)]
    assert chunks_of(sched.schedule()) == [("a", 6, 12, False)]
    # a's last chunk has K = 14, so only 2 of b's K fit: b is cut to 2 tokens.
    assert chunks_of(sched.schedule()) == [("a", 12, 14, True), ("b", 0, 2, False)]


def test_max_num_seqs_makes_later_requests_wait(make_sched) -> None:
    sched = make_sched(max_num_seqs=2, max_model_len=256)
    for name in "abc":
        sched.add_seq(name, [1, 2, 3], 4)
    out = sched.schedule()
    assert [c.seq_id for c in out.prefill] == ["a", "b"]
    sample_first_tokens(sched, out)
    assert sched.schedule().kind is StepKind.DECODE   # c cannot be admitted: not wanted
    sched.finish_seq("a", "stop")
    # At decode step 1 (not an attempt point) c waits; at an ANY point it would go. Run to it.
    kinds = []
    while True:
        out = sched.schedule()
        kinds.append(out.kind)
        if out.kind is StepKind.PREFILL:
            break
        sched.append_tokens("b", [9])
    assert kinds.count(StepKind.DECODE) == 69          # decode steps 2..70; step 70 is an ALL point
    assert [c.seq_id for c in out.prefill] == ["c"]
    assert out.num_decode_steps == 70


def test_no_state_slot_means_later(make_sched) -> None:
    sched = make_sched(num_slots=1)
    sched.add_seq("a", [1, 2], 4)
    sched.add_seq("b", [3, 4], 4)
    out = sched.schedule()
    assert [c.seq_id for c in out.prefill] == ["a"]
    sched.abort_seq("a")
    out = sched.schedule()
    assert [c.seq_id for c in out.prefill] == ["b"] and out.prefill[0].state_slot == 1
    assert out.zero_states.tolist() == [1]


def test_not_enough_blocks_means_later(make_sched) -> None:
    sched = make_sched(num_blocks=5)   # 4 usable blocks of 4 tokens
    sched.add_seq("a", [1] * 15, 4)
    sched.add_seq("b", [2] * 4, 4)
    out = sched.schedule()
    assert [c.seq_id for c in out.prefill] == ["a"]   # a holds all 4 blocks
    sample_first_tokens(sched, out)
    out = sched.schedule()                           # an ANY point, but b cannot get a block
    assert out.kind is StepKind.DECODE and out.decode.seq_ids == ("a",)
    sched.finish_seq("a", "length")
    assert [c.block_table.tolist() for c in sched.schedule().prefill] == [[1]]


def test_ignored_reasons_in_order(make_sched) -> None:
    sched = make_sched(num_blocks=5, max_model_len=64)
    sched.add_seq("empty", [], 4)
    sched.add_seq("long", [1] * 65, 4)
    sched.add_seq("big", [1] * 17, 4)       # 5 blocks of 4 > 4 usable
    sched.add_seq("gone", [1, 2], 4)
    sched.abort_seq("gone")
    assert sched.has_unfinished()
    out = sched.schedule()
    assert out.ignored == (
        IgnoredSeq("empty", IgnoreReason.EMPTY_PROMPT),
        IgnoredSeq("long", IgnoreReason.PROMPT_TOO_LONG),
        IgnoredSeq("big", IgnoreReason.PROMPT_EXCEEDS_KV_CAPACITY),
        IgnoredSeq("gone", IgnoreReason.ABORTED),
    )
    assert out.kind is StepKind.IDLE
    assert not sched.has_unfinished()
    assert sched.schedule().ignored == ()


def test_cache_usage_above_the_limit_blocks_the_prefill_wish_while_running(make_sched) -> None:
    kinds = {}
    for limit in (0.5, 0.7):
        sched = make_sched(num_blocks=11, max_cache_usage_for_prefill=limit)   # 10 usable blocks
        sched.add_seq("a", [1] * 24, 64)    # 6 blocks: usage 0.6
        sample_first_tokens(sched, sched.schedule())
        sched.add_seq("b", [1, 2], 4)
        kinds[limit] = sched.schedule().kind   # still decode step 0: an ANY point
    assert kinds == {0.5: StepKind.DECODE, 0.7: StepKind.PREFILL}


def test_recompute_prefills_prompt_and_output(make_sched) -> None:
    sched = make_sched(num_blocks=4, block_size=2, stop_preempted_request=False,
                       prefill_any_attempt_interval=1)      # 3 usable blocks of 2 tokens
    sched.add_seq("a", [1, 2, 3], 8)                         # 2 blocks
    sched.add_seq("b", [4, 5], 8)                            # 1 block
    out = sched.schedule()
    sample_first_tokens(sched, out, token=40)
    out = sched.schedule()
    # a: 4 positions fit its 2 blocks; b: 3 need a second block and none is free. Equal output
    # lengths: the earlier-running a is at the long end and is preempted for recompute.
    assert out.preempted_seq_ids == ("a",)
    assert out.decode.seq_ids == ("b",) and out.decode.block_tables.tolist() == [[3, 1]]
    assert sched.get_seq("a").status.name == "WAITING"
    sched.append_tokens("b", [41])
    out = sched.schedule()                   # a needs 2 blocks, 1 free: b decodes
    assert out.kind is StepKind.DECODE
    sched.finish_seq("b", "stop")
    out = sched.schedule()
    assert chunks_of(out) == [("a", 0, 4, True)]
    assert out.prefill[0].token_ids.tolist() == [1, 2, 3, 40]
    assert out.zero_states.tolist() == [out.prefill[0].state_slot]
    sched.append_tokens("a", [42])
    assert sched.get_seq("a").output_token_ids == (40, 42)
    sched.check_integrity()


def test_recompute_victim_too_big_for_the_cache_is_finished(make_sched) -> None:
    sched = make_sched(num_blocks=3, block_size=2, stop_preempted_request=False)   # 2 usable blocks
    sched.add_seq("a", [1, 2, 3], 8)
    sample_first_tokens(sched, sched.schedule(), token=40)
    assert sched.schedule().decode.seq_ids == ("a",)     # 3 -> 4 positions fit 2 blocks
    sched.append_tokens("a", [41])
    out = sched.schedule()        # 5 positions need 3 blocks: a preempts itself; 5 tokens never fit
    assert out.preempted_seq_ids == ("a",) and out.kind is StepKind.EMPTY_DECODE
    assert not sched.has_unfinished()


def test_recomputed_ids_name_the_preempted_sequences_queued_again(make_sched) -> None:
    sched = make_sched(num_blocks=4, block_size=2, stop_preempted_request=False,
                       prefill_any_attempt_interval=1)
    sched.add_seq("a", [1, 2, 3], 8)
    sched.add_seq("b", [4, 5], 8)
    sample_first_tokens(sched, sched.schedule(), token=40)
    out = sched.schedule()
    assert out.preempted_seq_ids == ("a",) and out.recomputed_seq_ids == ("a",)
    assert sched.get_seq("a").status.name == "WAITING"


def test_a_sequence_added_as_not_recomputable_is_finished_when_preempted(make_sched) -> None:
    sched = make_sched(num_blocks=4, block_size=2, stop_preempted_request=False,
                       prefill_any_attempt_interval=1)
    sched.add_seq("a", [1, 2, 3], 8, recomputable=False)
    sched.add_seq("b", [4, 5], 8)
    sample_first_tokens(sched, sched.schedule(), token=40)
    out = sched.schedule()
    assert out.preempted_seq_ids == ("a",) and out.recomputed_seq_ids == ()
    with pytest.raises(KeyError):
        sched.get_seq("a")
    sched.check_integrity()


def test_recompute_victim_whose_next_step_never_fits_is_finished(make_sched) -> None:
    # 2 usable blocks of 2 tokens. After 4 positions, a holds both blocks; its next step needs a
    # third. Its 4 tokens alone would fit on recompute, but the step after the recompute would not:
    # requeueing it would loop prefill -> preempt forever.
    sched = make_sched(num_blocks=3, block_size=2, stop_preempted_request=False)
    sched.add_seq("a", [1, 2], 8)
    sample_first_tokens(sched, sched.schedule(), token=40)
    assert sched.schedule().decode.seq_ids == ("a",)     # 2 -> 3 positions
    sched.append_tokens("a", [41])
    assert sched.schedule().decode.seq_ids == ("a",)     # 3 -> 4 positions fill both blocks
    sched.append_tokens("a", [42])
    out = sched.schedule()
    assert out.preempted_seq_ids == ("a",) and out.recomputed_seq_ids == ()
    assert not sched.has_unfinished()


def test_recomputable_must_be_a_bool(make_sched) -> None:
    sched = make_sched()
    with pytest.raises(ValueError, match="recomputable"):
        sched.add_seq("a", [1, 2], 8, recomputable=1)
    assert not sched.has_unfinished()


def test_cache_usage_limit_holds_with_nothing_running(make_sched) -> None:
    """A PROMPT engine runs nothing, but its prefilled sequences hold blocks until handed off: a new
    prompt waits while usage is above the limit; the rest of a prompt mid-prefill never does."""
    kinds = {}
    for limit in (0.5, 0.7):
        sched = make_sched(num_blocks=11, engine_type=EngineType.PROMPT, max_cache_usage_for_prefill=limit)
        sched.add_seq("a", [1] * 24, 4)              # 6 of 10 usable blocks: usage 0.6
        assert sched.schedule().kind is StepKind.PREFILL
        sched.add_seq("b", [1, 2], 4)
        kinds[limit] = sched.schedule().kind
    assert kinds == {0.5: StepKind.IDLE, 0.7: StepKind.PREFILL}
    sched = make_sched(num_blocks=11, max_num_batched_tokens=16, max_cache_usage_for_prefill=0.1)
    sched.add_seq("long", [1] * 32, 4)               # 8 blocks in two chunks of 16 tokens
    assert [c.end for c in sched.schedule().prefill] == [16]
    assert [c.end for c in sched.schedule().prefill] == [32]     # usage 0.4 > 0.1: goes on anyway
