"""The tiny DeepSeek-V4 config.json of the engine tests that load a dummy model (`load_format="dummy"`)."""

# A tiny V4 (transformers names): window-only, CSA and HCA layers, hash-routed and learned MoE layers.
CONFIG = {
    "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32,
    "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "num_hash_layers": 1,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "sliding_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8, "hc_mult": 2, "hc_sinkhorn_iters": 3, "index_n_heads": 2, "index_head_dim": 16,
    "index_topk": 8, "max_position_embeddings": 256,
}

# Smaller still, for tests that drive a ModelRunner directly (one layer of each kind, 3 layers, no shared expert).
RUNNER_CONFIG = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 16,
    "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 1, "o_lora_rank": 8, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16, "num_hash_layers": 1, "sliding_window": 4, "hc_mult": 2,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 2,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
}
