"""Random add / schedule / append / finish / abort / fork sequences against an engine model
(one ZOS step in flight or none); the bookkeeping invariants hold after every call and nothing
leaks at the end."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deepinfer.cache import BlockManager
from deepinfer.sched import BranchId, Scheduler, SchedulerConfig, SeqStatus, StepKind, TokenLog, seq_key

OPS = st.lists(
    st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "step", "step", "finish", "abort",
                               "fork"]),
              st.integers(0, 20)),
    min_size=20,
    max_size=80,
)


class EngineModel:
    """What an engine does with the scheduler's outputs, including ZOS's one-step lag."""

    def __init__(self, sched: Scheduler, rng: random.Random, max_model_len: int, vocab: int = 1000) -> None:
        self.sched = sched
        self.rng = rng
        self.vocab = vocab                 # small: prompts share prefixes (prefix caching hits)
        self.max_model_len = max_model_len
        self.in_flight: deque[list[str]] = deque()   # decode steps whose tokens are not appended
        self.next_id = 0
        self.tables: dict[int, tuple[int, list[int]]] = {}   # row -> (table version, blocks) last decoded
        self.steps: list[tuple] = []       # what each schedule() asked for

    # The calls that hand tokens over (`SharedListEngine` appends to its lists first).
    def add(self, seq_id: str, prompt: list[int], max_tokens: int) -> None:
        self.sched.add_seq(seq_id, prompt, max_tokens)

    def append(self, seq_id: str, tokens: list[int]) -> None:
        self.sched.append_tokens(seq_id, tokens)

    def append_decode(self, seq_ids: tuple[str, ...], tokens: list[list[int]], accepted: list[int]) -> None:
        query_len = self.sched.config.max_query_len
        self.sched.append_decode_tokens(seq_ids, np.array(tokens, dtype=np.int64).reshape(-1, query_len),
                                        np.array(accepted, dtype=np.int32))

    def fork(self, seq_id: str, num_branches: int) -> None:
        self.sched.fork_seq(seq_id, num_branches)

    def check_table_versions(self, batch) -> None:
        """A row's block table with the version of the last batch that had the row only gained
        blocks at its end since (`DecodeBatch.table_versions`); versions are never reused."""
        for row, version, table in zip(batch.rows.tolist(), batch.table_versions.tolist(),
                                       batch.block_tables.tolist()):
            blocks = [block for block in table if block]
            assert version > 0 and blocks == table[: len(blocks)]
            old_version, old_blocks = self.tables.get(row, (0, []))
            if version == old_version:
                assert blocks[: len(old_blocks)] == old_blocks, (row, old_blocks, blocks)
            else:
                assert version > old_version
            self.tables[row] = (version, blocks)

    def live_ids(self) -> list[str]:
        return sorted(self.sched._st.seqs)   # test-only peek, to pick targets

    def forget(self, seq_id: str) -> None:
        key = seq_key(seq_id)
        for step in self.in_flight:
            step[:] = [s for s in step if seq_key(s) != key]

    def post_process(self, seq_ids: list[str], query_len: int) -> None:
        accepted = [self.rng.randint(1, query_len) for _ in seq_ids]
        tokens = [[self.rng.randrange(1000) for _ in range(query_len)] for _ in seq_ids]
        if self.rng.random() < 0.5:
            self.append_decode(tuple(seq_ids), tokens, accepted)
        else:
            for seq_id, row, count in zip(seq_ids, tokens, accepted):
                self.append(seq_id, row[:count])
        for seq_id in seq_ids:
            view = self.sched.get_seq(seq_id)
            num_tokens = len(view.prompt_token_ids) + len(view.output_token_ids)
            if num_tokens >= self.max_model_len or len(view.output_token_ids) >= view.max_tokens:
                self.sched.finish_seq(seq_id, "length")
                self.forget(seq_id)

    def step(self, zos: bool) -> None:
        query_len = self.sched.config.max_query_len
        while len(self.in_flight) > (1 if zos else 0):
            self.post_process(self.in_flight.popleft(), query_len)
        out = self.sched.schedule()
        self.steps.append((out.kind, [(c.seq_id, c.start, c.end, c.token_ids.tolist()) for c in out.prefill],
                           out.decode.seq_ids if out.decode else None, out.preempted_seq_ids))
        event(f"kind {out.kind.name}")
        if out.preempted_seq_ids:
            event("preempted")
        if len(out.clone_states):
            event("fork copied")
        for seq_id in out.preempted_seq_ids:
            self.forget(seq_id)
        if out.kind is StepKind.PREFILL:
            while self.in_flight:
                self.post_process(self.in_flight.popleft(), query_len)
            done = [c.seq_id for c in out.prefill if c.completes_prefill]
            for seq_id in done:
                self.append(seq_id, [self.rng.randrange(1000)])
        elif out.kind is StepKind.DECODE:
            assert out.decode.num_seqs > 0
            self.check_table_versions(out.decode)
            self.in_flight.append(list(out.decode.seq_ids))

    def apply(self, op: str, arg: int) -> None:
        live = self.live_ids()
        if op == "add":
            self.next_id += 1
            prompt = [self.rng.randrange(self.vocab) for _ in range(arg)]
            if self.vocab == 2:            # prefix caching: most prompts start alike
                shared = self.rng.randrange(arg + 1)
                prompt[:shared] = [0] * shared
            self.add(f"s{self.next_id}", prompt, 1 + arg % 7)
        elif op == "step":
            self.step(zos=arg % 2 == 1)
        elif op in ("finish", "abort") and live:
            seq_id = live[arg % len(live)]
            if op == "finish":
                self.sched.finish_seq(seq_id, "stop")
            else:
                self.sched.abort_seq(seq_id)
            self.forget(seq_id)
        elif op == "fork" and live:
            view = self.sched.get_seq(live[arg % len(live)])
            if (view.status in (SeqStatus.PROMPTED, SeqStatus.RUNNING) and not isinstance(view.seq_id, BranchId)
                    and view.num_inflight_tokens == 0):
                self.fork(view.seq_id, 1 + arg % 2)


class SharedListEngine(EngineModel):
    """An engine that keeps each sequence's tokens in its own list and shares it with the scheduler
    (`share_list`, `branch_lists`) for two sequences in three; it appends every token it hands over."""

    def __init__(self, sched: Scheduler, rng: random.Random, max_model_len: int) -> None:
        super().__init__(sched, rng, max_model_len)
        self.lists: dict[str, list[int]] = {}

    def add(self, seq_id: str, prompt: list[int], max_tokens: int) -> None:
        if self.next_id % 3 == 0:
            super().add(seq_id, prompt, max_tokens)
            return
        self.lists[seq_id] = TokenLog(prompt)
        self.sched.add_seq(seq_id, self.lists[seq_id], max_tokens, share_list=True)

    def append(self, seq_id: str, tokens: list[int]) -> None:
        self.lists.get(seq_key(seq_id), []).extend(tokens)
        super().append(seq_id, tokens)

    def append_decode(self, seq_ids: tuple[str, ...], tokens: list[list[int]], accepted: list[int]) -> None:
        for seq_id, row, count in zip(seq_ids, tokens, accepted):
            self.lists.get(seq_key(seq_id), []).extend(row[:count])
        super().append_decode(seq_ids, tokens, accepted)

    def fork(self, seq_id: str, num_branches: int) -> None:
        parent = self.lists.get(seq_id)
        if parent is None:
            super().fork(seq_id, num_branches)
            return
        lists = [TokenLog(parent) for _ in range(num_branches)]
        for branch_id, tokens in zip(self.sched.fork_seq(seq_id, num_branches, branch_lists=lists), lists):
            self.lists[seq_key(branch_id)] = tokens

    def check_shared(self) -> None:
        for key, seq in self.sched._st.seqs.items():     # test-only peek at the list each one reads
            assert seq.shared_list == (key in self.lists)
            assert seq.token_ids is self.lists[key] if seq.shared_list else seq.token_ids is not self.lists.get(key)


def check_blocks_match_needs(sched: Scheduler, kv: BlockManager) -> None:
    """Blocks owned == sum of per-sequence needs, counting a shared block once per holder."""
    block_size = sched.config.block_size
    total_held = 0
    for seq_id in sched._st.seqs:
        view = sched.get_seq(seq_id)
        if view.state_slot:
            needed = -(-(view.num_computed_tokens + view.num_inflight_tokens) // block_size)
            assert len(view.block_ids) == needed, view
            total_held += needed
    assert total_held == sum(kv.ref_count(block) for block in range(1, kv.num_blocks))


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=OPS,
    seed=st.integers(0, 2**16),
    block_size=st.integers(1, 6),
    num_blocks=st.integers(2, 24),
    num_slots=st.integers(1, 6),
    max_num_seqs=st.integers(1, 6),
    nextn=st.integers(0, 2),
    stop_preempted_request=st.booleans(),
    max_num_batched_tokens=st.integers(1, 24),
    checkpoints=st.sampled_from([(), (4, 8, 12, 16), (7,)]),
    intervals=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    max_num_prompts=st.sampled_from([None, 1, 2]),
    sum_k=st.sampled_from([None, 24, 30]),
    num_snapshots=st.sampled_from([0, 1, 3]),      # 0: prefix caching off
)
def test_random_operations_keep_invariants(
    native, ops, seed, block_size, num_blocks, num_slots, max_num_seqs, nextn,
    stop_preempted_request, max_num_batched_tokens, checkpoints, intervals, max_num_prompts, sum_k, num_snapshots,
) -> None:
    config = SchedulerConfig(
        block_size=block_size, max_model_len=24, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, nextn=nextn, chunk_checkpoints=checkpoints,
        stop_preempted_request=stop_preempted_request, prefill_attempt_interval=intervals[0],
        prefill_any_attempt_interval=intervals[1], max_num_prompts=max_num_prompts,
        prefill_max_sum_seqlen_k=sum_k, enable_prefix_caching=num_snapshots > 0,
    )
    kv, slots = BlockManager(num_blocks), BlockManager(num_slots + 1)
    sched = Scheduler(config, kv, slots, native=native, snapshot_slots=BlockManager(max(num_snapshots, 1) + 1))
    engine = EngineModel(sched, random.Random(seed), config.max_model_len, vocab=2 if num_snapshots else 1000)
    for op, arg in ops:
        engine.apply(op, arg)
        sched.check_integrity()
        check_blocks_match_needs(sched, kv)
    for seq_id in engine.live_ids():
        sched.finish_seq(seq_id, "abort")
    sched.schedule()                       # reports anything still pending as ignored
    assert not sched.has_unfinished()
    assert kv.num_free == num_blocks - 1 and slots.num_free == num_slots
    sched.check_integrity()
    if sched.prefix_cache_stats.hits:
        event("prefix cache hit")


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=OPS,
    seed=st.integers(0, 2**16),
    block_size=st.integers(1, 6),
    num_blocks=st.integers(2, 24),
    max_num_seqs=st.integers(1, 6),
    nextn=st.integers(0, 2),
    stop_preempted_request=st.booleans(),
    max_num_batched_tokens=st.integers(1, 24),
)
def test_shared_lists_schedule_as_own_copies_do(
    native, ops, seed, block_size, num_blocks, max_num_seqs, nextn, stop_preempted_request, max_num_batched_tokens,
) -> None:
    """The same operations on a scheduler keeping its own copies and on one reading an engine's lists
    (for most sequences) give the same steps and the same sequences; a shared list is the one read."""
    config = SchedulerConfig(
        block_size=block_size, max_model_len=24, max_num_seqs=max_num_seqs, nextn=nextn,
        max_num_batched_tokens=max_num_batched_tokens, stop_preempted_request=stop_preempted_request,
    )
    engines = []
    for engine_type in (EngineModel, SharedListEngine):
        sched = Scheduler(config, BlockManager(num_blocks), BlockManager(max_num_seqs + 1), native=native)
        engines.append(engine_type(sched, random.Random(seed), config.max_model_len))
    own, shared = engines
    for op, arg in ops:
        for engine in engines:
            engine.apply(op, arg)
            engine.sched.check_integrity()
        shared.check_shared()
        assert own.live_ids() == shared.live_ids()
        assert [own.sched.get_seq(i) for i in own.live_ids()] == [shared.sched.get_seq(i) for i in own.live_ids()]
    assert own.steps == shared.steps
