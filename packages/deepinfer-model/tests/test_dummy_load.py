"""load_format="dummy": seeded random weights of the real shapes from a folder holding only config.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from deepinfer.kernels import unpack_mxfp4_from_decode
from deepinfer.kernels.reference import dequant_fp8_block, dequant_mxfp4, scale_to_float
from deepinfer.model import (
    LOAD_FORMATS,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    ForwardBatch,
    ModelCache,
    WeightError,
    dummy_model,
    load_model,
)
from deepinfer.model.dummy import NEAR_ONE, ROUTER_BIAS, SMALL_BIAS
from deepinfer.model.layers.moe import Experts
from deepinfer.model.model import build_model

KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention")


def _raw(num_layers: int = 4, **overrides: object) -> dict:
    """A tiny config.json (transformers names), every mechanism present: window-only, CSA and HCA
    layers, hash-routed then learned MoE layers, a shared expert, mHC over 4 streams."""
    return {
        "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 3, "moe_intermediate_size": 64,
        "num_hash_layers": 2, "layer_types": [KINDS[i % 4] for i in range(num_layers)],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "sliding_window": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "index_n_heads": 2, "index_head_dim": 16,
        "index_topk": 4, "max_position_embeddings": 256,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]},
        **overrides,
    }


def _folder(path: Path, raw: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _logits(model: DeepseekV4ForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, prefilled in one step."""
    block_size = 16
    cache = ModelCache.allocate(model.cache_spec(block_size), 1 + -(-len(token_ids) // block_size), 1)
    table = list(range(1, 1 + -(-len(token_ids) // block_size)))
    batch = ForwardBatch.build([token_ids], [0], [table], [0], logits="all")
    with torch.no_grad():
        return model(batch, cache)


PROMPT = [(7 * i + 3) % 96 for i in range(40)]


def test_a_folder_with_only_config_json_gives_finite_varied_logits_over_many_layers(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "model", _raw(num_layers=16))
    model = load_model(folder, load_format="dummy", seed=5)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    logits = _logits(model, PROMPT)
    assert logits.shape == (len(PROMPT), 96) and logits.dtype == torch.float32
    assert bool(torch.isfinite(logits).all())
    # Sensible scale after 16 layers: neither blown up nor collapsed to one distribution for every token.
    assert float(logits.abs().max()) < 10.0 and float(logits.std()) > 0.1
    assert len(set(logits.argmax(-1).tolist())) > 5
    assert not model.training and model.draft_weights == {}


def test_dummy_reads_no_checkpoint(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "model", _raw())
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightError, match="not a readable safetensors file"):
        load_model(folder)
    model = load_model(folder, load_format="dummy")                   # the broken file is never opened
    assert bool(torch.isfinite(_logits(model, PROMPT[:12])).all())


def test_the_same_seed_gives_the_same_weights_and_another_seed_others(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "model", _raw())
    first = load_model(folder, load_format="dummy", seed=11).state_dict()
    again = load_model(folder, load_format="dummy", seed=11).state_dict()
    other = load_model(folder, load_format="dummy", seed=12).state_dict()
    assert list(first) == list(again)
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
        if not name.endswith("inv_freq"):                             # RoPE frequencies come from the config
            assert not torch.equal(tensor, other[name]), name


def test_values_have_the_documented_ranges(tmp_path: Path) -> None:
    cfg = DeepseekV4Config.from_dict(_raw())
    model = dummy_model(cfg, dtype=torch.bfloat16, seed=3)
    reference = build_model(cfg, device="cpu", dtype=torch.bfloat16)  # uninitialised, RoPE buffers computed
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        values = p.detach().float()
        if "norm" in name or leaf.endswith("_scale"):
            low, high = 1.0 - NEAR_ONE, 1.0 + NEAR_ONE
        elif leaf.endswith("_base") or leaf in ("attn_sink", "ape"):
            low, high = -SMALL_BIAS, SMALL_BIAS
        elif name.endswith(".gate.bias"):
            low, high = -ROUTER_BIAS, ROUTER_BIAS
        else:
            assert p.dim() >= 2, name
            high = 1.0 / math.sqrt(p.shape[-1])
            low = -high
            assert p.dtype == (torch.float32 if leaf.startswith("hc_") else torch.bfloat16), name
        assert low <= float(values.min()) and float(values.max()) <= high, name
        if values.numel() >= 8:                                                # spread over the range
            assert float(values.max()) - float(values.min()) > 0.5 * (high - low), name
    for name, buffer in model.named_buffers():
        if name.endswith("inv_freq"):
            assert torch.equal(buffer, reference.get_buffer(name)), name
            continue
        assert name.endswith(".tid2eid") and buffer.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
        assert 0 <= int(buffer.min()) and int(buffer.max()) < cfg.n_routed_experts
        assert all(len(set(row)) == cfg.num_experts_per_tok for row in buffer.tolist())    # distinct per token
        assert len(set(buffer.flatten().tolist())) == cfg.n_routed_experts                  # every expert used


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_quantised_experts_hold_valid_codes_and_scales(tmp_path: Path, expert_dtype: str) -> None:
    folder = _folder(tmp_path / "model", _raw())
    model = load_model(folder, load_format="dummy", seed=2, expert_dtype=expert_dtype, dtype=torch.bfloat16)
    again = load_model(folder, load_format="dummy", seed=2, expert_dtype=expert_dtype, dtype=torch.bfloat16)
    plain = load_model(folder, load_format="dummy", seed=2, dtype=torch.bfloat16)
    cfg = model.cfg
    for layer, block in enumerate(model.layers):
        experts = block.ffn.experts
        for which, fan_in in (("w13", cfg.hidden_size), ("w2", cfg.moe_intermediate_size)):
            weight, scale = getattr(experts, which), getattr(experts, f"{which}_scale")
            assert torch.equal(weight.view(torch.uint8), getattr(again.layers[layer].ffn.experts, which).view(
                torch.uint8))
            if expert_dtype == "fp8":
                assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
                assert not bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any())        # no NaN code
                assert bool((torch.isfinite(scale_to_float(scale)) & (scale > 0)).all())
                values = torch.stack([dequant_fp8_block(w, s, experts.fp8_block) for w, s in zip(weight, scale)])
            else:
                assert weight.dtype == torch.uint8 and scale.dtype == torch.uint8
                assert not bool((scale == 0xFF).any())                                     # no NaN scale
                values = torch.stack([dequant_mxfp4(w, s) for w, s in zip(weight, scale)])
            bound = 1.0 / math.sqrt(fan_in)
            assert float(values.abs().max()) <= bound * 1.01 and float(values.std()) > 0.3 * bound
    for name, tensor in plain.state_dict().items():            # the dense weights do not depend on expert_dtype
        if ".experts." not in name:
            assert torch.equal(tensor, model.state_dict()[name]), name
    logits = _logits(model, PROMPT)
    assert bool(torch.isfinite(logits).all()) and float(logits.std()) > 0.1


def test_load_format_and_seed_are_checked(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "model", _raw())
    assert LOAD_FORMATS == ("safetensors", "dummy")
    with pytest.raises(ValueError, match=r"load_format='pickle' must be one of 'safetensors', 'dummy'"):
        load_model(folder, load_format="pickle")
    with pytest.raises(ValueError, match=r"seed=-1 must be an int >= 0"):
        load_model(folder, load_format="dummy", seed=-1)
    with pytest.raises(WeightError, match=r"no model.safetensors or model.safetensors.index.json"):
        load_model(folder)                                     # the default still needs a checkpoint


def test_fp4_experts_repacked_for_the_kernels_give_the_same_logits(tmp_path, monkeypatch) -> None:
    """Where the device wants the expert kernels' `packed` layout (forced here on the CPU), load_model
    re-packs every layer's MXFP4 experts (codes only); the ops read them (here the reference twins,
    which unpack) to the same logits, bit for bit."""
    import deepinfer.model.weights as weights

    folder = _folder(tmp_path, _raw())
    plain = load_model(folder, load_format="dummy", expert_dtype="fp4", seed=3)
    monkeypatch.setattr(weights, "packed_layout_wanted", lambda device: True)
    packed = load_model(folder, load_format="dummy", expert_dtype="fp4", seed=3)
    pairs = [(p, q) for p, q in zip(plain.modules(), packed.modules(), strict=True) if isinstance(p, Experts)]
    assert pairs and all(q.mxfp4_packed and not p.mxfp4_packed for p, q in pairs)
    for p, q in pairs:
        assert not torch.equal(q.w13, p.w13) and torch.equal(unpack_mxfp4_from_decode(q.w13), p.w13)
        assert torch.equal(unpack_mxfp4_from_decode(q.w2), p.w2) and torch.equal(q.w13_scale, p.w13_scale)
    tokens = [5, 17, 3, 60, 2, 9, 41]
    assert torch.equal(_logits(packed, tokens), _logits(plain, tokens))
