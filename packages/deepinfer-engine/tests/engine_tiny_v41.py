"""The tiny DeepSeek-V4.1 config.json of the engine tests that load a dummy model (`load_format="dummy"`)."""

# A flat deepseek_v41_text config of six layers with every layer kind: window-only (0, 5), Engram (0, 2),
# the ratio-2 KV source with its indexer (1) and its consumer (2), the ratio-1 KV source and candidate
# source (3), a reindex layer (4, scoring inside the candidates); a DSpark head on layers 4 and 5.
CONFIG = {
    "model_type": "deepseek_v41_text", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2,
    "o_lora_rank": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 64},
    "max_position_embeddings": 256, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 32, "sliding_window": 8, "compress_ratios": [0, 2, 2, 1, 1, 0, 0],
    "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 4], "candidate_source_layer_id": 3,
    "candidate_topk_blocks": 2, "candidate_block_size": 4, "index_n_heads": 4, "index_head_dim": 32,
    "index_topk": 6, "hc_mult": 2, "hc_sinkhorn_iters": 3, "engram_layer_ids": [0, 2],
    "engram_num_embeddings": [240, 306], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32,
    "engram_vocab_size": 50, "engram_pad_id": 2, "engram_compressed_vocab_size": 96, "eos_token_id": 95,
    "bos_token_id": 0, "num_nextn_predict_layers": 1, "dspark_block_size": 3, "dspark_noise_token_id": 94,
    "dspark_target_layer_ids": [4, 5], "dspark_markov_rank": 8, "dspark_n_routed_experts": 3,
    "dspark_num_experts_per_tok": 2,
}
