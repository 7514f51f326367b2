"""Tile sweep of DeepSeek-V4.1's decode attention over the packed cache rows at V4.1-Flash shapes.

    python benchmarks/v41_attention_tile_sweep.py --batches 32,256 --out v41_attention_tile_sweep.json

For each batch: b sequences at context 4096 of a ratio-2 consumer layer (64 heads × 512, a window
ring of 128 MXFP8 rows, 512 picked FP4 entries of 2048), the op `v41_attention_fused` timed with
every tile shape of the grid below substituted for the shipped `_attention_tiles` (split count as
shipped), inside CUDA graphs; median µs per call, packed KV bytes per second (each row read counted
once) and the largest error against `reference.v41_attention`. JSON to `--out`, best per batch printed.
"""

from __future__ import annotations

import argparse
import functools
import json
from unittest import mock

import torch
import triton

from deepinfer.kernels import reference
from deepinfer.kernels.triton_ops import v41_paged

# 12 tiles: a first run over 72 (BLOCK_N 64 and CHUNK_D 128 too) × 3 batches outran 7 minutes on the
# H200 (each tile compiles for a few seconds) before printing anything.
GRID = [dict(BLOCK_H=h, BLOCK_N=n, BLOCK_D=512, CHUNK_D=64, num_warps=w, num_stages=s)
        for h in (32, 64) for n in (16, 32) for w in (4, 8) for s in (1, 2) if not (h == 32 and w == 8)]
HEADS, DIM, WINDOW, RATIO, PICKS, CONTEXT, BLOCK = 64, 512, 128, 2, 512, 4096, 128


def inputs(b: int, gen: torch.Generator) -> tuple[tuple, int]:
    """`v41_attention` arguments for b decoding sequences, and the packed KV bytes a call reads."""
    rows_per_block = BLOCK // RATIO
    blocks = CONTEXT // BLOCK + 1
    q = torch.randn(b, HEADS, DIM, generator=gen).cuda().bfloat16()
    ring = reference.quant_mxfp8_rows(torch.randn((b + 1) * WINDOW, DIM, generator=gen).cuda()).view(b + 1, WINDOW, -1)
    paged = reference.quant_fp4_rows(torch.randn((b * blocks + 1) * rows_per_block, DIM, generator=gen).cuda(),
                                     e4m3_scales=True).view(b * blocks + 1, rows_per_block, -1)
    tables = (torch.arange(b * blocks, dtype=torch.int32).view(b, blocks) + 1).cuda()
    ids = torch.stack([torch.randperm(CONTEXT // RATIO, generator=gen)[:PICKS] for _ in range(b)]).cuda()
    slots = torch.arange(1, b + 1).cuda()
    positions = torch.full((b,), CONTEXT, dtype=torch.int64).cuda()
    sink = torch.randn(HEADS, generator=gen).cuda()
    args = (q, positions, ring, slots, WINDOW, sink, DIM**-0.5, None, 0, paged, tables, ids, RATIO)
    return args, b * (WINDOW * ring.shape[-1] + PICKS * paged.shape[-1])


def sweep(b: int, gen: torch.Generator) -> list[dict]:
    args, kv_bytes = inputs(b, gen)
    want = reference.v41_attention(*args).float()
    shipped = v41_paged._attention_tiles(2, DIM, b)
    rows = []
    for tiles in [shipped] + GRID:
        with mock.patch.object(v41_paged, "_attention_tiles", lambda size, dim, seqs, tiles=tiles: dict(tiles)):
            call = functools.partial(v41_paged.v41_attention_fused, *args)
            try:
                error = (call().float() - want).abs().max().item()
                ms = triton.testing.do_bench_cudagraph(call, rep=20)
            except triton.runtime.errors.OutOfResources:
                continue                          # too much shared memory for this tile
        rows.append({"batch": b, "shipped": tiles is shipped, **tiles, "us": ms * 1e3,
                     "kv_GBps": kv_bytes / ms / 1e6, "max_error": error})
    best = min(rows, key=lambda r: r["us"])
    print(json.dumps({"shipped_us": rows[0]["us"], "best": best}), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--out", default="v41_attention_tile_sweep.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [r for b in args.batches.split(",") if b for r in sweep(int(b), gen)]
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
