"""Step-kind vote: attempt points, ALL vs ANY, the confirmation round, empty prompt steps, with
two schedulers voting through an in-process group (threads + barrier)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from deepinfer.sched import AttemptPoint, SchedulerConfig, SingleRankVoteGroup, StepKind, StepVoteGroup
from deepinfer.sched.vote import attempt_point, cast_vote, confirm_prefill


class ThreadGroup:
    """An all-reduce(MIN) over `world_size` threads; every call is logged per rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=10)
        self._inputs: list[tuple[int, ...] | None] = [None] * world_size
        self.log: list[list[tuple[int, ...]]] = [[] for _ in range(world_size)]

    def rank_view(self, rank: int) -> RankView:
        return RankView(self, rank)

    def reduce(self, rank: int, values: tuple[int, ...]) -> tuple[int, ...]:
        self._inputs[rank] = values
        self.log[rank].append(values)
        self._barrier.wait()
        result = tuple(min(column) for column in zip(*self._inputs))
        self._barrier.wait()          # nobody overwrites its input before all have read
        return result


class RankView:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce_min(self, values):
        return self._group.reduce(self._rank, tuple(values))


@pytest.fixture
def two_ranks(make_sched):
    group = ThreadGroup(2)
    config = dict(prefill_attempt_interval=3, prefill_any_attempt_interval=5, max_model_len=256)
    scheds = [make_sched(vote_group=group.rank_view(rank), **config) for rank in range(2)]
    pool = ThreadPoolExecutor(2)

    def step(tokens: int = 9):
        """One lockstep schedule() on both ranks; appends every sampled token; returns outputs."""
        outs = [future.result(timeout=10) for future in [pool.submit(s.schedule) for s in scheds]]
        for sched, out in zip(scheds, outs):
            for chunk in out.prefill:
                if chunk.completes_prefill:
                    sched.append_tokens(chunk.seq_id, [tokens])
            if out.decode is not None:
                for seq_id in out.decode.seq_ids:
                    sched.append_tokens(seq_id, [tokens])
            sched.check_integrity()
        return outs

    yield scheds, step, group
    pool.shutdown()


def kinds(outs):
    return tuple(out.kind for out in outs)


def test_group_protocols() -> None:
    assert isinstance(SingleRankVoteGroup(), StepVoteGroup)
    assert isinstance(ThreadGroup(2).rank_view(1), StepVoteGroup)
    assert SingleRankVoteGroup().all_reduce_min([3, 1]) == (3, 1)


def test_attempt_points() -> None:
    config = SchedulerConfig(block_size=4, max_model_len=64, prefill_attempt_interval=3,
                             prefill_any_attempt_interval=5)
    points = [attempt_point(config, step) for step in range(16)]
    assert [step for step, p in enumerate(points) if p is AttemptPoint.ANY] == [0, 5, 10, 15]
    assert [step for step, p in enumerate(points) if p is AttemptPoint.ALL] == [3, 6, 9, 12]


def test_all_point_needs_every_rank_any_point_needs_one(two_ranks) -> None:
    scheds, step, group = two_ranks        # ALL points: decode steps 3, 6, 9; ANY: 0, 5, 10
    for rank, sched in enumerate(scheds):
        sched.add_seq(f"r{rank}a", [1, 2, 3], 100)
    assert kinds(step()) == (StepKind.PREFILL, StepKind.PREFILL)     # decode step 0: ANY
    outs = step()
    assert kinds(outs) == (StepKind.DECODE, StepKind.DECODE) and outs[0].num_decode_steps == 1
    scheds[0].add_seq("r0b", [4, 5], 100)                             # only rank 0 wants more
    seen = [(step()[0].num_decode_steps) for _ in range(4)]           # steps 1, 2, 3 (ALL), 4
    assert seen == [2, 3, 4, 5]                                       # all four were decode steps
    outs = step()                                                     # step 5: ANY point
    assert kinds(outs) == (StepKind.PREFILL, StepKind.EMPTY_PROMPT)
    assert [c.seq_id for c in outs[0].prefill] == ["r0b"] and outs[1].prefill == ()
    outs = step()
    assert kinds(outs) == (StepKind.DECODE, StepKind.DECODE) and outs[0].decode.seq_ids == ("r0a", "r0b")
    # 8 steps ran round one; the 2 prefill steps also ran round two, on both ranks alike.
    assert [len(values) for values in group.log[0]] == [3, 1, 3, 3, 3, 3, 3, 3, 1, 3]
    assert len(group.log[1]) == len(group.log[0])

    scheds[0].add_seq("r0c", [1], 100)
    scheds[1].add_seq("r1b", [1], 100)
    outs = step()                                                     # step 6: ALL, both want
    assert outs[0].num_decode_steps == 6 and kinds(outs) == (StepKind.PREFILL, StepKind.PREFILL)
    assert kinds(step()) == (StepKind.DECODE, StepKind.DECODE)


