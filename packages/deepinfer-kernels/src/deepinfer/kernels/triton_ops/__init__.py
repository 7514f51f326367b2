"""Triton kernels (CUDA). Importing this package needs `triton`; the registry imports it lazily."""

from .mhc import hc_pre_fused
from .rowwise import apply_rope_fused, rms_norm_fused

__all__ = ["apply_rope_fused", "hc_pre_fused", "rms_norm_fused"]
