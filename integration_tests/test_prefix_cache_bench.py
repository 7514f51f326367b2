"""benchmarks/prefix_cache.py --tiny (its CPU function check: the tiny V4-Flash-shaped model, modes on,
off and host) writes its JSON with every figure and the same tokens in every mode; and a V4-Flash
snapshot keeps a third of a state slot (engine.core.cache_copies.SnapshotLayout, on the meta device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripts_under_test import load_script

from deepinfer.cache import StateRegion, plan_state_layout
from deepinfer.engine.core.cache_copies import SnapshotLayout
from deepinfer.model import DeepseekV4Config
from deepinfer.model.model import build_model


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("prefix_cache")
    return load_script("benchmarks/prefix_cache.py").main(["--tiny", "--out", str(out)]), out


def test_the_json_lands_in_the_folder_with_every_mode(report: tuple[dict, Path]) -> None:
    result, out = report
    assert json.loads((out / "prefix_cache_tiny-flash_cpu.json").read_text())["runs"] == result["runs"]
    assert [run["mode"] for run in result["runs"]] == ["on", "off", "host"] and result["same_tokens"]
    for mode in ("on", "off", "host"):
        assert result["best"][mode]["ttft_later_turns_mean_s"] > 0
    assert {"ttft_later_turns_speedup_on", "ttft_later_turns_speedup_host"} <= result.keys()


def test_caching_prefills_less_and_the_host_mode_serves_from_host_memory(report: tuple[dict, Path]) -> None:
    result, _ = report
    prefill, cached = result["prefill_tokens"], result["cached_prompt_tokens"]
    assert prefill["off"] == 4 * (192 + 264 + 336) and cached["off"] == 0       # every prompt token, 3 turns
    for mode in ("on", "host"):
        assert prefill[mode] + cached[mode] == prefill["off"] and cached[mode] > 0
    host = result["runs"][2]
    assert host["cache"]["num_kv_blocks"] == 8 and host["cache"]["num_host_blocks"] > 0
    assert host["host_cached_prompt_tokens"] > 0 and host["host_spilled_blocks"] > 0


def test_a_v4_flash_snapshot_keeps_a_third_of_a_state_slot() -> None:
    """Window rings keep their last 128 rows of 134, CSA compressor and indexer rings the previous
    window (4 of 14 rows), HCA compressor rings (134 rows of 512 float32, the bulk of a slot) nothing."""
    flash_config = load_script("benchmarks/v4_flash_dummy.py").flash_config
    model = build_model(DeepseekV4Config.from_dict(flash_config(43)), device="meta", dtype=torch.bfloat16)
    spec = model.cache_spec(128, 6)
    slot_bytes = plan_state_layout([StateRegion(s.name, s.num_bytes, s.stored) for s in spec.states], 2).slot_bytes
    assert (slot_bytes, SnapshotLayout.for_spec(spec).num_bytes) == (19_888_128, 6_496_256)
