"""TileLang kernels (CUDA, SM90). Importing this package needs `tilelang` (and `triton`, for the
shapes a kernel does not take); the registry imports it lazily and falls back to the Triton kernels
where TileLang is missing."""

from .gemv import linear_tilelang

__all__ = ["linear_tilelang"]
