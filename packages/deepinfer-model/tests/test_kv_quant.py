"""The official FP8/FP4 KV fake-quantisation switch: consistent across chunking, and really applied."""

from __future__ import annotations

import torch
from hf_twin import Runner, hf_logits, hf_model, twin


def test_kv_quant_is_chunking_invariant_and_changes_the_numerics() -> None:
    hf, raw = hf_model(seed=4, head_dim=80, qk_rope_head_dim=16, index_head_dim=32)  # nope dims = 64
    quant = twin(hf, raw, kv_quant=True)
    ids = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    one_shot = Runner(quant).step({1: ids})[0]
    runner = Runner(quant)
    parts, pos = [], 0
    for n in (6, 9, 1, 1, 1, 2, 17):
        parts.append(runner.step({1: ids[pos:pos + n]})[0])
        pos += n
    torch.testing.assert_close(torch.cat(parts), one_shot, atol=2e-5, rtol=0)
    exact = hf_logits(hf, ids)
    gap = (one_shot - exact).abs().max().item()
    assert 1e-4 < gap < 0.5 * exact.abs().max().item()      # quantisation noise, not garbage


def test_kv_quant_refuses_head_sizes_its_blocks_do_not_divide() -> None:
    import pytest

    from deepinfer.model import ConfigError, DeepseekV4Config, DeepseekV4ForCausalLM
    from deepinfer.model.embedded import embedded_model_dir
    cfg = DeepseekV4Config.from_model_dir(embedded_model_dir())     # 48 nope dims: not a multiple of 64
    assert cfg.head_dim - cfg.qk_rope_head_dim == 48
    with pytest.raises(ConfigError, match=r"kv_quant=True needs head_dim - qk_rope_head_dim"):
        DeepseekV4ForCausalLM(cfg, kv_quant=True)
