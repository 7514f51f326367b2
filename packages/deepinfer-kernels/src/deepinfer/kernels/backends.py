"""Registration of the non-reference implementations, by device type."""

from __future__ import annotations

from .registry import register


def _moe_grouped():
    from .torch_ops import moe_experts_grouped
    return moe_experts_grouped


def _hc_pre_triton():
    try:
        from .triton_ops import hc_pre_fused
    except ImportError:                     # CUDA without triton: the reference
        from .reference import hc_pre
        return hc_pre
    return hc_pre_fused


def register_builtin_backends() -> None:
    """CUDA: grouped-GEMM MoE (static shapes, CUDA-graph safe) and the fused mHC mixing kernel
    (Triton). Everything else: the reference."""
    register("moe_experts", "cuda", _moe_grouped)
    register("hc_pre", "cuda", _hc_pre_triton)
