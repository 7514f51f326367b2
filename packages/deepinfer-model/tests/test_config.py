"""config.json parsing: official and transformers field names, and clear errors."""

from __future__ import annotations

import json

import pytest

from deepinfer.model import ConfigError, DeepseekV4Config

FLASH = {  # the released V4-Flash config.json (reference/deepseek-v4-spec.md §1.1), abridged to its fields
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "expert_dtype": "fp4", "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
}


def test_official_v4_flash_config() -> None:
    cfg = DeepseekV4Config.from_dict(FLASH)
    assert cfg.compress_ratios[:4] == (0, 0, 4, 128) and len(cfg.compress_ratios) == 43   # MTP entry cut
    assert cfg.attention_types.count("csa") == 21 and cfg.attention_types.count("hca") == 20
    assert cfg.yarn is not None and cfg.yarn.factor == 16 and cfg.yarn.original_max_position_embeddings == 65536
    assert cfg.quant is not None and cfg.quant.expert_format == "fp4" and cfg.quant.fp8_block == 128
    assert cfg.num_hash_layers == 3 and cfg.eos_token_id == (1,)


def test_dspark_fields_are_kept() -> None:
    cfg = DeepseekV4Config.from_dict({**FLASH, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
                                      "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256,
                                      "compress_ratios": FLASH["compress_ratios"] + [0, 0]})
    assert cfg.dspark_block_size == 5 and cfg.dspark_target_layer_ids == (40, 41, 42)


def test_transformers_field_names() -> None:
    cfg = DeepseekV4Config.from_dict({
        "num_hidden_layers": 3, "head_dim": 32, "partial_rotary_factor": 0.25,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "mlp_layer_types": ["hash_moe", "moe", "moe"], "num_attention_heads": 4, "o_groups": 2,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 5000.0},
                            "compress": {"rope_type": "yarn", "rope_theta": 7000.0, "factor": 2.0,
                                         "original_max_position_embeddings": 32, "attention_factor": 1.0}},
    })
    assert cfg.compress_ratios == (0, 4, 8) and cfg.qk_rope_head_dim == 8 and cfg.num_hash_layers == 1
    assert cfg.rope_theta == 5000.0 and cfg.compress_rope_theta == 7000.0 and cfg.yarn.factor == 2.0


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"compress_ratios": [0, 0] + [4, 64] * 20 + [4]}, "compress_ratios[3]=64"),
        ({"my_new_field": 1}, "my_new_field"),
        ({"model_type": "deepseek_v5"}, "model_type='deepseek_v5'"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7"),
        ({"o_groups": 7}, "o_groups=7"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok=300"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type='linear'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
        ({"hidden_size": 0}, "hidden_size=0"),
        ({"dspark_unknown_knob": 3}, "dspark_unknown_knob"),
    ],
)
def test_unsupported_values_name_the_key(patch, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DeepseekV4Config.from_dict({**FLASH, **patch})


def test_from_model_dir(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        DeepseekV4Config.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(FLASH))
    assert DeepseekV4Config.from_model_dir(tmp_path).hidden_size == 4096
