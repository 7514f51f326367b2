"""The speculative graph path on the CPU (`DEEPINFER_EMULATE_CUDA_GRAPHS`: `CpuGraph` stand-ins for the
decode, draft-walk and verify-tail graphs, on the same static buffers), against the eager path, on the
embedded model and its trained head; and the varlen policy's recovery after bad first drafts (issue #31:
on an H100 the head accepted nothing with varlen on — a request whose first drafts missed was kept
plain for good, as it is on the CPU; the re-probe brings it back).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from heldout import heldout_code

from deepinfer.engine import EngineArgs, LLMEngine, OutputKind, SamplingParams
from deepinfer.engine.bench import run_bench
from deepinfer.engine.config.env import EngineEnv
from deepinfer.engine.speculative.draft_graphs import DraftGraphs
from deepinfer.sched import StepKind

ENGINE = {"device": "cpu", "kv_cache_memory_mb": 16, "max_num_seqs": 4, "max_model_len": 512,
          "num_speculative_tokens": 5}
MAX_TOKENS = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(emulate: bool, zos: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], list[list[list[int]]],
                                                                              LLMEngine]:
    """Greedy tokens of the code prompts, and every draft walk's rows (anchor + drafts), step by step."""
    engine = LLMEngine(EngineArgs(**ENGINE, varlen_verify=False, zero_overhead_scheduling=zos),
                       env=EngineEnv(emulate_cuda_graphs=emulate, varlen_profile_cache="off"))
    walks: list[torch.Tensor] = []
    replay = DraftGraphs.replay

    def recorded(self: DraftGraphs, size: int):
        walk = replay(self, size)
        walks.append(walk.tokens.clone())            # no host read here: a ZOS launch is guarded
        return walk

    monkeypatch.setattr(DraftGraphs, "replay", recorded)
    for i, prompt in enumerate(heldout_code()):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    monkeypatch.undo()
    return [tokens[f"r{i}"] for i in range(len(tokens))], [w.tolist() for w in walks], engine


@pytest.mark.parametrize("zos", [False, True])
def test_the_graph_path_drafts_what_the_eager_path_drafts(zos: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    eager_tokens, eager_walks, eager = _run(False, zos, monkeypatch)
    graph_tokens, graph_walks, graphs = _run(True, zos, monkeypatch)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    assert graphs.spec.draft_graphs.graphs and graphs.spec.tails.graphs
    assert graph_tokens == eager_tokens
    assert graph_walks == eager_walks and len(graph_walks) >= 8
    eager_stats, graph_stats = eager.stats(), graphs.stats()
    assert graph_stats.spec_accepted_tokens >= eager_stats.spec_accepted_tokens
    assert graph_stats.mean_accepted_length >= 1.5, graph_stats


@pytest.mark.parametrize("zos", [False, True])
def test_varlen_keeps_drafting_after_bad_first_drafts(zos: bool) -> None:
    """`deepinfer bench`'s random-token prompts: every first draft misses (as on the H100 of issue #31);
    the rows kept plain are re-probed, so more steps than the requests' first ones verify drafts."""
    engine = LLMEngine(EngineArgs(**ENGINE, zero_overhead_scheduling=zos),
                       env=EngineEnv(emulate_cuda_graphs=True, varlen_profile_cache="off"))
    assert engine.spec.varlen is not None and not engine.spec.varlen.plain_only
    result = run_bench(engine, num_prompts=2, input_len=32, output_len=40)
    assert result["spec_verify_steps"] > 4 and result["spec_accepted_tokens"] > 0, result


class _EveryFourthStep:
    """A verify policy for the test: every row drafts all k at every fourth decode step, none between."""

    def __init__(self) -> None:
        self.num_steps = 0

    def query_lens(self, seq_ids: tuple[str, ...], seq_lens: np.ndarray, max_query_len: int) -> np.ndarray:
        self.num_steps += 1
        return np.full(len(seq_ids), max_query_len if self.num_steps % 4 == 0 else 1, dtype=np.int32)


@pytest.mark.parametrize(("zos", "emulate"), [(False, True), (True, True), (True, False)],
                         ids=["zos-off-graphs", "zos-on-graphs", "zos-on-eager"])
def test_a_step_without_drafts_runs_as_a_plain_step(zos: bool, emulate: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #31: a speculative step in which no row drafts runs a plain engine's decode forward (on the
    graph path: the decode graph's replay): no draft walk, no verify forward, no verification tails. Its
    forward still fills the draft rings, so the rows' drafts after plain steps are accepted as usual; under
    ZOS a plain step after a verify step places its rows after the tokens that step accepted (on the
    device); the greedy tokens are a plain engine's."""
    env = EngineEnv(emulate_cuda_graphs=emulate, varlen_profile_cache="off")
    engine = LLMEngine(EngineArgs(**ENGINE, zero_overhead_scheduling=zos), env=env)
    assert engine.spec is not None and engine.spec.varlen is not None
    assert (engine.runner.graphs is not None) is emulate
    monkeypatch.setattr(engine.spec.gate, "inner", _EveryFourthStep())
    calls: dict[str, int] = {}

    def counted(label: str, owner: object, name: str) -> None:
        method = getattr(owner, name)

        def run(*args, **kwargs):
            calls[label] = calls.get(label, 0) + 1
            return method(*args, **kwargs)

        monkeypatch.setattr(owner, name, run)

    counted("draft walk", engine.spec.draft_graphs, "replay")
    counted("tails", engine.spec.tails, "replay")
    counted("verify forward", engine.runner, "verify_forward")
    counted("verify forward", engine.runner, "verify_forward_static")
    counted("forward", engine.runner, "forward")
    if engine.runner.graphs is not None:
        counted("decode graph", engine.runner.graphs, "replay")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(heldout_code()):       # FINAL_ONLY: plain steps take their tokens in bulk
        engine.add_request(f"r{i}", prompt, params, output_kind=OutputKind.FINAL_ONLY)
    kinds: list[str] = []                    # per decode step: "plain" (no row drafts) or "verify"
    tokens = {}
    while engine.has_unfinished_requests():
        calls.clear()
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        steady = engine.plain_step.steady      # the rows plain steps take tokens in bulk for count them all
        if steady is not None:
            live = [i for i, r in enumerate(steady.reqs) if not r.finished]
            assert steady.num_out[live].tolist() == [steady.reqs[i].num_output_tokens for i in live]
        if engine.last_step_kind is StepKind.DECODE and "verify forward" in calls:
            kinds.append("verify")
        elif engine.last_step_kind is StepKind.DECODE:
            assert calls == ({"forward": 1, "decode graph": 1} if emulate else {"forward": 1}), calls
            kinds.append("plain")
    assert kinds.count("verify") >= 3 and kinds.count("plain") >= 3 * kinds.count("verify") - 3, kinds
    stats = engine.stats()
    assert stats.mean_accepted_length >= 1.5, stats
    plain = LLMEngine(EngineArgs(**{**ENGINE, "num_speculative_tokens": 0}, zero_overhead_scheduling=zos), env=env)
    for i, prompt in enumerate(heldout_code()):
        plain.add_request(f"r{i}", prompt, params)
    expected = {}
    while plain.has_unfinished_requests():
        expected.update({out.request_id: list(out.outputs[0].token_ids) for out in plain.step() if out.finished})
    assert tokens == expected
