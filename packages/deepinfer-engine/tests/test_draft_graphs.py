"""DraftGraphs: the draft walk on static buffers, as the CUDA graphs capture it, run eagerly on the CPU.

A walk of m rows padded to its graph size gives, for those m rows, what `DSparkDraft.propose` gives
for them alone; rows with a step in flight take their anchor and move from the runner's per-row
buffers; bad staging is refused; all-greedy engine steps take the static path (walk, verify forward,
`VerifyTails`) with ZOS on and off, V4 and V4.1, and keep plain greedy. The other engine-level checks
run through the same walk in test_speculative*.py and test_zos_replay.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_tiny_v4 import RUNNER_CONFIG
from test_speculative_tiny import ARGS as TINY_ARGS
from test_speculative_tiny import folder, folder_v41, with_random_head  # noqa: F401  (fixtures)

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.speculative.draft_graphs import (
    ANCHOR,
    FIRST,
    IN_FLIGHT,
    OUTPUTS,
    POSITION,
    QUERY_LEN,
    ROW,
    SEED,
    SLOT,
    STAGED_ROWS,
    DraftGraphs,
)
from deepinfer.engine.speculative.spec_step import SpeculativeDecoder
from deepinfer.model import DeepseekV4Config, DSparkDraft
from deepinfer.model.model import build_model
from deepinfer.spec import DraftSampler

K = 3


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg = DeepseekV4Config.from_dict(dict(
        RUNNER_CONFIG,
        dspark_block_size=K, dspark_noise_token_id=63, dspark_target_layer_ids=[1, 2], dspark_markov_rank=4))
    model = build_model(cfg, device="cpu", dtype=torch.float32)
    model.init_weights(seed=0)
    draft = DSparkDraft(model, 1)
    draft.init_weights(1, std=0.2)
    model.attach_draft(draft)
    runner = ModelRunner(model, block_size=16, num_kv_blocks=8, budget_bytes=None, num_state_slots=6,
                         max_backtracking=K + 1, max_verify_tokens=8 * (K + 1))
    ring = runner.cache.state["mtp.0.window"]
    ring.copy_(torch.randn(ring.shape, generator=torch.Generator().manual_seed(2)))   # the target's features
    runner.draft = draft
    return runner


def _staged(anchors, positions, slots, *, rows=None, outputs=None, in_flight=None, seeds=None, first=None,
            query_lens=None) -> np.ndarray:
    m = len(anchors)
    host = np.zeros((STAGED_ROWS, m), dtype=np.int64)
    host[ANCHOR], host[POSITION], host[SLOT] = anchors, positions, slots
    host[ROW] = rows if rows is not None else np.arange(m)
    host[OUTPUTS] = outputs if outputs is not None else 0
    host[IN_FLIGHT] = in_flight if in_flight is not None else 0
    host[SEED] = seeds if seeds is not None else np.arange(m) + 11
    host[FIRST] = first if first is not None else 0
    host[QUERY_LEN] = query_lens if query_lens is not None else 0
    return host


def test_a_padded_walk_gives_its_rows_what_propose_gives_them_alone(runner: ModelRunner) -> None:
    graphs = DraftGraphs(runner.draft, runner, max_rows=8, interval=4)
    assert graphs.sizes == (1, 2, 4, 8) and graphs.bucket(3) == 4
    anchors, positions, slots = [5, 17, 40], [9, 3, 12], [1, 2, 3]
    temperature = np.array([0.0, 0.8, 0.0], dtype=np.float32)
    host = _staged(anchors, positions, slots, outputs=[4, 0, 7])
    size = graphs.stage(host, temperature)
    assert size == 4
    walk = graphs.replay(size)
    assert walk.tokens.shape == (4, K + 1) and walk.logits.shape == (4, K, 64)
    sampler = DraftSampler(torch.from_numpy(temperature), torch.from_numpy(host[SEED]),
                           torch.tensor([4, 0, 7]))
    alone = runner.draft.propose(torch.tensor(anchors), torch.tensor(positions), torch.tensor(slots), runner.cache,
                                 sample=sampler, ops=runner.ops)
    assert walk.tokens[:3, 0].tolist() == anchors
    assert torch.equal(walk.tokens[:3, 1:], alone.token_ids)
    torch.testing.assert_close(walk.logits[:3], alone.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(walk.confidence[:3], alone.confidence, atol=1e-6, rtol=1e-5)
    assert walk.positions[:3].tolist() == positions and walk.shift[:3].tolist() == [0, 0, 0]
    assert walk.output_positions[:3].tolist() == [4, 0, 7]
    # the padding row drafted from token 0 at position 0 of the dummy slot 0
    assert walk.tokens[3, 0] == 0 and walk.positions[3] == 0 and graphs.inputs[SLOT, 3] == 0


def test_rows_in_flight_take_their_anchor_and_move_from_the_runner(runner: ModelRunner) -> None:
    graphs = DraftGraphs(runner.draft, runner, max_rows=4, interval=4)
    runner.row_tokens[7], runner.row_emitted[7] = 33, 2          # the step in flight emitted 2 of K + 1
    host = _staged([9, 12], [20, 14], [1, 2], rows=[7, 3], outputs=[5, 6], in_flight=[1, 0])
    walk = graphs.replay(graphs.stage(host, np.zeros(2, dtype=np.float32)))
    assert walk.tokens[:2, 0].tolist() == [33, 12]              # row 7's host token is stale
    assert walk.shift[:2].tolist() == [K + 1 - 2, 0]
    assert walk.positions[:2].tolist() == [20 - (K + 1 - 2), 14]
    assert walk.output_positions[:2].tolist() == [5 + 2, 6]
    assert runner.row_tokens.shape[0] >= 1024                   # sized before any capture


def test_the_walk_lays_out_the_verify_forwards_tokens_where_the_host_says(runner: ModelRunner) -> None:
    graphs = DraftGraphs(runner.draft, runner, max_rows=4, interval=4)
    runner.fed_tokens.fill_(-7)
    runner.fed_positions.fill_(-7)
    host = _staged([9, 12], [20, 14], [1, 2], first=[0, 3], query_lens=[3, 2])     # rows of 3 and 2 tokens
    walk = graphs.replay(graphs.stage(host, np.zeros(2, dtype=np.float32)))
    want = torch.cat((walk.tokens[0, :3], walk.tokens[1, :2]))
    assert torch.equal(runner.fed_tokens[:5], want)
    assert runner.fed_positions[:5].tolist() == [20, 21, 22, 14, 15]
    assert (runner.fed_tokens[5:-1] == -7).all()          # nothing past the step; the rest went to the spare entry


def test_bad_staging_and_sizes_are_refused(runner: ModelRunner) -> None:
    graphs = DraftGraphs(runner.draft, runner, max_rows=4, interval=4)
    with pytest.raises(ValueError, match=r"must be in \[1, 4\]"):
        graphs.stage(_staged([1] * 5, [1] * 5, [1] * 5), np.zeros(5, dtype=np.float32))
    with pytest.raises(ValueError, match="temperature"):
        graphs.stage(_staged([1, 2], [1, 2], [1, 2]), np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="max_rows=0"):
        DraftGraphs(runner.draft, runner, max_rows=0)
    with pytest.raises(ValueError, match="need a CUDA runner"):
        DraftGraphs(runner.draft, runner, max_rows=4, capture=True)


def test_a_graph_is_not_replayed_once_the_row_buffers_moved(runner: ModelRunner) -> None:
    """The graphs read the per-row buffers where they were at capture: after `ensure_rows` grew them,
    `replay` runs the walk eagerly (stand-in graph: captures need CUDA)."""
    graphs = DraftGraphs(runner.draft, runner, max_rows=4, interval=4)
    replays: list[int] = []

    class StandIn:
        def replay(self) -> None:
            replays.append(1)

    size = graphs.stage(_staged([3], [6], [1]), np.zeros(1, dtype=np.float32))
    graphs.graphs[size] = StandIn()
    graphs.outputs[size] = "captured"
    assert graphs.replay(size) == "captured" and replays == [1]
    runner.ensure_rows(runner.row_tokens.shape[0] + 1)             # the buffers move
    assert graphs.replay(size).tokens[0, 0] == 3 and replays == [1]


@pytest.mark.usefixtures("with_random_head")
@pytest.mark.parametrize("version", ["v4", "v41"])
def test_greedy_steps_run_on_static_buffers_and_keep_plain_greedy(version: str, folder: Path, folder_v41: Path,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine-level: all-greedy speculative steps take the static path (draft walk → verify forward →
    VerifyTails, as the graphs capture them) with ZOS on and off, on V4 and V4.1, and keep plain greedy."""
    launched: list[int] = []
    launch_static = SpeculativeDecoder._launch_static

    def counting(self, d, reqs, guarded):
        launched.append(d.num_seqs)
        return launch_static(self, d, reqs, guarded)

    monkeypatch.setattr(SpeculativeDecoder, "_launch_static", counting)
    args = {**TINY_ARGS, "model": str(folder if version == "v4" else folder_v41)}
    prompts = [{"prompt_token_ids": [(5 * i + 7 * j) % 90 + 2 for j in range(9 + 6 * i)]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    plain = [list(o.outputs[0].token_ids) for o in LLM(**args).generate(prompts, params, use_tqdm=False)]
    for zos in (False, True):
        launched.clear()
        llm = LLM(**args, num_speculative_tokens=3, varlen_verify=False, zero_overhead_scheduling=zos)
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == plain
        # every verify step was a static one (under ZOS the last one launched is dropped: its requests had ended)
        assert launched and max(launched) == 3 and llm.engine.stats().spec_verify_steps == len(launched) - int(zos)
