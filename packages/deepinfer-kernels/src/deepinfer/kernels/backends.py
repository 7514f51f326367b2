"""Registration of the non-reference implementations, by device type."""

from __future__ import annotations

from .registry import register


def _moe_grouped():
    from .torch_ops import moe_experts_grouped
    return moe_experts_grouped


def register_builtin_backends() -> None:
    """CUDA: grouped-GEMM MoE (static shapes, CUDA-graph safe). Everything else: the reference."""
    register("moe_experts", "cuda", _moe_grouped)
