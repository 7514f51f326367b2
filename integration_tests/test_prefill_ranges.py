"""benchmarks/prefill_ranges.py: exclusive times of nested ranges, their classes, and the timer's
hooks on a tiny V4 model on CPU (the host clock standing in for CUDA events)."""

from __future__ import annotations

import pytest
import torch
from scripts_under_test import TINY_V4, load_script

from deepinfer.kernels import kernels_for
from deepinfer.model import DeepseekV4Config, ForwardBatch, ModelCache
from deepinfer.model.model import build_model

ranges = load_script("benchmarks/prefill_ranges.py")




class TickClock:
    """A mark is the next integer: every range's time is the number of marks inside it plus one."""

    def __init__(self) -> None:
        self.now = 0

    def mark(self) -> int:
        self.now += 1
        return self.now

    def wait(self) -> None:
        pass

    def seconds(self, start: int, stop: int) -> float:
        return float(stop - start)


def test_exclusive_time_subtracts_only_the_directly_nested_ranges() -> None:
    # root [0, 100] ⊃ a [10, 60] ⊃ b [20, 30], c [40, 50]; root ⊃ d [70, 90].
    parents = [-1, 0, 1, 1, 0]
    inclusive = [100.0, 50.0, 10.0, 10.0, 20.0]
    assert ranges.exclusive_seconds(parents, inclusive) == [30.0, 30.0, 10.0, 10.0, 20.0]
    labels = [ranges.ROOT, "ctx:attention", "op:attn_core", "split:x0", "ctx:experts"]
    splits = {"x0": {"attn_proj": 0.75, "compressor": 0.25}}
    assert ranges.class_seconds(labels, ranges.exclusive_seconds(parents, inclusive), splits) == {
        "other": 30.0, "data_movement": 30.0, "attn_core": 10.0, "attn_proj": 7.5, "compressor": 2.5,
        "moe_routed": 20.0}


@pytest.fixture(scope="module")
def tiny_prefill():
    """(model, cache, batch) of a 24-token prompt after one forward (the stacked weights exist)."""
    torch.manual_seed(0)
    model = build_model(DeepseekV4Config.from_dict(TINY_V4), device="cpu", dtype=torch.float32)
    model.init_weights(seed=0, std=0.02)
    cache = ModelCache.allocate(model.cache_spec(8), 4, 2, "cpu")
    batch = ForwardBatch.build([list(range(3, 27))], [0], [[1, 2, 3]], [1], device="cpu")
    with torch.no_grad():
        model(batch, cache)
    return model.eval(), cache, batch


def _time(model, cache, batch, clock):
    timer = ranges.OpClassTimer(model, kernels_for("cpu"), clock)
    try:
        with torch.no_grad():
            return timer.time(lambda ops: model(batch, cache, ops))
    finally:
        timer.remove()


def test_classes_of_a_tiny_forward_add_up_to_its_time(tiny_prefill) -> None:
    model, cache, batch = tiny_prefill
    ticks = _time(model, cache, batch, TickClock())
    # With ticks every range's exclusive time is 1 + the marks of its direct children: whole numbers
    # that sum exactly to the root's 2·ranges − 1 ticks.
    assert ticks.total_s == 2 * ticks.num_ranges - 1
    assert sum(ticks.class_s.values()) == pytest.approx(ticks.total_s)
    assert all(seconds > 0 for seconds in ticks.class_s.values())
    expected = {"moe_routed", "moe_shared", "router", "attn_proj", "attn_core", "indexer", "compressor", "mhc",
                "norm_rope", "embed_head", "data_movement", "other"}
    assert set(ticks.class_s) == expected

    wall = _time(model, cache, batch, ranges.HostClock())
    assert set(wall.class_s) == expected and wall.num_ranges == ticks.num_ranges
    assert sum(wall.class_s.values()) == pytest.approx(wall.total_s, rel=1e-9)
    assert min(wall.class_s.values()) >= 0


def test_the_timer_leaves_the_model_as_it_found_it(tiny_prefill) -> None:
    model, cache, batch = tiny_prefill
    with torch.no_grad():
        before = model(batch, cache)
    _time(model, cache, batch, TickClock())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all("compress" not in m.__dict__ for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(batch, cache), before, rtol=0, atol=0)
