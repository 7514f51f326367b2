"""The planner on DeepSeek-V4.1-Flash's cache (spec §3.2, docs/design.md §5): four KV sources own the paged
bytes (890 per token), consumer layers share their regions, and the stored state region is the 20
encoder layers' MXFP8 window rings (20 × 134 × 528 B)."""

from __future__ import annotations

from deepinfer.cache import PagedStream, StateRegion, plan_paged_layout, plan_state_layout

KV_ROW, INDEX_ROW, WINDOW_ROW = 288, 68, 528        # FP4 + e4m3 scales; FP4 + UE8M0; FP8 + UE8M0
SOURCES = {2: 2, 8: 2, 14: 2, 20: 1}                  # layer → compress ratio


def _streams() -> list[PagedStream]:
    streams = []
    for layer, ratio in SOURCES.items():
        streams += [PagedStream(f"layers.{layer}.kv", KV_ROW, ratio),
                    PagedStream(f"layers.{layer}.index_k", INDEX_ROW, ratio)]
    for layer in range(3, 40):                        # consumers reference their source's region
        source = max(s for s in SOURCES if s <= layer)
        if layer not in SOURCES:
            streams.append(PagedStream(f"layers.{layer}.kv", KV_ROW, SOURCES[source], shares=f"layers.{source}.kv"))
    return streams


def test_v41_flash_paged_bytes_per_token() -> None:
    layout = plan_paged_layout(_streams(), 256, num_blocks=10)
    assert layout.bytes_per_token == 890.0
    assert layout.bytes_per_block == 890 * 256
    assert layout.streams["layers.13.kv"].offset == layout.streams["layers.8.kv"].offset
    assert layout.streams["layers.39.kv"].offset == layout.streams["layers.20.kv"].offset
    assert layout.total_bytes % 128 == 0 and layout.total_alignment == 128 * 890 // 2   # lcm(128, 890)


def test_v41_flash_state_size_to_disk() -> None:
    ring = 128 + 6
    regions = [StateRegion(f"layers.{i}.window", ring * WINDOW_ROW, stored=i < 20) for i in range(40)]
    regions += [StateRegion(f"layers.{s}.compressor.{p}", (2 + 6) * 512 * 4, stored=False)
                for s in (2, 8, 14) for p in ("kv", "gate")]
    layout = plan_state_layout(regions, num_slots=4)
    assert layout.state_size_to_disk == 1_415_040 == 20 * 134 * 528
    assert min(r.offset for r in layout.regions.values() if not r.stored) == 1_415_040   # dropped region after
