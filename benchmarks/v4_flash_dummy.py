"""Write a V4-Flash-shaped config.json for `deepinfer bench --load-format dummy` (run on purpose).

    python benchmarks/v4_flash_dummy.py --layers 8 --out /tmp/v4-flash-8l
    deepinfer bench --load-format dummy --model /tmp/v4-flash-8l --device cuda --dtype bfloat16 \\
        --gpu-memory-utilization 0.9 --num-prompts 64 --input-len 1024 --output-len 256

The folder gets a config.json only: every size is the released DeepSeek-V4-Flash's (hidden 4096,
64 heads × 512, q_lora 1024, o 8 × 1024, 256 routed experts × 2048, top-6, one shared expert, mHC 4,
window 128, indexer 64 × 128 top-512, vocab 129,280, YaRN on the compressed layers; the reference
spec's §1.1), cut to `--layers` layers of the real schedule (layers 0-1 window-only, then CSA ratio 4
and HCA ratio 128 alternating; the first three hash-routed), no MTP layer. `--load-format dummy`
then builds the model on the device with seeded random weights of these shapes (no checkpoint, no
tokenizer: the bench's prompts are token ids). The script prints the weight bytes the model will
take for each expert_dtype, from the model built on the meta device (nothing allocated).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer.model import DeepseekV4Config
from deepinfer.model.model import build_model

FLASH_LAYERS = 43
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
    "vocab_size": 129280, "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 0,
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
}


def flash_schedule(num_layers: int) -> list[int]:
    """The first `num_layers` compress ratios of V4-Flash: 0, 0, then 4 (CSA) on even and 128 (HCA)
    on odd layers."""
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(num_layers)]


def flash_config(num_layers: int) -> dict:
    """config.json of a V4-Flash cut to `num_layers` layers (1 to 43)."""
    if not 1 <= num_layers <= FLASH_LAYERS:
        raise ValueError(f"num_layers={num_layers} must be in [1, {FLASH_LAYERS}]")
    return {**FLASH, "num_hidden_layers": num_layers, "compress_ratios": flash_schedule(num_layers),
            "num_hash_layers": min(3, num_layers)}


# Tiny widths over the same schedule (sliding, then CSA 4 / HCA 128), for CPU function checks of the
# benchmarks that build V4-Flash-shaped models (benchmarks/scaleout_gpu.py --shape tiny): 8 experts top-2.
TINY_WIDTHS = {
    "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 8,
    "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8, "index_n_heads": 2,
    "index_head_dim": 16, "index_topk": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "hc_mult": 2, "hc_sinkhorn_iters": 3, "quantization_config": None,
}


def tiny_flash_config(num_layers: int) -> dict:
    """`flash_config(num_layers)` with tiny widths (TINY_WIDTHS): a model for CPU runs of the
    benchmarks' code paths, not of V4-Flash's cost."""
    return {key: value for key, value in {**flash_config(num_layers), **TINY_WIDTHS}.items() if value is not None}


def weight_gib(cfg: DeepseekV4Config, dtype: torch.dtype, expert_dtype: str | None) -> float:
    """GiB of parameters and buffers of the model `load_model` would build (on the meta device)."""
    model = build_model(cfg, device="meta", dtype=dtype, expert_dtype=expert_dtype)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="backbone layers, 1 to 43 [default: 8]")
    parser.add_argument("--out", type=Path, required=True, help="folder to write config.json into (made if absent)")
    args = parser.parse_args()
    try:
        raw = flash_config(args.layers)
    except ValueError as error:
        parser.error(f"argument --layers: {error}")
    cfg = DeepseekV4Config.from_dict(raw)                   # the engine will read it the same way
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"wrote {args.out / 'config.json'}: {args.layers} layers, compress_ratios {list(cfg.compress_ratios)}")
    for expert_dtype in (None, "fp8", "fp4"):
        print(f"  bfloat16 weights, expert_dtype={expert_dtype}: "
              f"{weight_gib(cfg, torch.bfloat16, expert_dtype):.1f} GiB")


if __name__ == "__main__":
    main()
