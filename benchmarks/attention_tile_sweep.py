"""Tile sweep of the paged decode attention kernel at V4-Flash CSA shapes.

    python benchmarks/attention_tile_sweep.py --batches 32,128,256 --out attention_tile_sweep.json

For each batch (kernels_gpu.py's inputs: 64 heads × 512, 128 window rows + 512 picked compressed
rows per sequence) it times `paged_decode_attention_fused` with every tile shape of the grid below
substituted for `_attention_tiles`, inside CUDA graphs, and reports median µs per call, KV bytes per
second (each row counted once) and the largest error against the reference op.
"""

from __future__ import annotations

import argparse
import functools
import json
from unittest import mock

import torch
import triton
from kernels_gpu import attention_inputs

from deepinfer.kernels import reference
from deepinfer.kernels.triton_ops import paged

GRID = [dict(BLOCK_H=h, BLOCK_N=n, BLOCK_D=512, CHUNK_D=64, num_warps=w, num_stages=s)
        for h in (16, 32, 64) for n in (16, 32, 64) for w in (4, 8) for s in (1, 2)]


def sweep(b: int, gen: torch.Generator) -> list[dict]:
    args, kv_bytes = attention_inputs(b, gen)
    want = reference.paged_decode_attention(*args).float()
    rows = []
    for tiles in GRID:
        with mock.patch.object(paged, "_attention_tiles", lambda size, dim, seqs, tiles=tiles: dict(tiles)):
            call = functools.partial(paged.paged_decode_attention_fused, *args)
            try:
                error = (call().float() - want).abs().max().item()
                ms = triton.testing.do_bench_cudagraph(call, rep=30)
            except triton.runtime.errors.OutOfResources:
                continue                          # too much shared memory for this tile
        rows.append({"batch": b, **tiles, "us": ms * 1e3, "kv_GBps": kv_bytes / ms / 1e6, "max_error": error})
    print(json.dumps(min(rows, key=lambda r: r["us"])), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="32,128,256")
    ap.add_argument("--out", default="attention_tile_sweep.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [r for b in args.batches.split(",") if b for r in sweep(int(b), gen)]
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "shipped": {b: paged._attention_tiles(2, 512, int(b)) for b in args.batches.split(",") if b},
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
