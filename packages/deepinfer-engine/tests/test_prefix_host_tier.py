"""The prefix cache's host tier and its smaller snapshots in the engine (issue #32): a prefix evicted
from the device comes back from host memory with exactly the logits of a prefill from scratch (tiny
V4 and V4.1), multi-turn chats that thrash the device cache give the same tokens with the host tier
as without caching, and the fronts' stats and /metrics account for it. (The smaller snapshots: the
bitwise tests here and in test_prefix_caching.py, and integration_tests/test_prefix_cache_bench.py
for their size on V4-Flash.)"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from engine_tiny_v4 import CONFIG as V4_CONFIG
from engine_tiny_v41 import CONFIG as V41_CONFIG
from test_prefix_caching import TINY, _run

from deepinfer.engine import EngineArgs, InvalidEngineArgs, LLMEngine, SamplingParams
from deepinfer.engine.core.prefix_caching import host_cache_stats
from deepinfer.engine.core.prefix_memory import HostTierSize, host_tier_size
from deepinfer.engine.core.stats import EngineStats, HostCacheStats
from deepinfer.engine.serve.metrics import ServerMetrics

# 7 usable blocks of 16 tokens: a 100-token prompt evicts every cached block of the one before it
SMALL = {**TINY, "num_kv_blocks": 8, "prefix_cache_snapshots": 4, "prefix_cache_host_mb": 1}


def _folder(tmp_path: Path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("config", [V4_CONFIG, V41_CONFIG], ids=["v4", "v41"])
def test_a_prefix_back_from_host_memory_gives_the_logits_of_a_prefill_from_scratch(tmp_path: Path,
                                                                                  config: dict) -> None:
    args = EngineArgs(model=_folder(tmp_path, config), **SMALL, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    rng = np.random.default_rng(3)
    first = rng.integers(3, 90, 37).tolist()
    second = first + rng.integers(3, 90, 21).tolist()
    engine = LLMEngine(args)
    assert engine.runner.plan.num_host_blocks > 0 and engine.runner.plan.host_bytes <= 2**20
    _run(engine, {"first": first}, params)
    _run(engine, {"filler": rng.integers(3, 90, 100).tolist()}, params)
    stats = engine.scheduler.prefix_cache_stats
    assert stats.num_host_spills >= 2 and stats.num_host_blocks >= 2      # first's two blocks left the device
    cached = _run(engine, {"second": second}, params)["second"]
    assert cached.num_cached_tokens == 32 and engine.scheduler.prefix_cache_stats.host_hits == 32
    scratch = _run(LLMEngine(args), {"second": second}, params)["second"]
    assert scratch.num_cached_tokens == 0
    assert cached.outputs[0].token_ids == scratch.outputs[0].token_ids
    assert cached.outputs[0].logprobs == scratch.outputs[0].logprobs
    engine.scheduler.check_integrity()
    assert engine.reset_prefix_cache() and engine.scheduler.prefix_cache_stats.num_host_blocks == 0


def test_chats_that_thrash_the_device_cache_give_the_same_tokens_served_from_host_memory(tmp_path: Path) -> None:
    """Three chats take turns one request at a time; each turn of one chat evicts the others' blocks
    from the 7 usable device blocks, so their second turns come back from host memory."""
    model = _folder(tmp_path, V4_CONFIG)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(11)
    messages = [[rng.integers(3, 90, 36 if turn == 0 else 9).tolist() for turn in range(2)] for _ in range(3)]
    outputs, stats = {}, {}
    for mode, extra in {"host": {}, "off": {"enable_prefix_caching": False, "prefix_cache_snapshots": None,
                                           "prefix_cache_host_mb": 0}}.items():
        engine = LLMEngine(EngineArgs(model=model, **{**SMALL, **extra}))
        histories: list[list[int]] = [[], [], []]
        outputs[mode] = []
        for turn in range(2):
            for chat in range(3):
                histories[chat] += messages[chat][turn]
                out = _run(engine, {f"c{chat}t{turn}": histories[chat]}, greedy)[f"c{chat}t{turn}"]
                histories[chat] += out.outputs[0].token_ids
                outputs[mode].append((out.outputs[0].token_ids, out.num_cached_tokens))
        stats[mode] = engine.scheduler.prefix_cache_stats
        engine.scheduler.check_integrity()
    assert [tokens for tokens, _ in outputs["host"]] == [tokens for tokens, _ in outputs["off"]]
    assert all(cached >= 16 for _, cached in outputs["host"][3:])      # every later turn hits
    assert stats["host"].host_hits > 0 and stats["host"].num_host_spills > 0


def test_the_host_tier_reaches_the_stats_and_metrics() -> None:
    stats = SimpleNamespace(host_hits=48, num_host_spills=5, num_host_blocks=4, num_host_snapshots=2)
    host = host_cache_stats(stats)
    assert host == HostCacheStats(48, 5, 4, 2) and host + host == HostCacheStats(96, 10, 8, 4)
    front = SimpleNamespace(stats=EngineStats(0, 0, 7, 7, host), parallel_stats=lambda: None)
    text = ServerMetrics(front).render().decode()
    for line in ("deepinfer_prefix_cache_host_hits_total 48.0", "deepinfer_prefix_cache_host_spills_total 5.0",
                 "deepinfer_prefix_cache_host_blocks 4.0", "deepinfer_prefix_cache_host_snapshots 2.0"):
        assert line in text.splitlines()


def test_host_tier_size_follows_the_device_split_and_its_args_are_checked() -> None:
    # device: 99 blocks of 100 B and 10 snapshots of 10 B (1% of its bytes) -> 1% of the host bytes
    # (each pool has an unused row 0: (989 + 1) × 100 + (99 + 1) × 10 = 100,000)
    assert host_tier_size(100_000, 100, 10, 99, 10) == HostTierSize(989, 99)
    assert host_tier_size(220, 100, 10, 99, 10) == HostTierSize(1, 1)
    assert host_tier_size(219, 100, 10, 99, 10) == HostTierSize(0, 0)         # not even one of each
    assert EngineArgs(device="cpu").resolved().prefix_cache_host_mb == 0
    with pytest.raises(InvalidEngineArgs, match=r"prefix_cache_host_mb=-1 must be >= 0"):
        EngineArgs(prefix_cache_host_mb=-1)
    with pytest.raises(InvalidEngineArgs, match="prefix_cache_host_mb=64 needs enable_prefix_caching=True"):
        EngineArgs(enable_prefix_caching=False, prefix_cache_host_mb=64)

