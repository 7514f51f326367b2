"""engine.core.cache_copies on a hand-made cache: a snapshot keeps each ring's rows of the positions
before its block boundary and puts them back at the same ring rows of another slot (the rest zeroed),
a whole region travels as it is, and KV blocks and host rows make the round trip bit for bit."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.core.cache_copies import (
    SnapshotLayout,
    gather_blocks,
    restore_snapshots,
    rows_from_host,
    rows_to_host,
    save_snapshots,
    scatter_blocks,
)
from deepinfer.model import CacheSpec, ModelCache, PagedStreamSpec, StateSpec

SPEC = CacheSpec(8, (PagedStreamSpec("kv", 3, 1, torch.float32), PagedStreamSpec("idx", 2, 4, torch.bfloat16)), (
    StateSpec("window", (6, 2), torch.float32, True, 4),          # ring of 6, 4 rows live at a boundary
    StateSpec("hca", (5, 3), torch.float32, False, 0),            # nothing live: left out
    StateSpec("history", (3,), torch.int64, False, 2),
    StateSpec("whole", (2, 2), torch.bfloat16, False),            # boundary_rows None: kept whole
))


def _filled(num_slots: int = 4) -> ModelCache:
    cache = ModelCache.allocate(SPEC, num_blocks=5, num_slots=num_slots)
    gen = torch.Generator().manual_seed(0)
    for t in (*cache.state.values(), *cache.paged.values()):
        t.copy_(torch.randint(1, 100, t.shape, generator=gen).to(t.dtype))
    return cache


def test_the_layout_keeps_the_live_rows_of_each_region() -> None:
    layout = SnapshotLayout.for_spec(SPEC)
    assert [(r.name, r.num_rows, r.whole, r.offset, r.num_bytes) for r in layout.regions] == [
        ("window", 4, False, 0, 32), ("history", 2, False, 32, 16), ("whole", 2, True, 48, 8)]
    assert layout.num_bytes == 64
    with pytest.raises(ValueError, match="boundary_rows=7 must be in"):
        SnapshotLayout.for_spec(CacheSpec(8, (), (StateSpec("w", (6, 2), torch.float32, True, 7),)))


def test_a_snapshot_goes_back_to_the_same_ring_rows_of_another_slot() -> None:
    cache, layout = _filled(), SnapshotLayout.for_spec(SPEC)
    slots, positions = torch.tensor([1, 2]), torch.tensor([8, 3])
    rows = save_snapshots(cache, layout, slots, positions)
    assert rows.shape == (2, 64) and rows.dtype == torch.uint8
    restore_snapshots(cache, layout, rows, torch.tensor([3, 0]), positions)
    window, history = cache.state["window"], cache.state["history"]
    # position 8, ring of 6: positions 4..7 are rows 4, 5, 0, 1; rows 2, 3 zeroed
    assert torch.equal(window[3][[4, 5, 0, 1]], window[1][[4, 5, 0, 1]]) and not window[3][[2, 3]].any()
    # position 3: positions 1, 2 are rows 1, 2 (ring of 3); row 0 zeroed
    assert torch.equal(history[0][[1, 2]], history[2][[1, 2]]) and history[0][0] == 0
    assert torch.equal(cache.state["whole"][3], cache.state["whole"][1]) and not cache.state["hca"][3].any()


def test_blocks_and_host_rows_make_the_round_trip() -> None:
    cache = _filled()
    rows = gather_blocks(cache, torch.tensor([2, 4]))
    assert rows.shape == (2, 8 * 3 * 4 + 2 * 2 * 2)
    pool = torch.zeros((3, rows.shape[1]), dtype=torch.uint8)
    rows_to_host(rows, pool, [2, 1])
    back = rows_from_host(pool, torch.tensor([2, 1]), torch.device("cpu"))
    scatter_blocks(cache, torch.tensor([1, 3]), back)
    for t in cache.paged.values():
        assert torch.equal(t[1], t[2]) and torch.equal(t[3], t[4])
