"""ModelRunner: cache memory sized through deepinfer-cache's planner."""

from __future__ import annotations

import pytest
import torch
from engine_tiny_v4 import RUNNER_CONFIG

from deepinfer.engine.core.model_runner import ModelRunner, default_block_size
from deepinfer.model import DeepseekV4Config
from deepinfer.model.model import build_model


@pytest.fixture(scope="module")
def model():
    cfg = DeepseekV4Config.from_dict(RUNNER_CONFIG)
    m = build_model(cfg, device="cpu", dtype=torch.float32)
    m.init_weights(seed=0)
    return m


def test_budget_covers_paged_blocks_and_state_slots(model) -> None:
    assert default_block_size(model) == 64
    runner = ModelRunner(model, block_size=16, num_kv_blocks=None, budget_bytes=200_000, num_state_slots=5,
                         max_backtracking=2)
    plan = runner.plan
    assert plan.paged_bytes + plan.state_bytes <= 200_000
    assert plan.num_kv_blocks >= 2 and plan.num_state_slots == 5
    bigger = ModelRunner(model, block_size=16, num_kv_blocks=None, budget_bytes=400_000, num_state_slots=5,
                         max_backtracking=2)
    assert bigger.plan.num_kv_blocks > plan.num_kv_blocks
    # the views land in one buffer each; a stream's block rows follow the planner's stride
    assert runner.cache.paged["layers.1.kv"].shape == (plan.num_kv_blocks, 4, 16)
    assert runner.cache.state["layers.0.window"].shape == (5, 4 + 2, 16)
    assert plan.state_size_to_disk == 3 * 6 * 16 * 4               # three window rings, stored first


def test_budget_smaller_than_the_state_slots_is_an_error(model) -> None:
    with pytest.raises(ValueError, match="does not even hold the 5 state slots"):
        ModelRunner(model, block_size=16, num_kv_blocks=None, budget_bytes=1000, num_state_slots=5,
                    max_backtracking=0)


@pytest.mark.parametrize("device_split", [False, True], ids=["host-layout", "device-split"])
def test_a_verify_forward_padded_to_the_group_size_changes_nothing_of_its_rows(model, device_split: bool) -> None:
    """Lockstep DP + EP ranks pad their verify forwards to the group's size (`graph_size`): the padding
    tokens sit in slot 0 / block 0, so the rows' logits and their cache are those of the unpadded step
    (up to the rounding a larger batch's matmuls bring)."""
    import numpy as np

    from deepinfer.sched import DecodeBatch

    def run(graph_size: int | None):
        runner = ModelRunner(model, block_size=16, num_kv_blocks=6, budget_bytes=None, num_state_slots=4,
                             max_backtracking=4)
        zeros = np.zeros(2, dtype=np.int32)
        d = DecodeBatch(seq_ids=("a", "b"), rows=np.array([0, 1], dtype=np.int32),
                        query_lens=np.array([3, 2], dtype=np.int32), seq_lens=np.array([3, 3], dtype=np.int32),
                        block_tables=np.array([[1], [2]], dtype=np.int32), state_slots=np.array([1, 2], dtype=np.int32),
                        last_token_ids=zeros, table_versions=zeros.astype(np.int64),
                        in_flight=np.zeros(2, dtype=np.bool_), rows_generation=0)
        tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
        query_lens = torch.tensor([3, 2]) if device_split else None
        logits = runner.verify_forward(d, tokens, query_lens=query_lens, graph_size=graph_size)
        cache = {**{n: t[1:].clone() for n, t in runner.cache.state.items()},
                 **{n: t[1:].clone() for n, t in runner.cache.paged.items()}}
        return logits, cache

    plain, plain_cache = run(None)
    padded, padded_cache = run(16)
    assert padded.shape == plain.shape == (5, 64)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    for name, values in plain_cache.items():
        torch.testing.assert_close(padded_cache[name], values, rtol=1e-5, atol=1e-5, msg=name)
