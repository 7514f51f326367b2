"""DeepseekV41Config: the released composite config, transformers' flat config, defaults, checks."""

from __future__ import annotations

import copy
import json
import logging

import pytest
from v41_configs import RELEASED, RELEASED_TEXT, tiny_text

from deepinfer.model import ConfigError, DeepseekV4Config, DeepseekV41Config


def test_released_composite_config() -> None:
    cfg = DeepseekV4Config.from_dict(RELEASED)          # dispatches on model_type
    assert isinstance(cfg, DeepseekV41Config)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.q_lora_rank, cfg.n_routed_experts) == (5120, 40, 1280, 384)
    assert cfg.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20            # the 3 DSpark entries are cut
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20) and cfg.candidate_source_layer_id == 20
    assert cfg.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert cfg.engram_layer_ids == (1, 14) and cfg.engram_num_embeddings == (384006168, 384016682)
    assert cfg.engram_pad_id == 2 and cfg.rms_norm_eps == 1e-20 and cfg.num_hash_layers == 0
    assert cfg.quant.fp8_block == 32 and cfg.quant.expert_format == "fp4"
    assert cfg.yarn.factor == 16 and cfg.yarn.original_max_position_embeddings == 65536
    assert cfg.num_encoder_layers == 20 and cfg.dspark_target_layer_ids == (37, 38, 39)
    assert cfg.kv_source_of(1) is None and cfg.kv_source_of(13) == 8 and cfg.kv_source_of(39) == 20


def test_vision_config_is_ignored_with_one_line(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="deepinfer.model"):
        DeepseekV41Config.from_dict(RELEASED)
    lines = [r.getMessage() for r in caplog.records if "vision_config" in r.getMessage()]
    assert len(lines) == 1 and "ignored" in lines[0]


def test_transformers_flat_config_equals_the_official_one(tmp_path) -> None:
    """What transformers' DeepseekV41TextConfig writes: flat, derived `layer_types`, rope split into
    `rope_parameters` main / compress, `engram_pad_id`, training knobs."""
    flat = {k: v for k, v in RELEASED_TEXT.items() if k not in ("rope_scaling", "engram_pad_token_id")}
    flat.update({
        "engram_pad_id": 2, "initializer_range": 0.02, "use_cache": True, "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "router_jitter_noise": 0.0, "attention_dropout": 0.0, "gate_temp": 1.0,
        "layer_types": ["shared_compressed_attention" if i in (2, 8, 14, 20) else "sliding_attention"
                        for i in range(40)],
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
            "compress": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536, "rope_theta": 160000.0,
                         "partial_rotary_factor": 0.125, "attention_factor": 1.0}},
        "quantization_config": RELEASED["quantization_config"], "transformers_version": "5.30.0.dev0",
    })
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert DeepseekV4Config.from_model_dir(tmp_path) == DeepseekV41Config.from_dict(RELEASED)


def test_transformers_defaults_for_absent_lists() -> None:
    raw = tiny_text()
    for key in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                "dspark_target_layer_ids", "engram_layer_ids", "engram_num_embeddings"):
        del raw[key]
    cfg = DeepseekV41Config.from_dict(raw)
    assert cfg.compress_ratios == (0, 0) + (2,) * 5 + (1,) * 5
    assert cfg.kv_source_layer_ids == (2, 7) == cfg.index_source_layer_ids and cfg.candidate_source_layer_id == 7
    assert cfg.dspark_target_layer_ids == (9, 10, 11) and cfg.engram_layer_ids == ()
    released = DeepseekV41Config.from_dict({"model_type": "deepseek_v41_text"})
    assert released.kv_source_layer_ids == (2, 8, 14, 20) and released.index_source_layer_ids[-1] == 36


def _patched(path: str, value) -> dict:
    raw = copy.deepcopy(RELEASED)
    where = raw["text_config"] if not path.startswith("/") else raw
    where[path.lstrip("/")] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("compress_ratios", [0, 0] + [4] * 38, r"compress_ratios\[2\]=4"),
        ("kv_source_layer_ids", [1, 20], "kv_source_layer_ids has layer 1"),
        ("kv_source_layer_ids", [8, 2], r"kv_source_layer_ids=\[8, 2\] must be increasing"),
        ("index_source_layer_ids", [2, 45], r"index_source_layer_ids\[1\]=45"),
        ("candidate_source_layer_id", 21, "candidate_source_layer_id=21"),
        ("engram_num_embeddings", [5], "engram_num_embeddings has 1 entries"),
        ("engram_layer_ids", [1, "x"], r"engram_layer_ids\[1\]='x'"),
        ("gate_temp", 0, "gate_temp=0"),
        ("candidate_block_size", 0, "candidate_block_size=0"),
        ("index_topk", -1, "index_topk=-1"),
        ("engram_max_ngram_size", 1, "engram_max_ngram_size=1"),
        ("my_knob", 1, "my_knob"),
        ("num_key_value_heads", 2, "num_key_value_heads=2"),
        ("layer_types", ["sliding_attention"] * 40, "layer_types=.* disagrees"),
        ("/text_config", [1], "text_config=.* must be a JSON object"),
        ("/extra_field", 1, "extra_field"),
        ("/quantization_config", {"quant_method": "awq"}, "quant_method='awq'"),
    ],
)
def test_bad_values_name_the_field(path, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        DeepseekV41Config.from_dict(_patched(path, value))


def test_a_ratio_layer_needs_a_kv_source_before_it() -> None:
    with pytest.raises(ConfigError, match=r"compress_ratios\[2\]=2 but no kv_source_layer_ids entry"):
        DeepseekV41Config.from_dict(tiny_text(kv_source_layer_ids=[5, 7], index_source_layer_ids=[5, 7]))
