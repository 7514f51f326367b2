"""The V4.1 cache the model declares, and deepinfer.cache's plan of it, on the released config (spec §3.2,
docs/design.md §5): 890 B of paged cache per token, a stored state region of 20 × 134 × 528 B."""

from __future__ import annotations

import pytest
import torch
from v41_configs import RELEASED, tiny_text

from deepinfer.cache import PagedStream, StateRegion, plan_paged_layout, plan_state_layout
from deepinfer.model import DeepseekV41Config, DeepseekV41ForCausalLM


@pytest.fixture(scope="module")
def released() -> DeepseekV41ForCausalLM:
    with torch.device("meta"):
        return DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(RELEASED))


def test_released_paged_streams_are_the_four_kv_sources(released) -> None:
    spec = released.cache_spec(256, 6)
    rows = {s.name: (s.row_dim, s.tokens_per_row, s.dtype) for s in spec.streams}
    assert rows == {
        **{f"layers.{s}.kv": (288, 2, torch.uint8) for s in (2, 8, 14)},
        **{f"layers.{s}.index_k": (68, 2, torch.uint8) for s in (2, 8, 14)},
        "layers.20.kv": (288, 1, torch.uint8), "layers.20.index_k": (68, 1, torch.uint8),
    }
    assert sum(s.bytes_per_row / s.tokens_per_row for s in spec.streams) == 890


def test_planner_on_the_released_config(released) -> None:
    spec = released.cache_spec(256, 6)
    paged = plan_paged_layout([PagedStream(s.name, s.bytes_per_row, s.tokens_per_row) for s in spec.streams], 256,
                              num_blocks=4)
    assert paged.bytes_per_token == 890.0
    state = plan_state_layout([StateRegion(r.name, r.num_bytes, r.stored) for r in spec.states], num_slots=3)
    assert state.state_size_to_disk == 1_415_040 == 20 * 134 * 528
    stored = [n for n, r in state.regions.items() if r.stored]
    assert stored == [f"layers.{i}.window" for i in range(20)]
    dropped = {n: r for n, r in state.regions.items() if not r.stored}
    assert set(dropped) == ({f"layers.{i}.window" for i in range(20, 40)} | {"engram.history"}
                            | {f"layers.{s}.compressor.{p}" for s in (2, 8, 14) for p in ("kv", "gate")})
    assert min(r.offset for r in dropped.values()) >= state.state_size_to_disk      # the dropped region after it
    assert dropped["layers.20.window"].num_bytes == 134 * 528
    assert dropped["layers.2.compressor.kv"].num_bytes == (2 + 6) * 512 * 4          # fp32 group accumulators
    assert dropped["engram.history"].num_bytes == (3 + 6) * 8


def test_plain_rows_where_a_packed_block_does_not_divide_the_head() -> None:
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(tiny_text(head_dim=48, index_head_dim=24,
                                                                             qk_rope_head_dim=8)))
    spec = model.cache_spec(8, 0, dtype=torch.bfloat16)
    streams = {s.name: s for s in spec.streams}
    assert streams["layers.2.kv"].dtype == torch.uint8 and streams["layers.2.kv"].row_dim == 24 + 3   # 48 % 16 == 0
    assert streams["layers.2.index_k"].dtype == torch.bfloat16 and streams["layers.2.index_k"].row_dim == 24
    window = {r.name: r for r in spec.states}["layers.0.window"]
    assert window.dtype == torch.bfloat16 and window.shape == (8, 48)                              # 48 % 32 != 0


def test_block_size_must_hold_whole_groups() -> None:
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(tiny_text()))
    with pytest.raises(ValueError, match="block_size=7"):
        model.cache_spec(7)
