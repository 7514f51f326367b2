"""DeepSeek-V4.1 configs for the tests: the released composite config.json (reference/
deepseek-v4-spec.md §1.2) and tiny text configs that exercise every layer kind."""

from __future__ import annotations

from typing import Any

RELEASED_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024, "rms_norm_eps": 1e-20, "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "max_position_embeddings": 1048576, "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "moe_intermediate_size": 2304, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256, "engram_vocab_size": 16000000,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "attention_bias": False, "dtype": "bfloat16",
}
RELEASED: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "image_token_id": 129264,
    "text_config": RELEASED_TEXT,
    "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 1024, "num_hidden_layers": 32},
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "dtype": "bfloat16",
}


def tiny_text(**overrides: Any) -> dict[str, Any]:
    """A flat deepseek_v41_text config of 12 layers with every layer kind: window-only (0, 1), an
    Engram layer (1 and 5), ratio-2 KV sources with their own indexer (2, 5) and consumers (3, 4, 6),
    the ratio-1 KV source and candidate source (7), reuse layers (8, 10, 11) and a reindex layer (9).
    Head sizes are multiples of 32 so the packed cache formats apply."""
    cfg: dict[str, Any] = {
        "model_type": "deepseek_v41_text", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 12,
        "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2,
        "o_lora_rank": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 64},
        "max_position_embeddings": 256, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 0],
        "kv_source_layer_ids": [2, 5, 7], "index_source_layer_ids": [2, 5, 7, 9],
        "candidate_source_layer_id": 7, "candidate_topk_blocks": 2, "candidate_block_size": 4,
        "index_n_heads": 16, "index_head_dim": 32, "index_topk": 6, "hc_mult": 2, "hc_sinkhorn_iters": 3,
        "engram_layer_ids": [1, 5], "engram_num_embeddings": [240, 306], "engram_max_ngram_size": 3,
        "engram_n_heads": 2, "engram_head_dim": 32, "engram_vocab_size": 50, "engram_pad_id": 2,
        "engram_compressed_vocab_size": 96, "num_nextn_predict_layers": 1, "dspark_target_layer_ids": [9, 10, 11],
        "eos_token_id": 1, "bos_token_id": 0,
    }
    cfg.update(overrides)
    return cfg