def test_with_nothing_running_anywhere_prefill_starts_at_once(two_ranks) -> None:
    scheds, step, _ = two_ranks
    scheds[1].add_seq("r1a", [1, 2], 1)
    assert kinds(step()) == (StepKind.EMPTY_PROMPT, StepKind.PREFILL)
    assert kinds(step()) == (StepKind.EMPTY_DECODE, StepKind.DECODE)  # decode step 1
    scheds[1].finish_seq("r1a", "length")
    assert kinds(step()) == (StepKind.IDLE, StepKind.IDLE)
    scheds[0].add_seq("r0a", [1, 2], 1)
    outs = step()                                   # decode step 1 is no attempt point, but idle
    assert outs[0].num_decode_steps == 1 and kinds(outs) == (StepKind.PREFILL, StepKind.EMPTY_PROMPT)


class ScriptedPeer:
    """Rank 0 of two, the other rank scripted: round one says it wants prefill, round two says it
    scheduled nothing (slots or blocks ran out after it voted)."""

    world_size = 2
    rank = 0

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def all_reduce_min(self, values):
        values = tuple(values)
        self.calls.append(values)
        peer = (0, 1, 0) if len(values) == 3 else (1,)
        return tuple(min(a, b) for a, b in zip(values, peer))


def test_second_round_sends_everyone_to_decode_when_nobody_scheduled(make_sched) -> None:
    peer = ScriptedPeer()
    sched = make_sched(vote_group=peer, max_num_seqs=1)
    sched.add_seq("a", [1, 2], 100)
    sched.add_seq("b", [3, 4], 100)          # cannot be admitted: max_num_seqs=1
    out = sched.schedule()                    # step 0 (ANY): a
    assert out.kind is StepKind.PREFILL
    sched.append_tokens("a", [5])
    out = sched.schedule()                    # still step 0: the peer wants, this rank cannot
    assert out.kind is StepKind.DECODE and out.num_decode_steps == 1
    assert peer.calls[-2:] == [(1, 0, 0), (1,)]   # round one, then round two: nobody scheduled
    sched.append_tokens("a", [6])
    out = sched.schedule()                    # step 1 is no attempt point: one round only
    assert out.kind is StepKind.DECODE and peer.calls[-1] == (1, 0, 0)


def test_vote_helpers_on_one_rank() -> None:
    group = SingleRankVoteGroup()
    result = cast_vote(group, wants_prefill=True, has_running=True)
    assert (result.any_wants, result.all_want, result.none_running) == (True, True, False)
    assert not result.prefill_chosen(AttemptPoint.NONE)
    assert result.prefill_chosen(AttemptPoint.ALL) and result.prefill_chosen(AttemptPoint.ANY)
    assert confirm_prefill(group, True) and not confirm_prefill(group, False)


class NoCollectiveGroup:
    """A one-rank group that fails the test if the vote makes a collective call."""

    world_size = 1
    rank = 0

    def all_reduce_min(self, values):
        raise AssertionError(f"a one-rank vote made a collective call with {tuple(values)}")


def test_one_rank_vote_makes_no_collective_call_and_decides_the_same(make_sched) -> None:
    group = NoCollectiveGroup()
    for wants in (False, True):
        for running in (False, True):
            assert cast_vote(group, wants, running) == cast_vote(SingleRankVoteGroup(), wants, running)
    assert confirm_prefill(group, True) and not confirm_prefill(group, False)
    config = dict(prefill_attempt_interval=3, prefill_any_attempt_interval=5, max_num_seqs=2)
    scheds = [make_sched(vote_group=group, **config), make_sched(**config)]
    for sched in scheds:
        sched.add_seq("a", [1, 2, 3], 100)
    history: list[list[tuple[StepKind, int]]] = [[], []]
    for step in range(12):
        for sched, seen in zip(scheds, history):
            if step == 4:
                sched.add_seq("b", [4, 5], 100)    # arrives mid-decode: waits for an attempt point
            out = sched.schedule()
            seen.append((out.kind, out.num_decode_steps))
            for chunk in out.prefill:
                if chunk.completes_prefill:
                    sched.append_tokens(chunk.seq_id, [7])
            if out.decode is not None:
                for seq_id in out.decode.seq_ids:
                    sched.append_tokens(seq_id, [7])
    assert history[0] == history[1]
    assert {kind for kind, _ in history[0]} == {StepKind.PREFILL, StepKind.DECODE}


def test_a_rank_with_a_snapshot_tail_pending_makes_the_group_prefill() -> None:
    class UrgentPeer:                 # the other rank wants prefill, runs sequences, has a tail pending
        world_size, rank = 2, 0

        def __init__(self) -> None:
            self.calls: list[tuple[int, ...]] = []

        def all_reduce_min(self, values):
            self.calls.append(tuple(values))
            return tuple(min(a, b) for a, b in zip(values, (0, 1, 0, 0)))

    peer = UrgentPeer()
    result = cast_vote(peer, wants_prefill=False, has_running=True, urgent=False)
    assert peer.calls == [(1, 0, 0, 1)] and result.urgent and result.any_wants
    assert result.prefill_chosen(AttemptPoint.NONE)
    assert not cast_vote(peer, wants_prefill=False, has_running=True).urgent    # caching off: three ints
    assert peer.calls[-1] == (1, 0, 0)
