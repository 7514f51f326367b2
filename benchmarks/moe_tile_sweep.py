"""Tile sweep of the routed-expert kernels (bf16, FP8 block-scaled, MXFP4) at V4-Flash shapes.

    python benchmarks/moe_tile_sweep.py --batches 1,8,32,256 [--formats bf16,fp8,mxfp4] --out moe_tile_sweep.json

For each batch (random routing over 256 experts × 2048, hidden 4096, top-6) and weight format, it
times `triton_ops.moe` with every tile shape of the grid below substituted for `_tiles`, inside CUDA
graphs (`triton.testing.do_bench_cudagraph`, so launch overhead is not counted), and reports median
µs per call, the active experts' stored weight bytes per second, and the largest error against the
reference op. The shipped `_tiles` came from an earlier, uncommitted form of this sweep (graph-captured,
FP8 and MXFP4 at batch 1–256; docs/benchmarks/decode_h200.md).
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch
import triton
from kernels_gpu import quantised

from deepinfer.kernels import reference
from deepinfer.kernels.triton_ops import moe

EXPERTS, HIDDEN, INTER, TOP_K = 256, 4096, 2048, 6
GRID = [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
        for n in (32, 64, 128) for k in (64, 128, 256) for w in (4, 8) for s in (3, 4)]


def experts(gen: torch.Generator, names: list[str]) -> dict[str, tuple]:
    """The same random experts in the formats `names` asks for: bf16 (w13, w2), FP8 block 128 and
    MXFP4 (w13, scale, w2, scale)."""
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda").mul_(HIDDEN**-0.5).bfloat16()
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device="cuda").mul_(INTER**-0.5).bfloat16()
    out = {"bf16": (w13, w2)} if "bf16" in names else {}
    return {**out, **quantised(w13, w2, tuple(names))}


def calls(name: str, weights: tuple, x, ids, routing):
    """(the Triton op, its reference) for one weight format."""
    if name == "bf16":
        return (lambda: moe.moe_experts_fused(x, ids, routing, *weights, 10.0),
                lambda: reference.moe_experts(x, ids, routing, *weights, 10.0))
    if name == "fp8":
        return (lambda: moe.moe_experts_fp8_fused(x, ids, routing, *weights, 10.0, 128),
                lambda: reference.moe_experts_fp8(x, ids, routing, *weights, 10.0, 128))
    return (lambda: moe.moe_experts_mxfp4_fused(x, ids, routing, *weights, 10.0),
            lambda: reference.moe_experts_mxfp4(x, ids, routing, *weights, 10.0))


def sweep(b: int, gen: torch.Generator, formats: dict[str, tuple]) -> list[dict]:
    x = torch.randn(b, HIDDEN, generator=gen, device="cuda").bfloat16()
    logits = torch.randn(b, EXPERTS, generator=gen, device="cuda")
    ids, routing = reference.route(logits, None, TOP_K, scoring_func="sqrtsoftplus", normalize=True, scaling=1.5)
    distinct = ids.unique().numel()
    rows = []
    for name, weights in formats.items():
        if name == "bf16" and b * TOP_K > moe.FUSED_MAX_PAIRS:
            continue                              # larger batches take cuBLAS' grouped GEMMs
        fused, ref = calls(name, weights, x, ids, routing)
        want = ref().float()
        stored = distinct * sum(w[0].numel() * w.element_size() for w in weights)
        for tiles in GRID:
            if name == "fp8" and (128 % tiles["BLOCK_N"] or 128 % tiles["BLOCK_K"]):
                continue                          # FP8 tiles must sit inside one 128 × 128 scale block
            with mock.patch.object(moe, "_tiles", lambda fmt, block, tiles=tiles: dict(tiles)):
                try:
                    error = (fused().float() - want).abs().max().item()
                    ms = triton.testing.do_bench_cudagraph(fused, rep=30)
                except triton.runtime.errors.OutOfResources:
                    continue                      # too much shared memory for this tile
            rows.append({"batch": b, "format": name, "distinct_experts": distinct, **tiles, "us": ms * 1e3,
                         "weight_GBps": stored / ms / 1e6, "max_error": error})
        best = min((r for r in rows if r["format"] == name), key=lambda r: r["us"])
        print(json.dumps(best), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,256")
    ap.add_argument("--formats", default="bf16,fp8,mxfp4")
    ap.add_argument("--out", default="moe_tile_sweep.json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    formats = experts(gen, args.formats.split(","))
    rows = [r for b in args.batches.split(",") if b for r in sweep(int(b), gen, formats)]
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "shipped": {name: moe._tiles(fmt, 128) for name, fmt in
                               (("bf16", moe.PLAIN), ("fp8", moe.FP8_BLOCK), ("mxfp4", moe.MXFP4))},
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
