"""Batch-invariant twins: ops whose every output row is bitwise the same whatever batch it is in.

`kernels_for(device, batch_invariant=True)` (docs/design.md §12, the engine's `batch_invariant=True`) resolves
each op to, in order: a batch-invariant kernel registered for the device (Triton on CUDA); the
PyTorch twin of this package (same signature as the reference); the op's ordinary implementation
when the op is in `AS_REFERENCE`. Every op of `deepinfer.kernels.reference` is in exactly one of
`__all__` and `AS_REFERENCE` (tests/test_batch_invariant.py checks it).

What makes a reference op depend on its batch, on CPU (torch 2.13, MKL) — see docs/batch_invariance.md:
- GEMMs: the BLAS kernel, blocking and threading follow the shape (`linear`: fixed row tiles);
- reductions over a dimension that is not the last: the vectorised loop runs across the outputs
  and its tail depends on how many there are (here: sums added slice after slice, or moved last);
- some elementwise functions differ by an ulp between the vectorised body and the scalar tail of a
  kernel (`_pointwise`).
The twins are checked on CPU (any thread count); on CUDA the registry serves these ops with its
Triton kernels, which are checked on the GPU.
"""

from .attention import (
    compress_decode,
    compress_pool,
    indexer_scores,
    paged_decode_attention,
    paged_indexer_scores,
    prefill_attention,
    sparse_attention,
)
from .linear import grouped_linear, linear
from .mhc import hc_head, hc_post, hc_pre
from .moe import (
    clamped_swiglu,
    moe_experts,
    moe_experts_fp8,
    moe_experts_mxfp4,
    route,
    router_scores,
    routing_weights,
)
from .v41 import engram_gate, hc_collapse, hc_expand, hc_mixes, v41_attention, v41_index_scores

# Ops whose reference is already batch-invariant: row-wise arithmetic whose functions take the same
# path at any position (RMSNorm, RoPE, the sampler's softmax / sort / race), exact ones (sorts, top-k,
# quantisation of independent blocks), and helpers that see no batch (weights, frequencies). V4.1: the
# packed-row codecs (independent blocks, exact), the integer Engram hashing and its tables, the candidate
# blocks and top-k (exact maxima and stable sorts per row).
AS_REFERENCE: tuple[str, ...] = (
    "YarnScaling", "apply_rope", "candidate_blocks", "dequant_fp4_rows", "dequant_fp8_block", "dequant_mxfp4",
    "dequant_mxfp8_rows", "engram_hash", "engram_offsets", "engram_primes", "fake_quant_fp4", "fake_quant_fp4_rows",
    "fake_quant_fp8", "fake_quant_mxfp8", "norm_rope", "packed_row_bytes", "quant_fp4_rows", "quant_fp8_block",
    "quant_mxfp4", "quant_mxfp8_rows", "rms_norm", "rope_inv_freq", "sample_race", "scale_to_float", "select_experts",
    "topk_finite", "topk_lowest_index",
)

__all__ = [
    "clamped_swiglu",
    "compress_decode",
    "compress_pool",
    "engram_gate",
    "grouped_linear",
    "hc_collapse",
    "hc_expand",
    "hc_head",
    "hc_mixes",
    "hc_post",
    "hc_pre",
    "indexer_scores",
    "linear",
    "moe_experts",
    "moe_experts_fp8",
    "moe_experts_mxfp4",
    "paged_decode_attention",
    "paged_indexer_scores",
    "prefill_attention",
    "route",
    "router_scores",
    "routing_weights",
    "sparse_attention",
    "v41_attention",
    "v41_index_scores",
]
