"""One-row matrix–vector product in TileLang: twin of `reference.linear` for decode at batch 1.

Each block of 64 × 2 threads owns two output channels; a thread reads 2 × 16 bytes of its channel's
weight row per step (two independent vector loads in flight), keeps a float32 partial sum, and the
64 partial sums of a channel are combined by one warp-level all-reduce at the end. On the H200 this
reads V4-Flash projections at 2.5–3.9 TB/s, 5–25 % faster than the Triton GEMV of
`triton_ops.gemv` at one row (docs/benchmarks/decode_h200.md, "GEMV"). The kernel is compiled per
(out, in, dtype) on first use; other shapes and row counts go to the Triton GEMV.
"""

from __future__ import annotations

import functools

import tilelang
import tilelang.language as T
import torch
from torch import Tensor

from ..triton_ops.gemv import linear_fused

BLOCK_N = 2          # output channels per block
THREADS_K = 64       # threads sharing one channel's dot product
VEC = 8              # 16-byte loads of 2-byte elements
UNROLL = 2           # vector loads in flight per thread and step
BLOCK_K = THREADS_K * VEC * UNROLL
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.cache
def _kernel(n_out: int, k_in: int, dtype: str, block_n: int = BLOCK_N, threads_k: int = THREADS_K,
            unroll: int = UNROLL):
    """The compiled kernel for x [1, k_in] @ W[n_out, k_in]ᵀ → [1, n_out] (all `dtype`); the block
    shape is tunable for `benchmarks/gemv_sweep.py` (n_out % block_n == 0, k_in % (threads_k · 8 ·
    unroll) == 0)."""
    block_k = threads_k * VEC * unroll

    @tilelang.jit(out_idx=[-1])
    def build():
        @T.prim_func
        def gemv(x: T.Tensor((1, k_in), dtype), w: T.Tensor((n_out, k_in), dtype), y: T.Tensor((1, n_out), dtype)):
            with T.Kernel(n_out // block_n, threads=(threads_k, block_n)) as block:
                tk = T.get_thread_binding(0)
                tn = T.get_thread_binding(1)
                row = block * block_n + tn
                w_reg = T.alloc_local((unroll * VEC,), dtype)
                x_reg = T.alloc_local((unroll * VEC,), dtype)
                partial = T.alloc_local((1,), "float32")
                total = T.alloc_local((1,), "float32")
                T.clear(partial)
                for step in T.serial(k_in // block_k):
                    for u in T.unroll(unroll):
                        for v in T.vectorized(VEC):
                            w_reg[u * VEC + v] = w[row, step * block_k + (u * threads_k + tk) * VEC + v]
                    for u in T.unroll(unroll):
                        for v in T.vectorized(VEC):
                            x_reg[u * VEC + v] = x[0, step * block_k + (u * threads_k + tk) * VEC + v]
                    for i in T.unroll(unroll * VEC):
                        partial[0] += x_reg[i].astype("float32") * w_reg[i].astype("float32")
                with T.attr(T.comm_reducer(lambda a, b: a + b, [T.Cast("float32", 0)]), "reduce_scope",
                            T.reinterpret(T.uint64(0), dtype="handle")):
                    T.evaluate(T.tvm_thread_allreduce(T.uint32(1), partial[0], True, total[0], tk, dtype="handle"))
                y[0, row] = total[0]

        return gemv

    return build()


def supported(x: Tensor, weight: Tensor) -> bool:
    """Whether the TileLang GEMV takes this product: one CUDA row, bf16 / fp16 like the weight,
    in % BLOCK_K == 0, out % BLOCK_N == 0, a contiguous weight."""
    k_in = x.shape[-1]
    return (x.is_cuda and x.numel() == k_in and x.dtype == weight.dtype and x.dtype in _DTYPES
            and weight.dim() == 2 and weight.is_contiguous() and k_in > 0 and k_in % BLOCK_K == 0
            and weight.shape[0] % BLOCK_N == 0)


def linear_tilelang(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `reference.linear`: the TileLang kernel where `supported`, else the Triton GEMV
    (which itself hands more than 4 rows to cuBLAS)."""
    if not supported(x, weight):
        return linear_fused(x, weight)
    n_out, k_in = weight.shape
    y = _kernel(n_out, k_in, _DTYPES[x.dtype])(x.reshape(1, k_in).contiguous(), weight)
    return y.view(*x.shape[:-1], n_out)
