"""Triton kernels (CUDA). Importing this package needs `triton`; the registry imports it lazily."""

from .mhc import hc_post_fused, hc_pre_fused
from .paged import compress_decode_fused, paged_decode_attention_fused, paged_indexer_scores_fused
from .rowwise import apply_rope_fused, rms_norm_fused

__all__ = ["apply_rope_fused", "compress_decode_fused", "hc_post_fused", "hc_pre_fused",
           "paged_decode_attention_fused", "paged_indexer_scores_fused", "rms_norm_fused"]
