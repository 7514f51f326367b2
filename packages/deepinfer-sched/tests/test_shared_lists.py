"""Shared token logs (`add_seq(..., share_list=True)`, `fork_seq(..., branch_lists=...)`): the
scheduler reads the caller's `TokenLog` in place and never writes it; the caller appends first."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from deepinfer.sched import EngineType, SeqStatus, StepKind, TokenLog, seq_key


def history(sched, seq_id):
    return sched._st.lookup(seq_id).token_ids      # test-only peek: the list the scheduler reads


def decode(sched, tokens_by_id, lists):
    """One decode step; each token is appended to its shared list (if any) before the scheduler."""
    out = sched.schedule()
    assert out.kind is StepKind.DECODE
    ids = out.decode.seq_ids
    for seq_id in ids:
        if seq_key(seq_id) in lists:
            lists[seq_key(seq_id)].append(tokens_by_id[seq_id])
    sched.append_decode_tokens(ids, np.array([[tokens_by_id[s]] for s in ids]), np.ones(len(ids), dtype=np.int64))
    return out


def test_a_shared_list_is_read_in_place_and_never_written(make_sched) -> None:
    sched = make_sched()
    tokens = TokenLog([5, 6, 7, 8, 9, 10])
    sched.add_seq("a", tokens, 8, share_list=True)
    assert history(sched, "a") is tokens
    out = sched.schedule()
    assert out.prefill[0].token_ids.tolist() == [5, 6, 7, 8, 9, 10]
    tokens.append(1)
    sched.append_tokens("a", [1])
    first = decode(sched, {"a": 2}, {"a": tokens})
    second = sched.schedule()                      # the same rows: the batched fast path
    assert second.decode.seq_ids is first.decode.seq_ids
    tokens.append(3)
    sched.append_decode_tokens(second.decode.seq_ids, np.array([[3]]), np.ones(1, dtype=np.int64))
    assert tokens == [5, 6, 7, 8, 9, 10, 1, 2, 3] and history(sched, "a") is tokens
    view = sched.get_seq("a")
    assert view.prompt_token_ids == (5, 6, 7, 8, 9, 10) and view.output_token_ids == (1, 2, 3)
    sched.check_integrity()
    sched.finish_seq("a", "stop")
    assert tokens == [5, 6, 7, 8, 9, 10, 1, 2, 3]
    sched.check_integrity()


def test_without_share_list_the_scheduler_keeps_its_own_copy(make_sched) -> None:
    sched = make_sched()
    prompt = [5, 6, 7]
    sched.add_seq("a", prompt, 8)
    sched.schedule()
    sched.append_tokens("a", [1])
    decode(sched, {"a": 2}, {})
    assert prompt == [5, 6, 7] and history(sched, "a") is not prompt
    assert sched.get_seq("a").output_token_ids == (1, 2)
    sched.check_integrity()


def test_share_list_needs_a_token_log_of_ints(make_sched) -> None:
    sched = make_sched()
    for prompt in ((1, 2), np.array([1, 2]), [1, 2], TokenLog([1, True]), TokenLog([1, -2])):
        with pytest.raises(ValueError):
            sched.add_seq("a", prompt, 8, share_list=True)
    with pytest.raises(ValueError, match="share_list"):
        sched.add_seq("a", [1], 8, share_list=1)
    assert not sched.has_unfinished()


def test_append_tokens_refuses_a_shared_list_that_lacks_them(make_sched) -> None:
    sched = make_sched()
    tokens = TokenLog([5, 6, 7])
    sched.add_seq("a", tokens, 8, share_list=True)
    sched.schedule()
    before = sched.get_seq("a")
    with pytest.raises(ValueError, match="shares its token list"):
        sched.append_tokens("a", [1])               # not appended to the list first
    tokens.append(2)
    with pytest.raises(ValueError, match="shares its token list"):
        sched.append_tokens("a", [1])               # the list ends with another token
    assert sched.get_seq("a") == dataclasses.replace(before, output_token_ids=(2,))   # only the list moved
    tokens[-1] = 1
    sched.append_tokens("a", [1])
    assert sched.get_seq("a").output_token_ids == (1,)
    sched.check_integrity()


def test_integrity_check_finds_a_shared_list_the_caller_did_not_extend(make_sched) -> None:
    sched = make_sched()
    tokens = TokenLog([5, 6, 7])
    sched.add_seq("a", tokens, 8, share_list=True)
    sched.schedule()
    tokens.append(1)
    sched.append_tokens("a", [1])
    out = sched.schedule()
    sched.append_decode_tokens(out.decode.seq_ids, np.array([[2]]), np.ones(1, dtype=np.int64))  # list not extended
    with pytest.raises(RuntimeError, match="num_output is stale"):
        sched.check_integrity()


def test_shared_and_own_lists_mix_in_one_decode_step(make_sched) -> None:
    sched = make_sched()
    shared = TokenLog([1, 2, 3])
    sched.add_seq("s", shared, 8, share_list=True)
    sched.add_seq("o", [4, 5, 6], 8)
    out = sched.schedule()
    assert [c.seq_id for c in out.prefill] == ["s", "o"]
    shared.append(10)
    sched.append_tokens("s", [10])
    sched.append_tokens("o", [20])
    for step in range(2):
        decode(sched, {"s": 11 + step, "o": 21 + step}, {"s": shared})
    assert shared == [1, 2, 3, 10, 11, 12]
    assert sched.get_seq("o").output_token_ids == (20, 21, 22)
    sched.check_integrity()


def test_shared_lists_with_speculative_counts(make_sched) -> None:
    sched = make_sched(nextn=2)
    tokens = TokenLog([1, 2, 3])
    sched.add_seq("a", tokens, 16, share_list=True)
    sched.schedule()
    tokens.append(10)
    sched.append_tokens("a", [10])
    out = sched.schedule()
    tokens.extend([11, 12])                           # 2 of the 3 verified tokens kept
    sched.append_decode_tokens(out.decode.seq_ids, np.array([[11, 12, 99]]), np.array([2]))
    assert tokens == [1, 2, 3, 10, 11, 12] and sched.get_seq("a").output_token_ids == (10, 11, 12)
    out = sched.schedule()
    tokens.append(13)
    sched.append_tokens("a", [13])
    assert out.decode.seq_lens.tolist() == [8] and sched.get_seq("a").num_computed_tokens == 6
    sched.check_integrity()


def test_fork_gives_each_branch_its_list(make_sched) -> None:
    sched = make_sched()
    parent = TokenLog([5, 6, 7, 8, 9])
    sched.add_seq("p", parent, 8, share_list=True)
    sched.schedule()
    parent.append(1)
    sched.append_tokens("p", [1])
    lists = [TokenLog(parent), TokenLog(parent)]
    for bad in ([TokenLog(parent)], [parent, TokenLog(parent)], [lists[0], lists[0]],
                [TokenLog(parent), TokenLog(parent[:-1])], [TokenLog(parent), tuple(parent)],
                [TokenLog(parent), list(parent)]):
        with pytest.raises(ValueError, match="branch_lists"):
            sched.fork_seq("p", 2, branch_lists=bad)
    sched.check_integrity()
    assert sched.fork_seq("p", 2, branch_lists=lists) == ("_p.1", "_p.2")
    assert history(sched, "_p.1") is lists[0] and history(sched, "p.2") is lists[1]
    assert sched.fork_seq("p", 1) == ("_p.3",)        # no lists: a copy the scheduler appends to
    own = history(sched, "p.3")
    assert own == parent and own is not parent
    out = decode(sched, {"p": 2, "p.1": 3, "p.2": 4, "p.3": 5}, {"p": parent, "p.1": lists[0], "p.2": lists[1]})
    assert out.decode.seq_ids == ("p", "p.1", "p.2", "p.3")
    assert parent[-2:] == [1, 2] and lists[0][-2:] == [1, 3] and lists[1][-2:] == [1, 4] and own[-2:] == [1, 5]
    sched.check_integrity()


def test_a_recompute_prefills_the_shared_list_again(make_sched) -> None:
    sched = make_sched(num_blocks=4, stop_preempted_request=False)     # 3 usable blocks of 4 tokens
    lists = {"a": TokenLog([1, 2, 3, 4]), "b": TokenLog([5, 6, 7, 8])}
    for seq_id, tokens in lists.items():
        sched.add_seq(seq_id, tokens, 8, share_list=True)
    out = sched.schedule()
    for chunk in out.prefill:
        lists[chunk.seq_id].append(40 + len(chunk.seq_id))
        sched.append_tokens(chunk.seq_id, [lists[chunk.seq_id][-1]])
    out = sched.schedule()                           # both need a second block: one is preempted
    assert len(out.recomputed_seq_ids) == 1
    (victim,) = out.recomputed_seq_ids
    (kept,) = out.decode.seq_ids
    lists[kept].append(50)
    sched.append_decode_tokens(out.decode.seq_ids, np.array([[50]]), np.ones(1, dtype=np.int64))
    sched.finish_seq(kept, "stop")
    assert sched.get_seq(victim).status is SeqStatus.WAITING and history(sched, victim) is lists[victim]
    out = sched.schedule()
    assert [(c.seq_id, c.token_ids.tolist()) for c in out.prefill] == [(victim, lists[victim])]
    lists[victim].append(60)                          # the recompute's sampled token
    sched.append_tokens(victim, [60])
    assert sched.get_seq(victim).output_token_ids == (41, 60)
    sched.check_integrity()


def test_add_prefilled_seq_shares_a_list_ending_with_the_first_token(make_sched) -> None:
    sched = make_sched(engine_type=EngineType.COMPLETION)
    with pytest.raises(ValueError, match="followed by first_token_id"):
        sched.add_prefilled_seq("a", TokenLog([1, 2, 3]), 9, 8, share_list=True)
    tokens = TokenLog([1, 2, 3, 9])
    assert sched.add_prefilled_seq("a", tokens, 9, 8, share_list=True) is not None
    assert history(sched, "a") is tokens
    view = sched.get_seq("a")
    assert view.prompt_token_ids == (1, 2, 3) and view.output_token_ids == (9,) and view.num_computed_tokens == 3
    decode(sched, {"a": 10}, {"a": tokens})
    assert tokens == [1, 2, 3, 9, 10]
    sched.check_integrity()
