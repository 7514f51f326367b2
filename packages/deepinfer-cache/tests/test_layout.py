"""Layout planner: the design's numbers, alignment rules, sharing, budgets and field errors."""

from __future__ import annotations

import math

import pytest

from deepinfer.cache import (
    PagedStream,
    RegionPlacement,
    StateRegion,
    StreamPlacement,
    plan_paged_layout,
    plan_state_layout,
)


def v4_flash_streams() -> list[PagedStream]:
    """DeepSeek-V4-Flash packed KV (spec §3.1): 21 CSA layers (kv 584 B + index-K 68 B rows at
    ratio 4) and 20 HCA layers (kv 584 B rows at ratio 128)."""
    streams = []
    for layer in range(21):
        streams += [PagedStream(f"csa.{layer}.kv", 584, 4), PagedStream(f"csa.{layer}.index_k", 68, 4)]
    streams += [PagedStream(f"hca.{layer}.kv", 584, 128) for layer in range(20)]
    return streams


ONE = [PagedStream("a", 8, 1)]


def test_v4_flash_bytes_per_token_is_3514_25() -> None:
    layout = plan_paged_layout(v4_flash_streams(), block_size=256, num_blocks=100)
    assert layout.bytes_per_token == 3514.25
    # ceil(3514.25) = 3515 = 5 * 19 * 37 is odd, so lcm(128, 3515) = 128 * 3515.
    assert layout.total_alignment == 449_920
    # per block: 21 * (64 * 584 + 64 * 68) + 20 * (2 * 584)
    assert layout.bytes_per_block == 21 * (37_376 + 4_352) + 20 * 1_168 == 899_648
    assert layout.bytes_per_block == layout.bytes_per_token * 256
    csa0 = layout.streams["csa.0.kv"]
    assert csa0 == StreamPlacement(offset=0, rows_per_block=64, bytes_per_row=584, block_stride=37_376)
    assert layout.streams["csa.0.index_k"].offset == 3_737_600  # 100 blocks of csa.0.kv
    assert layout.streams["hca.19.kv"].rows_per_block == 2
    used = 100 * 899_648  # every stride is a multiple of 32, so no padding between regions
    assert layout.total_bytes == math.ceil(used / 449_920) * 449_920 == 89_984_000


def test_regions_are_32_byte_aligned_and_disjoint_and_block_offsets_follow() -> None:
    streams = [PagedStream("a", 3, 1), PagedStream("b", 5, 2), PagedStream("c", 7, 4)]
    layout = plan_paged_layout(streams, block_size=4, num_blocks=3)
    a, b, c = (layout.streams[n] for n in "abc")
    assert (a.offset, a.rows_per_block, a.block_stride) == (0, 4, 12)
    assert (b.offset, b.rows_per_block, b.block_stride) == (64, 2, 10)  # 36 -> 64
    assert (c.offset, c.rows_per_block, c.block_stride) == (96, 1, 7)  # 94 -> 96
    assert layout.bytes_per_block == 29
    assert layout.bytes_per_token == 3 + 2.5 + 1.75
    # bytes per token 7.25 -> 8; lcm(128, 8) = 128; data ends at 96 + 21 = 117 -> 128
    assert (layout.total_alignment, layout.total_bytes) == (128, 128)
    assert layout.block_offset("b", 2) == 84
    assert layout.block_offset("c", 0) == 96
    with pytest.raises(ValueError, match=r"block_id=3 out of range \[0, 3\)"):
        layout.block_offset("a", 3)
    with pytest.raises(ValueError, match=r"name='z' is not a stream"):
        layout.block_offset("z", 0)


def test_shared_stream_reuses_the_earlier_region() -> None:
    streams = [
        PagedStream("layers.2.kv", 288, 2),
        PagedStream("layers.2.index_k", 68, 2),
        PagedStream("layers.3.kv", 288, 2, shares="layers.2.kv"),
        PagedStream("layers.4.kv", 288, 2, shares="layers.3.kv"),  # chains resolve to the owner
    ]
    layout = plan_paged_layout(streams, block_size=128, num_blocks=10)
    assert layout.streams["layers.3.kv"] == layout.streams["layers.2.kv"]
    assert layout.streams["layers.4.kv"] == layout.streams["layers.2.kv"]
    assert list(layout.streams) == [s.name for s in streams]
    assert layout.bytes_per_token == 144 + 34 == 178
    assert layout.bytes_per_block == 64 * 288 + 64 * 68
    assert layout.total_alignment == math.lcm(128, 178)
    with pytest.raises(TypeError):
        layout.streams["x"] = layout.streams["layers.2.kv"]  # read-only mapping


