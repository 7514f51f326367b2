"""GlooStepVoteGroup with two real processes: the MIN all-reduce, and two Schedulers voting
through it (PREFILL / EMPTY_PROMPT, DECODE / EMPTY_DECODE, IDLE). Every wait has a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepinfer.engine.parallel.launcher import free_port

WORKER = r"""
import json, os, sys
from datetime import timedelta

import torch.distributed as dist

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=20))
from deepinfer.cache import BlockManager
from deepinfer.engine.parallel.dp_group import GlooStepVoteGroup
from deepinfer.sched import Scheduler, SchedulerConfig, StepVoteGroup

result = {}
group = GlooStepVoteGroup.new_group(timeout_s=20)
result["protocol"] = isinstance(group, StepVoteGroup)
result["rank"], result["world_size"] = group.rank, group.world_size
result["min"] = group.all_reduce_min([5 + rank, 3 - rank, 7])
result["default_group_min"] = GlooStepVoteGroup().all_reduce_min([rank])
result["only_rank_1"] = GlooStepVoteGroup.new_group(ranks=[1], timeout_s=20) is not None

config = SchedulerConfig(block_size=4, max_model_len=64, max_num_seqs=4)
sched = Scheduler(config, BlockManager(16), BlockManager(5), vote_group=group)
if rank == 0:
    sched.add_seq("a", [1, 2, 3], 8)
kinds = []
for step in range(3):
    out = sched.schedule()
    kinds.append(out.kind.name)
    for chunk in out.prefill:
        sched.append_tokens(chunk.seq_id, [4])
    if out.decode is not None:
        sched.finish_seq("a", "stop")
result["kinds"] = kinds
print(json.dumps(result), flush=True)
# every rank past its last collective before any tears its group down, then out without the
# interpreter's teardown: a gloo thread still alive when C++ statics are destroyed aborts the process
# ("terminate called without an active exception", exit -6) after the result was printed, now and then
dist.barrier()
dist.destroy_process_group()
sys.stderr.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def results() -> list[dict]:
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=90)
            assert proc.returncode == 0, stderr[-3000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def test_min_all_reduce_over_two_processes(results) -> None:
    for rank, result in enumerate(results):
        assert result["protocol"] is True
        assert (result["rank"], result["world_size"]) == (rank, 2)
        assert result["min"] == [5, 2, 7]
        assert result["default_group_min"] == [0]
    assert [result["only_rank_1"] for result in results] == [False, True]


def test_two_schedulers_vote_through_gloo(results) -> None:
    # Nothing runs anywhere and rank 0 wants prefill: prefill at once, rank 1 runs an empty prompt
    # step; then rank 0 decodes while rank 1 pads; then both are idle.
    assert results[0]["kinds"] == ["PREFILL", "DECODE", "IDLE"]
    assert results[1]["kinds"] == ["EMPTY_PROMPT", "EMPTY_DECODE", "IDLE"]


def test_refuses_without_distributed() -> None:
    from deepinfer.engine.parallel.dp_group import GlooStepVoteGroup

    with pytest.raises(RuntimeError, match="init_process_group"):
        GlooStepVoteGroup()
    with pytest.raises(RuntimeError, match="init_process_group"):
        GlooStepVoteGroup.new_group()
