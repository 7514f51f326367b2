"""The tiny model's architecture: one dict, read by transformers (training) and DeepInfer (serving).

Every DeepSeek-V4 mechanism is on: sliding-window attention in every layer, CSA (ratio 4, with the
lightning indexer, top-16) and HCA (ratio 16) layers, a hash-routed MoE layer then learned-routed ones
(8 experts, top-2, plus a shared expert), mHC with two streams, and per-head attention sinks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizer import BOS_ID, EOS_ID, NOISE_ID, PAD_ID, VOCAB_SIZE

CONTEXT_LEN = 512

ARCH: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=192, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16,
    q_lora_rank=96, o_groups=2, o_lora_rank=64,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=64, index_n_heads=4, index_head_dim=32, index_topk=16,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
    num_hash_layers=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, norm_topk_prob=True,
    swiglu_limit=10.0, hc_mult=2, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
    num_nextn_predict_layers=0, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    tie_word_embeddings=False, initializer_range=0.02,
)

# For a DSpark draft head trained later (not part of this model): the noise token is a reserved
# special token of the tokenizer; the draft reads the last two layers' hidden states.
DSPARK: dict[str, Any] = dict(
    dspark_block_size=5, dspark_noise_token_id=NOISE_ID, dspark_target_layer_ids=[4, 5], dspark_markov_rank=32,
)


def config_json(dtype: str = "bfloat16") -> dict[str, Any]:
    """The shipped config.json: ARCH plus DSpark fields and the HF bookkeeping keys."""
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **ARCH, **DSPARK,
            "torch_dtype": dtype}


def write_config(folder: Path, dtype: str = "bfloat16") -> None:
    (folder / "config.json").write_text(json.dumps(config_json(dtype), indent=2) + "\n", encoding="utf-8")
