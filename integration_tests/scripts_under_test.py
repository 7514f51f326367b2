"""Loading the repository's scripts (benchmarks/, tools/) by path for their tests, and the tiny V4
config the prefill benchmark tests share."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]

# Layers: sliding, CSA ratio 4, HCA ratio 8. D 64, H 4 × d 32, R 32, G 2 × O 16, W 8, 4 experts top-2
# × I 64 + 1 shared, hc 2, indexer 2 heads × 16 top-2.
TINY_V4 = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
    qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, moe_intermediate_size=64, num_hash_layers=1, sliding_window=8, hc_mult=2,
    hc_sinkhorn_iters=3, index_n_heads=2, index_head_dim=16, index_topk=2,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
)


def load_script(relative_path: str) -> ModuleType:
    """The script at ROOT / relative_path, imported as a module named after it ("<stem>_under_test")."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(f"{path.stem}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module               # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
