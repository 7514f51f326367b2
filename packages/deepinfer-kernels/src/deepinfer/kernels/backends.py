"""Registration of the non-reference implementations, by device type."""

from __future__ import annotations

import functools

from .registry import register


def _triton(name: str):
    """A factory returning triton_ops.<name>_fused or, where triton is missing, the plain-torch
    implementation (torch_ops.<name>_grouped for the experts, else reference.<name>)."""
    def factory():
        try:
            from . import triton_ops
        except ImportError:
            from . import reference, torch_ops
            return getattr(torch_ops, f"{name}_grouped", None) or getattr(reference, name)
        return getattr(triton_ops, f"{name}_fused")
    return factory


def _linear():
    """The projection on CUDA: TileLang's one-row GEMV where TileLang is installed (else Triton's GEMV
    for 1–4 rows, else the reference); both hand larger batches to cuBLAS."""
    try:
        from .tilelang_ops import linear_tilelang
    except ImportError:
        return _triton("linear")()
    return linear_tilelang


def _clamped_swiglu():
    """The shared expert on CUDA: Triton's activation kernel around the projections of `_linear`."""
    try:
        from .triton_ops import clamped_swiglu_fused
    except ImportError:
        return _triton("clamped_swiglu")()
    return functools.partial(clamped_swiglu_fused, linear=_linear())


def register_builtin_backends() -> None:
    """CUDA: Triton kernels (static shapes, CUDA-graph safe) for mHC, RMSNorm, RoPE (alone or fused),
    the batched-decode ops that read the cache in place, the prefill's attention over gathered rows,
    top-k, routing, the experts (grouped GEMMs: Triton for small batches, cuBLAS beyond; FP8 and
    MXFP4 experts: Triton at any batch), the projections of 1–4 rows (GEMV; TileLang's for one row
    where installed) and the sampler's filters + race (sort-free). Everything else: the reference."""
    for name in ("hc_pre", "hc_post", "rms_norm", "apply_rope", "norm_rope", "compress_decode",
                 "paged_decode_attention", "paged_indexer_scores", "topk_lowest_index", "route", "moe_experts",
                 "moe_experts_fp8", "moe_experts_mxfp4", "sample_race", "sparse_attention"):
        register(name, "cuda", _triton(name))
    register("linear", "cuda", _linear)
    register("clamped_swiglu", "cuda", _clamped_swiglu)