def test_budget_picks_the_largest_num_blocks_that_fits() -> None:
    streams = v4_flash_streams()
    for num_blocks in (3, 4, 57, 1000):
        exact = plan_paged_layout(streams, 256, num_blocks=num_blocks)
        assert plan_paged_layout(streams, 256, budget_bytes=exact.total_bytes).num_blocks >= num_blocks
        below = plan_paged_layout(streams, 256, budget_bytes=exact.total_bytes - 1)
        assert below.num_blocks < num_blocks
        assert below.total_bytes <= exact.total_bytes - 1
        one_more = plan_paged_layout(streams, 256, num_blocks=below.num_blocks + 1)
        assert one_more.total_bytes > exact.total_bytes - 1
    budget = 80 * 2**30
    layout = plan_paged_layout(streams, 256, budget_bytes=budget)
    assert layout.total_bytes <= budget
    assert plan_paged_layout(streams, 256, num_blocks=layout.num_blocks + 1).total_bytes > budget


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: plan_paged_layout([], 4, num_blocks=2), r"streams must not be empty"),
        (lambda: plan_paged_layout(ONE * 2, 4, num_blocks=2),
         r"streams\[1\].name='a' is a duplicate"),
        (lambda: plan_paged_layout(
            [PagedStream("a", 8, 1, shares="b"), PagedStream("b", 8, 1)], 4, num_blocks=2),
         r"streams\[0\].shares='b' names no earlier stream"),
        (lambda: plan_paged_layout([*ONE, PagedStream("b", 16, 1, shares="a")], 4, num_blocks=2),
         r"streams\[1\] \('b'\) shares 'a' but its bytes_per_row/tokens_per_row 16/1 differ from 8/1"),
        (lambda: plan_paged_layout([*ONE, PagedStream("b", 8, 3)], 4, num_blocks=2),
         r"block_size=4 must be a multiple of streams\[1\].tokens_per_row=3"),
        (lambda: plan_paged_layout(ONE, 0, num_blocks=2), r"block_size=0 must be >= 1"),
        (lambda: plan_paged_layout(ONE, 4), r"exactly one of num_blocks and budget_bytes"),
        (lambda: plan_paged_layout(ONE, 4, num_blocks=2, budget_bytes=10**6),
         r"exactly one of num_blocks and budget_bytes"),
        (lambda: plan_paged_layout(ONE, 4, num_blocks=1), r"num_blocks=1 must be >= 2"),
        (lambda: plan_paged_layout(ONE, 4, budget_bytes=-1), r"budget_bytes=-1 must be >= 0"),
        (lambda: plan_paged_layout([PagedStream("a", 100, 1)], 4, budget_bytes=1000),
         r"budget_bytes=1000 is below the 3200 bytes that 2 blocks need"),
        (lambda: plan_paged_layout([("a", 8, 1)], 4, num_blocks=2), r"streams\[0\] must be a PagedStream"),
        (lambda: PagedStream("", 8, 1), r"PagedStream.name must be a non-empty str"),
        (lambda: PagedStream("a", 0, 1), r"PagedStream\('a'\).bytes_per_row=0 must be >= 1"),
        (lambda: PagedStream("a", 8, -4), r"PagedStream\('a'\).tokens_per_row=-4 must be >= 1"),
        (lambda: PagedStream("a", 8.0, 1), r"PagedStream\('a'\).bytes_per_row must be an int"),
        (lambda: PagedStream("a", 8, 1, shares=""), r"PagedStream\('a'\).shares must be a non-empty str"),
    ],
)
def test_paged_errors_name_the_field(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_v41_stored_region_is_1415040_bytes() -> None:
    rings = [StateRegion(f"layers.{i}.window", 134 * 528, stored=True) for i in range(20)]
    dropped = [StateRegion(f"layers.{i}.window", 134 * 528, stored=False) for i in range(20, 40)]
    dropped += [StateRegion(f"layers.{i}.compressor", 2 * 2 * 512 * 4, stored=False) for i in (2, 8, 14)]
    layout = plan_state_layout(dropped[:3] + rings + dropped[3:], num_slots=308)
    assert layout.state_size_to_disk == 20 * 134 * 528 == 1_415_040
    first_dropped = layout.regions["layers.20.window"]
    assert first_dropped == RegionPlacement(offset=1_415_040, num_bytes=70_752, stored=False)
    assert [p.stored for p in layout.regions.values()] == [True] * 20 + [False] * 23
    assert layout.slot_bytes == 40 * 70_752 + 3 * 8_192
    assert layout.total_bytes == 308 * layout.slot_bytes
    assert layout.region_offset("layers.0.window", 3) == 3 * layout.slot_bytes


def test_state_regions_are_aligned_and_stored_first() -> None:
    regions = [StateRegion("acc", 10, False), StateRegion("ring", 33, True), StateRegion("ring2", 1, True)]
    layout = plan_state_layout(regions, num_slots=2)
    assert list(layout.regions) == ["ring", "ring2", "acc"]
    assert [p.offset for p in layout.regions.values()] == [0, 64, 96]
    assert layout.state_size_to_disk == 65
    assert (layout.slot_bytes, layout.total_bytes) == (128, 256)
    assert layout.region_offset("acc", 1) == 224
    with pytest.raises(ValueError, match=r"slot=2 out of range \[0, 2\)"):
        layout.region_offset("acc", 2)
    nothing_stored = plan_state_layout([StateRegion("acc", 10, False)], num_slots=3)
    assert nothing_stored.state_size_to_disk == 0 and nothing_stored.slot_bytes == 32


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: plan_state_layout([], 2), r"regions must not be empty"),
        (lambda: plan_state_layout([StateRegion("a", 1, True), StateRegion("a", 2, False)], 2),
         r"regions\[1\].name='a' is a duplicate"),
        (lambda: plan_state_layout([StateRegion("a", 1, True)], 1), r"num_slots=1 must be >= 2"),
        (lambda: plan_state_layout([("a", 1, True)], 2), r"regions\[0\] must be a StateRegion"),
        (lambda: StateRegion("a", 0, True), r"StateRegion\('a'\).num_bytes=0 must be >= 1"),
        (lambda: StateRegion("a", 4, 1), r"StateRegion\('a'\).stored must be a bool"),
        (lambda: StateRegion(None, 4, True), r"StateRegion.name must be a non-empty str"),
    ],
)
def test_state_errors_name_the_field(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()
