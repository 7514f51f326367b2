"""Every numeric config field is range-checked, in the official and the transformers spellings, and a
bad config.json file is named with what is wrong with it."""

from __future__ import annotations

import json
import re

import pytest
from hf_twin import BASE
from test_config import FLASH

from deepinfer.model import ConfigError, DeepseekV4Config

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"rope_theta": -1}, "rope_theta=-1 must be a finite number > 0"),
        ({"rope_theta": NAN}, "rope_theta=nan must be a finite number > 0"),
        ({"compress_rope_theta": 0}, "compress_rope_theta=0 must be a finite number > 0"),
        ({"routed_scaling_factor": NAN}, "routed_scaling_factor=nan must be a finite number > 0"),
        ({"routed_scaling_factor": INF}, "routed_scaling_factor=inf must be a finite number > 0"),
        ({"hc_eps": -1}, "hc_eps=-1 must be a finite number > 0"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be a finite number > 0"),
        ({"swiglu_limit": -10.0}, "swiglu_limit=-10.0 must be a finite number > 0"),
        ({"swiglu_limit": "10"}, "swiglu_limit='10' must be a finite number > 0"),
        ({"vocab_size": -5}, r"vocab_size=-5 must be an integer >= 1"),
        ({"hidden_size": 64.5}, r"hidden_size=64.5 must be an integer >= 1"),
        ({"head_dim": True}, r"head_dim=True must be an integer >= 1"),
        ({"num_attention_heads": "64"}, r"num_attention_heads='64' must be an integer >= 1"),
        ({"index_topk": 0}, r"index_topk=0 must be an integer >= 1"),
        ({"hc_sinkhorn_iters": 0}, r"hc_sinkhorn_iters=0 must be an integer >= 1"),
        ({"hc_mult": -4}, r"hc_mult=-4 must be an integer >= 1"),
        ({"sliding_window": 0}, r"sliding_window=0 must be an integer >= 1"),
        ({"max_position_embeddings": 0}, r"max_position_embeddings=0 must be an integer >= 1"),
        ({"moe_intermediate_size": None}, r"moe_intermediate_size=None must be an integer >= 1"),
        ({"num_experts_per_tok": 0}, r"num_experts_per_tok=0 must be an integer in \[1, 256\]"),
        ({"n_shared_experts": 2}, r"n_shared_experts=2 must be an integer in \[0, 1\]"),
        ({"num_hash_layers": 44}, r"num_hash_layers=44 must be an integer in \[0, 43\]"),
        ({"num_nextn_predict_layers": -1}, r"num_nextn_predict_layers=-1 must be an integer >= 0"),
        ({"qk_rope_head_dim": 256}, r"qk_rope_head_dim=256 must be <= index_head_dim=128"),
        ({"bos_token_id": 129280}, r"bos_token_id=129280 must be an integer in \[0, 129279\]"),
        ({"eos_token_id": [1, -1]}, r"eos_token_id\[1\]=-1 must be an integer in \[0, 129279\]"),
        ({"eos_token_id": "1"}, r"eos_token_id\[0\]='1' must be an integer"),
        ({"norm_topk_prob": "yes"}, r"norm_topk_prob='yes' must be true or false"),
        ({"num_hidden_layers": "43"}, r"num_hidden_layers='43' must be an integer >= 1"),
        ({"compress_ratios": [0, 0, 4]}, r"compress_ratios has 3 entries, num_hidden_layers=43"),
        ({"compress_ratios": "0,0,4"}, r"compress_ratios='0,0,4' must be a list"),
        ({"compress_ratios": [0, [4]] + [0] * 42}, r"compress_ratios\[1\]=\[4\] must be one of"),
        ({"rope_scaling": {**FLASH["rope_scaling"], "factor": -16}}, r"rope_scaling.factor=-16 must be a finite"),
        ({"rope_scaling": {**FLASH["rope_scaling"], "beta_fast": NAN}}, r"rope_scaling.beta_fast=nan must be"),
        ({"rope_scaling": {**FLASH["rope_scaling"], "original_max_position_embeddings": 0}},
         r"rope_scaling.original_max_position_embeddings=0 must be an integer >= 1"),
        ({"rope_scaling": [1, 2]}, r"rope_scaling=\[1, 2\] must be a JSON object"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 0]}},
         r"quantization_config.weight_block_size=0 must be an integer >= 1"),
        ({"quantization_config": "fp8"}, r"quantization_config='fp8' must be a JSON object"),
        ({"dspark_block_size": 0}, r"dspark_block_size=0 must be an integer >= 1"),
        ({"dspark_target_layer_ids": [40, 43]}, r"dspark_target_layer_ids\[1\]=43 must be an integer in \[0, 42\]"),
        ({"dspark_noise_token_id": -1}, r"dspark_noise_token_id=-1 must be an integer in \[0, 129279\]"),
    ],
)
def test_official_numeric_fields_are_range_checked(patch: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DeepseekV4Config.from_dict({**FLASH, **patch})


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"partial_rotary_factor": NAN, "qk_rope_head_dim": None}, r"partial_rotary_factor=nan must be a finite"),
        ({"partial_rotary_factor": 1.5, "qk_rope_head_dim": None}, r"partial_rotary_factor=1.5 must .* in \(0, 1\]"),
        ({"compress_rates": {"compressed_sparse_attention": -4, "heavily_compressed_attention": 8}},
         r"compress_rates.compressed_sparse_attention=-4 must be an integer >= 1"),
        ({"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8.5}},
         r"compress_rates.heavily_compressed_attention=8.5 must be an integer >= 1"),
        ({"compress_rate_csa": 0}, r"compress_rates.compressed_sparse_attention=0 must be an integer >= 1"),
        ({"layer_types": BASE["layer_types"][:3]}, r"layer_types has 3 entries, num_hidden_layers=4"),
        ({"layer_types": ["sliding_attention", 3, "sliding_attention", "sliding_attention"]}, r"layer_types\[1\]=3"),
        ({"mlp_layer_types": "moe"}, r"mlp_layer_types='moe' must be a list"),
        ({"intermediate_size": -48, "moe_intermediate_size": None}, r"intermediate_size=-48 must be an integer >= 1"),
        ({"num_local_experts": 0, "n_routed_experts": None}, r"num_local_experts=0 must be an integer >= 1"),
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": -1.0},
                              "compress": {"rope_type": "default", "rope_theta": 160000.0}}},
         r"rope_parameters.main.rope_theta=-1.0 must be a finite number > 0"),
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                              "compress": {"rope_type": "default", "rope_theta": INF}}},
         r"rope_parameters.compress.rope_theta=inf must be a finite number > 0"),
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                              "compress": {"rope_type": "yarn", "rope_theta": 1.6e5, "factor": 0,
                                           "original_max_position_embeddings": 64}}},
         r"rope_parameters.compress.factor=0 must be a finite number > 0"),
    ],
)
def test_transformers_numeric_fields_are_range_checked(patch: dict, message: str) -> None:
    raw = {**BASE, **patch}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        DeepseekV4Config.from_dict(raw)


