"""A folder written by transformers' own `save_pretrained` loads with `load_model` and computes what
the transformers model computes: config.json as transformers writes it, `model.`-prefixed official
key names with the KV norm as `attn.norm`, per-expert weights, one file or sharded with an index."""

from __future__ import annotations

import json

import pytest
import torch
from hf_twin import Runner, hf_logits, hf_model
from safetensors import safe_open
from test_hf_parity import ATOL, CONFIGS

from deepinfer.model import load_model


def _stored_keys(folder) -> set[str]:
    keys: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    return keys


@pytest.mark.parametrize(("config", "max_shard_size"), [("base", None), ("selective", "150KB")])
def test_save_pretrained_folder_matches_transformers(tmp_path, config: str, max_shard_size: str | None) -> None:
    hf, _ = hf_model(seed=11, **CONFIGS[config])
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(tmp_path, **kwargs)
    keys = _stored_keys(tmp_path)
    # the spellings this test is about: transformers writes them, so they must keep loading
    assert "model.layers.0.attn.norm.weight" in keys and "model.hc_head.hc_fn" in keys and "head.weight" in keys
    assert "model.layers.1.ffn.experts.3.w2.weight" in keys
    if max_shard_size:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    else:
        assert (tmp_path / "model.safetensors").is_file()

    loaded = load_model(tmp_path)
    ids = torch.randint(0, 96, (41,), generator=torch.Generator().manual_seed(5)).tolist()
    torch.testing.assert_close(Runner(loaded).step({1: ids})[0], hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_save_pretrained_bfloat16_folder_loads_in_float32(tmp_path) -> None:
    """transformers' bf16 save; loading into float32 keeps the bf16 values exactly."""
    hf, _ = hf_model(seed=12)
    hf.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="300KB")
    loaded = load_model(tmp_path).state_dict()
    want = hf.state_dict()
    assert torch.equal(loaded["layers.1.attn.kv_norm.weight"], want["model.layers.1.self_attn.kv_norm.weight"].float())
    assert torch.equal(loaded["layers.2.ffn.experts.w13"][3],
                       want["model.layers.2.mlp.experts.gate_up_proj"][3].float())
    assert loaded["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(loaded["layers.0.ffn.gate.tid2eid"], want["model.layers.0.mlp.gate.tid2eid"])
