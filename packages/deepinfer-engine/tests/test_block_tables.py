"""Block tables by diff (block_tables.py, issue #17): over random scheduler traces (new sequences,
appended blocks, finishes, aborts, forks with copy-on-write, preemption with recompute or finish,
drafts' trims, ZOS's step in flight) the per-row device table updated by diff equals the tables
built from scratch for every decode step, and a step copies only new rows and appended blocks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from deepinfer.cache import BlockManager
from deepinfer.engine.core.block_tables import RowBlockTables
from deepinfer.sched import BranchId, Scheduler, SchedulerConfig, SeqStatus, StepKind


def _drive(seed: int, nextn: int, stop_preempted_request: bool) -> tuple[int, int]:
    """Run one random trace, checking the diffed table after every decode step; returns (decode
    steps, steps whose rows all kept their table version)."""
    rng = random.Random(seed)
    config = SchedulerConfig(block_size=4, max_model_len=48, max_num_seqs=6, max_num_batched_tokens=32,
                             nextn=nextn, stop_preempted_request=stop_preempted_request)
    sched = Scheduler(config, BlockManager(18), BlockManager(7))   # small: preemptions
    tables = RowBlockTables(config.max_blocks_per_seq, "cpu")
    in_flight: list[str] = []
    versions: dict[int, tuple[int, int]] = {}       # row -> (version, blocks) as last copied
    num_decode = num_steady = 0
    next_id = 0

    def post_process() -> None:
        live = [s for s in in_flight if s.lstrip("_") in sched._st.seqs]
        for seq_id in live:
            count = rng.randint(1, config.max_query_len)
            sched.append_tokens(seq_id, [rng.randrange(1000) for _ in range(count)])
            view = sched.get_seq(seq_id)
            if len(view.prompt_token_ids) + len(view.output_token_ids) + 2 * config.max_query_len >= 48 \
                    or len(view.output_token_ids) >= view.max_tokens:
                sched.finish_seq(seq_id, "length")
        in_flight.clear()

    for _ in range(400):
        op = rng.random()
        live = sorted(sched._st.seqs)
        if op < 0.15:
            next_id += 1
            sched.add_seq(f"s{next_id}", [rng.randrange(1000) for _ in range(rng.randint(1, 14))], rng.randint(1, 20))
        elif op < 0.2 and live:
            sched.finish_seq(rng.choice(live), "stop") if rng.random() < 0.5 else sched.abort_seq(rng.choice(live))
        elif op < 0.25 and live:
            view = sched.get_seq(rng.choice(live))
            if view.status in (SeqStatus.PROMPTED, SeqStatus.RUNNING) and not isinstance(view.seq_id, BranchId) \
                    and view.num_inflight_tokens == 0:
                sched.fork_seq(view.seq_id, rng.randint(1, 2))
        else:
            zos = rng.random() < 0.7
            if not zos:
                post_process()
            out = sched.schedule()
            preempted = {seq_id.lstrip("_") for seq_id in out.preempted_seq_ids}   # their tokens are dropped
            in_flight[:] = [seq_id for seq_id in in_flight if seq_id.lstrip("_") not in preempted]
            if out.kind is StepKind.PREFILL:
                post_process()
                for chunk in out.prefill:
                    if chunk.completes_prefill:
                        sched.append_tokens(chunk.seq_id, [rng.randrange(1000)])
            elif out.kind is StepKind.DECODE:
                post_process()          # ZOS: the previous step's tokens come in after this one is scheduled
                d = out.decode
                held = {row: versions.get(row, (0, 0)) for row in d.rows.tolist()}
                copied = tables.update(d.rows, d.table_versions, d.block_tables)
                want = np.zeros((d.num_seqs, config.max_blocks_per_seq), dtype=np.int32)
                want[:, : d.block_tables.shape[1]] = d.block_tables
                rows = torch.from_numpy(d.rows.astype(np.int64))
                assert torch.equal(tables.table[rows], torch.from_numpy(want))
                gathered = torch.full((d.num_seqs, config.max_blocks_per_seq), -1, dtype=torch.int32)
                tables.gather(rows, gathered)
                assert torch.equal(gathered, torch.from_numpy(want))
                now = np.count_nonzero(d.block_tables, axis=1).tolist()
                kept = [held[row][0] == version for row, version in zip(d.rows.tolist(), d.table_versions.tolist())]
                if all(kept):              # only appended blocks were copied
                    num_steady += 1
                    assert copied == sum(n - held[row][1] for row, n in zip(d.rows.tolist(), now))
                for row, version, n in zip(d.rows.tolist(), d.table_versions.tolist(), now):
                    versions[row] = (version, n)
                in_flight[:] = list(d.seq_ids)
                num_decode += 1
    return num_decode, num_steady


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("nextn", "stop_preempted_request"), [(0, False), (1, False), (0, True)])
def test_diffed_block_tables_equal_tables_from_scratch(seed: int, nextn: int, stop_preempted_request: bool) -> None:
    num_decode, num_steady = _drive(seed, nextn, stop_preempted_request)
    assert num_decode > 20 and num_steady > 0


def test_update_copies_nothing_for_an_unchanged_step_and_refuses_bad_shapes() -> None:
    tables = RowBlockTables(4, "cpu")
    rows, versions = np.array([5, 2]), np.array([1, 2], dtype=np.int64)
    assert tables.update(rows, versions, np.array([[3, 4, 0], [7, 0, 0]], dtype=np.int32)) == 3
    assert tables.update(rows, versions, np.array([[3, 4], [7, 0]], dtype=np.int32)) == 0
    assert tables.update(rows, versions, np.array([[3, 4, 9], [7, 0, 0]], dtype=np.int32)) == 1   # appended
    # row 5 rewritten (a new version, fewer blocks): its whole row, zeros over the old tail
    assert tables.update(rows[:1], np.array([3], dtype=np.int64), np.array([[8]], dtype=np.int32)) == 3
    assert tables.table[5].tolist() == [8, 0, 0, 0] and tables.table[2].tolist() == [7, 0, 0, 0]
    with pytest.raises(ValueError, match="must agree"):
        tables.update(rows, versions, np.zeros((2, 5), dtype=np.int32))
