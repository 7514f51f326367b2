"""GEMV sweep: the decode projections of V4-Flash at 1–4 rows, on one GPU.

    python benchmarks/gemv_sweep.py --rows 1,4 --out gemv_sweep.json
    python benchmarks/gemv_sweep.py --rows 1 --tilelang-only --out gemv_tilelang.json

For every (rows, out × in) of the stacked V4-Flash projections (docs/benchmarks/decode_h200.md,
"GEMV") it times, inside CUDA graphs that cycle through enough weight copies (≥ 300 MB) that no
weight stays in L2 — as in a real decode step:
- cuBLAS (`F.linear`), and `triton_ops.gemv.gemv` as shipped (its shape heuristic);
- the Triton kernels of `triton_ops.gemv` over a grid of block shapes, warps and stages;
- the candidates that lost: the previous GEMV (`_reduce_every_tile`, a reduction per K tile) and
  split-K over the tensor-core kernel (`_splitk_mma`, float32 atomics);
- with TileLang installed, the TileLang GEMV of `tilelang_ops.gemv` over its block shapes (one row).
Each entry: median µs per call, weight bytes read per second, error against a float32 product.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton_ops import gemv as tgemv

SHAPES = [(1536, 4096), (2560, 4096), (4160, 4096), (40960, 1024), (32768, 1024), (4096, 8192), (4096, 4096),
          (4096, 2048), (256, 4096), (1024, 4096), (512, 4096), (8192, 1024)]


@triton.jit
def _reduce_every_tile(x_ptr, w_ptr, out_ptr, rows, n_out, k_in, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        wmask = (n < n_out)[:, None] & (k < k_in)[None, :]
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * k_in + k[None, :], mask=wmask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + m[:, None] * k_in + k[None, :], mask=(m < rows)[:, None] & (k < k_in)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + m[:, None] * n_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m < rows)[:, None] & (n < n_out)[None, :])


@triton.jit
def _splitk_mma(x_ptr, w_ptr, out_ptr, rows, n_out, k_in, k_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    lo = tl.program_id(1) * k_split
    for k0 in range(lo, lo + k_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + tl.minimum(n, n_out - 1)[:, None].to(tl.int64) * k_in + k[None, :])
        x = tl.load(x_ptr + m[:, None] * k_in + k[None, :], mask=(m < rows)[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    tl.atomic_add(out_ptr + m[None, :] * n_out + n[:, None], acc, mask=(m < rows)[None, :] & (n < n_out)[:, None],
                  sem="relaxed")


def graph_us(calls, reps: int = 10) -> float:
    """Median GPU µs per call of `calls` (thunks) captured together in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / len(calls))
    return sorted(times)[reps // 2]


def candidates(rows: int, n: int, k: int):
    """(family, config, fn(x, w) → [rows, n]) for every candidate of this shape."""
    bm = triton.next_power_of_2(rows)

    def launch(kernel, grid, *meta, **kw):
        def run(x, w):
            out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
            kernel[grid](x, w, out, rows, n, k, *meta, **kw)
            return out
        return run

    yield "cublas", {}, torch.nn.functional.linear
    yield "triton (shipped heuristic)", {}, lambda x, w: tgemv.gemv(x, w, x.dtype)
    bn_prev = min(1 << (max(n // 512, 1).bit_length() - 1), 64)
    bk_prev = min(triton.next_power_of_2(k), max(4096 // (bn_prev * bm), 16))
    yield "previous", {"bn": bn_prev, "bk": bk_prev}, launch(
        _reduce_every_tile, (triton.cdiv(n, bn_prev),), BLOCK_M=bm, BLOCK_N=bn_prev, BLOCK_K=bk_prev, num_warps=4,
        num_stages=3)
    strides = (k, k, n, k, 0)          # strides, then one K range (k_split = k)
    for bn in (1, 2, 4, 8, 16, 32):
        for bk in (256, 512, 1024, 2048, 4096):
            if bk > k or n // bn < 64 or not 1024 <= bn * bk <= 8192 or (rows > 1 and bn * bk > 4096):
                continue
            for warps in (4, 8):
                for stages in (1, 3):
                    yield "triton register-accumulating", {"bn": bn, "bk": bk, "warps": warps, "stages": stages}, \
                        launch(tgemv._gemv_kernel, (triton.cdiv(n, bn),), *strides, BLOCK_M=bm, BLOCK_N=bn,
                               BLOCK_K=bk, num_warps=warps, num_stages=stages)
    for bn in (16, 32, 64):
        for bk in (64, 128, 256):
            for stages in (3, 5):
                if n // bn >= 64:
                    yield "triton tensor-core", {"bn": bn, "bk": bk, "stages": stages}, launch(
                        tgemv._gemv_mma_kernel, (triton.cdiv(n, bn),), *strides, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
                        num_stages=stages)
                for split in (2, 4):
                    if k % (split * bk) == 0 and n // bn * split >= 64:
                        def splitk(x, w, bn=bn, bk=bk, split=split, stages=stages):
                            acc = torch.zeros(rows, n, dtype=torch.float32, device=x.device)
                            _splitk_mma[(triton.cdiv(n, bn), split)](x, w, acc, rows, n, k, k // split, BLOCK_N=bn,
                                                                     BLOCK_K=bk, num_warps=4, num_stages=stages)
                            return acc.to(x.dtype)
                        yield "split-K tensor-core", {"bn": bn, "bk": bk, "stages": stages, "split": split}, splitk


def tilelang_candidates(rows: int, n: int, k: int):
    from deepinfer.kernels.tilelang_ops import gemv as lgemv

    if rows != 1:
        return
    for bn, threads_k, unroll in [(2, 64, 2), (4, 64, 2), (2, 128, 1), (4, 32, 4), (4, 128, 1), (1, 128, 2)]:
        if n % bn == 0 and k % (threads_k * lgemv.VEC * unroll) == 0:
            kernel = lgemv._kernel(n, k, "bfloat16", bn, threads_k, unroll)
            yield "tilelang", {"bn": bn, "threads_k": threads_k, "unroll": unroll}, kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--tilelang-only", action="store_true", help="only cuBLAS, the shipped Triton GEMV and TileLang")
    ap.add_argument("--out", default="gemv_sweep.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        for n, k in SHAPES:
            nbytes = n * k * 2
            copies = max(4, math.ceil(3e8 / nbytes))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ weights[0].float().t()
            found = list(candidates(rows, n, k))
            if args.tilelang_only:
                found = found[:2]
            try:
                found += list(tilelang_candidates(rows, n, k))
            except ImportError:
                pass
            entries = []
            for family, config, fn in found:
                err = ((fn(x, weights[0]).float() - want).abs().max() / want.abs().max()).item()
                us = graph_us([lambda w=w, fn=fn, x=x: fn(x, w) for w in weights])
                entries.append({"family": family, **config, "us": us, "TBps": nbytes / us / 1e6, "rel_err": err})
            best = {}
            for e in entries:
                if e["rel_err"] < 2e-2 and (e["family"] not in best or e["us"] < best[e["family"]]["us"]):
                    best[e["family"]] = e
            print(f"rows {rows} {n}x{k}: " + " | ".join(f"{f} {e['us']:.1f} us ({e['TBps']:.2f} TB/s)"
                                                      for f, e in best.items()), flush=True)
            results.append({"rows": rows, "n": n, "k": k, "weight_MB": nbytes / 1e6, "entries": entries})
            del weights
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
