"""Triton kernels (CUDA). Importing this package needs `triton`; the registry imports it lazily."""

from .gemm import grouped_linear_invariant, linear_invariant
from .gemv import linear_fused
from .indexer import indexer_scores_fused
from .mhc import (
    hc_collapse_fused,
    hc_expand_fused,
    hc_mixes_fused,
    hc_mixes_invariant,
    hc_post_fused,
    hc_pre_fused,
    hc_pre_invariant,
)
from .moe import (
    clamped_swiglu_fused,
    moe_experts_fp8_fused,
    moe_experts_fp8_invariant,
    moe_experts_fused,
    moe_experts_invariant,
    moe_experts_mxfp4_fused,
    moe_experts_mxfp4_invariant,
    route_fused,
)
from .paged import (
    compress_decode_fused,
    paged_decode_attention_fused,
    paged_decode_attention_invariant,
    paged_indexer_scores_fused,
    prefill_attention_fused,
    prefill_attention_invariant,
    sparse_attention_fused,
)
from .rowwise import apply_rope_fused, norm_rope_fused, rms_norm_fused
from .sampling import sample_race_fused, sample_race_invariant
from .topk import topk_lowest_index_fused
from .v41_paged import v41_attention_fused, v41_attention_invariant, v41_index_scores_fused
from .v41_quant import fake_quant_fp4_rows_fused, fake_quant_mxfp8_fused, quant_fp4_rows_fused, quant_mxfp8_rows_fused

__all__ = [
    "apply_rope_fused", "clamped_swiglu_fused", "compress_decode_fused", "fake_quant_fp4_rows_fused",
    "fake_quant_mxfp8_fused", "grouped_linear_invariant", "hc_collapse_fused", "hc_expand_fused", "hc_mixes_fused",
    "hc_mixes_invariant", "hc_post_fused", "hc_pre_fused", "hc_pre_invariant", "indexer_scores_fused", "linear_fused",
    "linear_invariant", "moe_experts_fp8_fused", "moe_experts_fp8_invariant", "moe_experts_fused",
    "moe_experts_invariant", "moe_experts_mxfp4_fused", "moe_experts_mxfp4_invariant", "norm_rope_fused",
    "paged_decode_attention_fused", "paged_decode_attention_invariant", "paged_indexer_scores_fused",
    "prefill_attention_fused", "prefill_attention_invariant", "quant_fp4_rows_fused", "quant_mxfp8_rows_fused",
    "rms_norm_fused", "route_fused", "sample_race_fused", "sample_race_invariant", "sparse_attention_fused",
    "topk_lowest_index_fused", "v41_attention_fused", "v41_attention_invariant", "v41_index_scores_fused",
]
