"""Speculative decoding under DP attention + EP MoE on CPU over gloo (issue #31 item 5), the embedded
model and its trained draft head, ZOS on: greedy outputs equal one process's plain greedy over 2 ranks
(a rank with fewer rows pads its verify forward to the group's size) and over 4 (one rank idle, running
dummy verify forwards of the agreed size); every rank agrees on the same size at every decode step;
with varlen verify the start-up curves are the mean over the EP group, the same on every rank.

The ranks run as a torchrun launch (`RANK` / `WORLD_SIZE`), so each prints what its own engine saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.parallel.launcher import free_port
from deepinfer.spec import cuda_graph_key

PROMPTS = ["def add(a, b):", "import os", "class Stack:"]
MAX_TOKENS = 8

SCRIPT = r"""
import dataclasses, json, os, sys

import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.speculative.spec_lockstep import SpecLockstep

torch.set_num_threads(1)
agreed = []
graph_size = SpecLockstep.graph_size
def recording(self, total_q):
    size = graph_size(self, total_q)
    agreed.append((total_q, size))
    return size
SpecLockstep.graph_size = recording
prompts, world, varlen = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "varlen"
llm = LLM(device="cpu", num_kv_blocks=48, max_num_seqs=4, data_parallel_size=world, expert_parallel=True,
          num_speculative_tokens=3, varlen_verify=varlen, zero_overhead_scheduling=True, distributed_timeout_s=60)
outs = llm.generate(prompts, SamplingParams(max_tokens=int(sys.argv[4]), temperature=0))
varlen = llm.engine.spec.varlen
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "agreed": agreed, "zos": llm.engine.zos,
                  "stats": dataclasses.asdict(llm.engine.stats()),
                  "curves": None if varlen is None else [list(varlen.forward.curve.ms), list(varlen.draft.prior.ms)]}))
llm.close()
# out without the interpreter's teardown: a gloo thread still alive when C++ statics are destroyed aborts
# the process ("terminate called without an active exception", exit -6) after the result was printed
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM(device="cpu", num_kv_blocks=48, max_num_seqs=4)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS,
                                                                                   temperature=0), use_tqdm=False)]


def _torchrun(world_size: int, varlen: bool) -> list[dict]:
    """`SCRIPT` as the ranks of a torchrun launch; every rank's last stdout line, as JSON."""
    port = free_port()
    args = [json.dumps(PROMPTS), str(world_size), "varlen" if varlen else "fixed", str(MAX_TOKENS)]
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size),
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                              "OMP_NUM_THREADS": "1"})
             for rank in range(world_size)]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _check_agreement(results: list[dict]) -> None:
    """Every rank agreed on the same sizes at the same steps, each the largest of the ranks' own keys."""
    steps = [r["agreed"] for r in results]
    assert steps[0] and all(len(s) == len(steps[0]) for s in steps)
    for at_step in zip(*steps):
        sizes = {size for _, size in at_step}
        keys = [cuda_graph_key(total_q) if total_q else 0 for total_q, _ in at_step]
        assert sizes == {max(keys)}


def test_two_ranks_draft_and_keep_one_process_greedy_padding_to_the_group_size(expected: list[list[int]]) -> None:
    results = _torchrun(2, varlen=False)
    _check_agreement(results)
    for result in results:
        assert result["tokens"] == expected and result["zos"]             # every rank returns every output
        assert result["stats"]["spec_draft_tokens"] > 0 and result["stats"]["spec_accepted_tokens"] > 0
    # three requests over two ranks: the rank with one padded its verify forwards to the other's size
    assert any(0 < cuda_graph_key(total_q) < size for result in results for total_q, size in result["agreed"])


def test_four_ranks_one_idle_runs_dummy_verify_forwards_and_varlen_curves_are_the_group_mean(
        expected: list[list[int]]) -> None:
    results = _torchrun(4, varlen=True)
    _check_agreement(results)
    for result in results:
        assert result["tokens"] == expected
    idle = results[3]                                  # three prompts over four ranks: rank 3 has none
    assert idle["stats"]["spec_verify_steps"] == 0
    assert any(total_q == 0 and size > 0 for total_q, size in idle["agreed"])      # it ran dummy verifies
    assert all(r["curves"] == results[0]["curves"] for r in results)               # the mean over the group
