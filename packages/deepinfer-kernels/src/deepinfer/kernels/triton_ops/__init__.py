"""Triton kernels (CUDA). Importing this package needs `triton`; the registry imports it lazily."""

from .mhc import hc_pre_fused

__all__ = ["hc_pre_fused"]
