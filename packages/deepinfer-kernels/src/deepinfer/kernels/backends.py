"""Registration of the non-reference implementations, by device type."""

from __future__ import annotations

from .registry import register


def _moe_grouped():
    from .torch_ops import moe_experts_grouped
    return moe_experts_grouped


def _triton(name: str, fused: str):
    """A factory returning triton_ops.<fused>, or reference.<name> where triton is missing."""
    def factory():
        try:
            from . import triton_ops
        except ImportError:                 # CUDA without triton: the reference
            from . import reference
            return getattr(reference, name)
        return getattr(triton_ops, fused)
    return factory


def register_builtin_backends() -> None:
    """CUDA: grouped-GEMM MoE (static shapes, CUDA-graph safe); Triton kernels for mHC, RMSNorm,
    RoPE and the batched-decode ops that read the cache in place. Everything else: the reference."""
    register("moe_experts", "cuda", _moe_grouped)
    for name in ("hc_pre", "hc_post", "compress_decode", "paged_decode_attention", "paged_indexer_scores"):
        register(name, "cuda", _triton(name, f"{name}_fused"))
    register("rms_norm", "cuda", _triton("rms_norm", "rms_norm_fused"))
    register("apply_rope", "cuda", _triton("apply_rope", "apply_rope_fused"))
