"""Registration of the non-reference implementations, by device type."""

from __future__ import annotations

import functools

import torch

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


def _triton_invariant(name: str, kernel: str, **kernels: str):
    """A factory of the batch-invariant CUDA implementation: triton_ops.<kernel>, with keyword arguments
    bound to the named triton_ops kernels (the PyTorch twins' `linear=` / `rms_norm=` slots), or,
    where triton is missing, the PyTorch twin `invariant.<name>`."""
    def factory():
        from . import invariant
        try:
            from . import triton_ops
        except ImportError:
            return getattr(invariant, name)
        impl = getattr(triton_ops, kernel, None) or getattr(invariant, kernel)
        bound = {arg: getattr(triton_ops, target) for arg, target in kernels.items()}
        return functools.partial(impl, **bound) if bound else impl
    return factory


# op -> (implementation, its kernel arguments): triton_ops names, or a twin of `invariant` driven by
# the Triton kernels. Ops not listed run their PyTorch twin (elementwise work only on CUDA:
# compress_pool, router_scores, routing_weights, engram_gate) or, in `invariant.AS_REFERENCE`, their usual kernel.
_INVARIANT_CUDA: dict[str, tuple[str, dict[str, str]]] = {
    "linear": ("linear_invariant", {}),
    "grouped_linear": ("grouped_linear_invariant", {}),
    "clamped_swiglu": ("clamped_swiglu_fused", {"linear": "linear_invariant"}),
    "moe_experts": ("moe_experts_invariant", {}),
    "moe_experts_fp8": ("moe_experts_fp8_invariant", {}),        # the small-batch expert kernels at any batch
    "moe_experts_mxfp4": ("moe_experts_mxfp4_invariant", {}),
    "route": ("route_fused", {}),                                 # one program per token
    "hc_pre": ("hc_pre_invariant", {}),
    "hc_post": ("hc_post_fused", {}),                             # one program per (token, channel block)
    "hc_mixes": ("hc_mixes_invariant", {}),
    "hc_collapse": ("hc_collapse_fused", {}),                     # one program per (token, channel block)
    "hc_expand": ("hc_expand_fused", {}),
    "hc_head": ("hc_head", {"linear": "linear_invariant", "rms_norm": "rms_norm_fused"}),
    "sparse_attention": ("sparse_attention_fused", {}),           # one program per (query, head block)
    "prefill_attention": ("prefill_attention_invariant", {}),     # fixed tiles, one program per (head block, query)
    "paged_decode_attention": ("paged_decode_attention_invariant", {}),
    "indexer_scores": ("indexer_scores", {"linear": "linear_invariant"}),
    "paged_indexer_scores": ("paged_indexer_scores_fused", {}),   # one program per (sequence, entry block)
    "compress_decode": ("compress_decode_fused", {}),             # one program per sequence
    "sample_race": ("sample_race_invariant", {}),
    "v41_attention": ("v41_attention_invariant", {}),             # fixed tiles and splits
    "v41_index_scores": ("v41_index_scores_fused", {}),           # one program per (query, entry block)
}


def packed_layout_wanted(device: torch.device | str) -> bool:
    """Whether routed MXFP4 experts placed on `device` should be re-packed at load time: CUDA, with
    Triton's expert kernels installed and `triton_ops.moe.MXFP4_REPACK` on (their ops then take
    `packed=True`; elsewhere the reference ops would unpack the codes at every call)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from .triton_ops import moe
    except ImportError:
        return False
    return moe.MXFP4_REPACK


def register_builtin_backends() -> None:
    """CUDA: Triton kernels (static shapes, CUDA-graph safe) for mHC, RMSNorm, RoPE (alone or fused),
    the batched-decode ops that read the cache in place, the prefill's attention reading the window
    rows and the paged entries in place (and the older one over gathered rows), the prefill's index
    scores (one launch, no float32 intermediates), top-k, routing, the experts (Triton's expert kernels
    for small batches, from `moe.GROUPED_MIN_PAIRS` pairs its grouped GEMMs over the pairs sorted by
    expert: bf16, FP8 on the FP8 tensor cores, MXFP4 decoded in the kernel; cuBLAS's for float32
    beyond), the projections of 1–4 rows (GEMV; TileLang's for one row where installed), the sampler's
    filters + race (sort-free) and DeepSeek-V4.1's attention and index scores over the packed cache
    rows (decode and prefill), its single-pass mHC and its cache-row quantisation (one launch).
    Everything else: the reference.
    The batch-invariant set on CUDA: `_INVARIANT_CUDA`."""
    for name in ("hc_pre", "hc_post", "hc_mixes", "hc_collapse", "hc_expand", "rms_norm", "apply_rope", "norm_rope",
                 "compress_decode", "paged_decode_attention", "paged_indexer_scores", "topk_lowest_index", "route",
                 "moe_experts", "moe_experts_fp8", "moe_experts_mxfp4", "sample_race", "sparse_attention",
                 "prefill_attention", "indexer_scores", "v41_attention", "v41_index_scores", "quant_mxfp8_rows",
                 "quant_fp4_rows", "fake_quant_mxfp8", "fake_quant_fp4_rows"):
        register(name, "cuda", _triton(name))
    register("linear", "cuda", _linear)
    register("clamped_swiglu", "cuda", _clamped_swiglu)
    for name, (kernel, kernels) in _INVARIANT_CUDA.items():
        register(name, "cuda", _triton_invariant(name, kernel, **kernels), batch_invariant=True)