def test_transformers_aliases_are_used() -> None:
    raw = {k: v for k, v in BASE.items() if k not in ("moe_intermediate_size", "n_routed_experts")}
    cfg = DeepseekV4Config.from_dict({**raw, "intermediate_size": 40, "num_local_experts": 6})
    assert cfg.moe_intermediate_size == 40 and cfg.n_routed_experts == 6


def test_direct_construction_is_checked_too() -> None:
    cfg = DeepseekV4Config.from_dict(FLASH)
    with pytest.raises(ConfigError, match=r"hc_eps=-1.0 must be a finite number > 0"):
        DeepseekV4Config(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "hc_eps": -1.0})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"not valid JSON: Expecting value at line 1 column 1"),
        (b'{"hidden_size": 64,', r"not valid JSON: Expecting property name enclosed in double quotes at line 1"),
        (b'{"model_type": "deepseek_v4\xff"}', r"not UTF-8 text \(invalid byte at offset 27\)"),
        (b"[1, 2]", r"must hold a JSON object, got a JSON array"),
        (b'"config"', r"must hold a JSON object, got a JSON string"),
        (b"[" * 100_000, r"not valid JSON: nested too deeply"),
    ],
)
def test_bad_config_json_names_the_file(tmp_path, content: bytes, message: str) -> None:
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "config.json")) + ": " + message):
        DeepseekV4Config.from_model_dir(tmp_path)


def test_config_json_errors_name_the_file_and_field(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**FLASH, "rope_theta": -1}))
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'config.json'}: rope_theta=-1 must be")):
        DeepseekV4Config.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"routed_scaling_factor": NaN}')     # Python's json reads NaN
    with pytest.raises(ConfigError, match=r"config needs `compress_ratios`"):
        DeepseekV4Config.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(FLASH).replace('"routed_scaling_factor": 1.5',
                                                                    '"routed_scaling_factor": NaN'))
    with pytest.raises(ConfigError, match=r"routed_scaling_factor=nan must be a finite number > 0"):
        DeepseekV4Config.from_model_dir(tmp_path)


def test_config_json_that_is_a_folder_or_missing(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"config.json does not exist: a model folder needs a config.json"):
        DeepseekV4Config.from_model_dir(tmp_path)
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=r"config.json is a directory, not a file"):
        DeepseekV4Config.from_model_dir(tmp_path)
