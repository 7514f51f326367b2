"""Pure-PyTorch reference implementations of every DeepSeek-V4 op.

Each op is a small function documented with shapes and dtypes; GPU kernels registered in
`deepinfer.kernels` must match these (integer and routing outputs bitwise).
"""

from .attention import grouped_linear, sparse_attention
from .compressor import compress_pool
from .indexer import indexer_scores, topk_lowest_index
from .linear import linear
from .mhc import hc_head, hc_post, hc_pre
from .moe import (
    clamped_swiglu,
    moe_experts,
    moe_experts_fp8,
    moe_experts_mxfp4,
    route,
    router_scores,
    routing_weights,
    select_experts,
)
from .norm import rms_norm
from .paged import compress_decode, paged_decode_attention, paged_indexer_scores, prefill_attention
from .quant import (
    dequant_fp8_block,
    dequant_mxfp4,
    fake_quant_fp4,
    fake_quant_fp8,
    quant_fp8_block,
    quant_mxfp4,
    scale_to_float,
)
from .rope import YarnScaling, apply_rope, norm_rope, rope_inv_freq
from .sampling import sample_race
from .v41_engram import engram_gate, engram_hash, engram_offsets, engram_primes
from .v41_indexer import candidate_blocks, topk_finite
from .v41_mhc import hc_collapse, hc_expand, hc_mixes
from .v41_paged import v41_attention, v41_index_scores
from .v41_quant import (
    dequant_fp4_rows,
    dequant_mxfp8_rows,
    fake_quant_fp4_rows,
    fake_quant_mxfp8,
    packed_row_bytes,
    quant_fp4_rows,
    quant_mxfp8_rows,
)

__all__ = [
    "YarnScaling",
    "apply_rope",
    "candidate_blocks",
    "clamped_swiglu",
    "compress_decode",
    "compress_pool",
    "dequant_fp4_rows",
    "dequant_fp8_block",
    "dequant_mxfp4",
    "dequant_mxfp8_rows",
    "engram_gate",
    "engram_hash",
    "engram_offsets",
    "engram_primes",
    "fake_quant_fp4",
    "fake_quant_fp4_rows",
    "fake_quant_fp8",
    "fake_quant_mxfp8",
    "grouped_linear",
    "hc_collapse",
    "hc_expand",
    "hc_head",
    "hc_mixes",
    "hc_post",
    "hc_pre",
    "indexer_scores",
    "linear",
    "moe_experts",
    "moe_experts_fp8",
    "moe_experts_mxfp4",
    "norm_rope",
    "packed_row_bytes",
    "paged_decode_attention",
    "paged_indexer_scores",
    "prefill_attention",
    "quant_fp4_rows",
    "quant_fp8_block",
    "quant_mxfp4",
    "quant_mxfp8_rows",
    "rms_norm",
    "rope_inv_freq",
    "route",
    "router_scores",
    "routing_weights",
    "sample_race",
    "scale_to_float",
    "select_experts",
    "sparse_attention",
    "topk_finite",
    "topk_lowest_index",
    "v41_attention",
    "v41_index_scores",
]
