"""The cache the model declares, pinned against the spec's V4-Flash numbers (docs/model.md)."""

from __future__ import annotations

import pytest
import torch
from test_config import FLASH

from deepinfer.model import DeepseekV4Config, DeepseekV4ForCausalLM


@pytest.fixture(scope="module")
def flash() -> DeepseekV4ForCausalLM:
    with torch.device("meta"):
        return DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(FLASH))


def test_v4_flash_bf16_cache_bytes(flash) -> None:
    spec = flash.cache_spec(128, 0, dtype=torch.bfloat16)
    assert sum(s.bytes_per_row / s.tokens_per_row for s in spec.streams) == 6880    # 21 × 320 + 20 × 8
    assert sum(r.num_bytes for r in spec.states if r.stored) == 43 * 128 * 1024      # window rings
    dropped = sum(r.num_bytes for r in spec.states if not r.stored)
    assert dropped == 21 * 80 * 1024 + 20 * 512 * 1024                               # fp32 compressor rings


def test_layer_contents_and_ring_lengths(flash) -> None:
    spec = flash.cache_spec(128, 6, dtype=torch.bfloat16)
    streams = {s.name: s for s in spec.streams}
    states = {r.name: r for r in spec.states}
    assert "layers.0.kv" not in streams and states["layers.0.window"].shape == (134, 512)
    assert streams["layers.2.kv"].tokens_per_row == 4 and streams["layers.2.index_k"].row_dim == 128
    assert states["layers.2.compressor.kv"].shape == (8 + 6, 1024)
    assert states["layers.2.indexer.gate"].shape == (8 + 6, 256)
    assert streams["layers.3.kv"].tokens_per_row == 128 and "layers.3.index_k" not in streams
    assert states["layers.3.compressor.kv"].shape == (128 + 6, 512)
    stored = [r.stored for r in spec.states]
    assert stored == sorted(stored, reverse=True)            # stored window rings first


def test_block_size_must_hold_whole_compression_windows(flash) -> None:
    with pytest.raises(ValueError, match="block_size=64 must be a multiple of layer 3's compress ratio 128"):
        flash.cache_spec(64)
