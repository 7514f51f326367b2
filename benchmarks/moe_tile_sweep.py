"""Tile sweep of the small-batch routed-expert kernels: bf16, FP8 block-scaled, and MXFP4 through
each decoder of `triton_ops.mxfp4`, at V4-Flash or V4.1-Flash shapes.

    source benchmarks/device_env.sh
    python benchmarks/moe_tile_sweep.py --formats mxfp4 --shape v41 --out moe_tile_sweep_mxfp4_v41.json
    python benchmarks/moe_tile_sweep.py --cpu-smoke --out smoke.json   # tiny shapes, Triton's interpreter

Shapes: v4 = V4-Flash (256 experts, hidden 4096, intermediate 2048), v41 = V4.1-Flash (384, 5120,
2304); top-6. For each batch (random routing), weight format (MXFP4: each decoder of --decodes) and
tile of the grid (BLOCK_N × BLOCK_K × warps × stages; FP8 tiles must divide its 128 × 128 scale
blocks) it times `triton_ops.moe._experts` with that decoder and tile inside CUDA graphs
(`do_bench_cudagraph`, median, launch overhead not counted) and reports µs per call, the active
experts' stored weight bytes per second and the largest error against the reference op (absolute,
and relative to the reference's largest output). Every kernel compiles first, in a thread pool. MXFP4
experts are random codes under random scale bytes 117–121 (weights up to 6 · 2^-6, as quantised ones
of std ~1/sqrt(hidden)); bf16 / FP8 ones are random bf16 weights, quantised (`kernels_gpu.quantised`).
The last lines: the best tile per batch and format / decoder. `--cpu-smoke` runs the same code on
the CPU (Triton's interpreter, float32 activations and "bf16" weights, 8 experts, hidden and
intermediate 128, 3 tokens, the decoders the interpreter runs, one tile, one timed call each).

The shipped MXFP4 decoder and its tile: `triton_ops.moe.MXFP4_DECODE`, `MXFP4_TILES` (`packed`, the
decoder of codes re-packed at load time, runs on re-packed copies of the same experts; the loader
re-packs with `moe.MXFP4_REPACK`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"       # before triton is imported

import torch
import triton
from kernels_gpu import quantised

from deepinfer.kernels import reference, repack_mxfp4_for_decode
from deepinfer.kernels.triton_ops import moe, mxfp4

TOP_K, LIMIT = 6, 10.0


@dataclass(frozen=True, slots=True)
class Shape:
    experts: int
    hidden: int
    inter: int


SHAPES = {"v4": Shape(256, 4096, 2048), "v41": Shape(384, 5120, 2304)}
SMOKE = Shape(8, 128, 128)
DECODE_NAMES = {code: name for name, code in mxfp4.DECODES.items()}


@dataclass(frozen=True, slots=True)
class Variant:
    fmt: str                  # "bf16", "fp8", "mxfp4"
    decode: int | None        # MXFP4's decoder

    @property
    def name(self) -> str:
        return self.fmt if self.decode is None else f"{self.fmt}/{DECODE_NAMES[self.decode]}"

    @property
    def weights(self) -> str:
        """Its key in `experts`' result: MXFP4's `packed` decoder reads re-packed codes."""
        return "mxfp4_packed" if self.decode == mxfp4.MX_PACKED else self.fmt


def grid(block_n: list[int], block_k: list[int], warps: list[int], stages: list[int]) -> list[dict[str, int]]:
    return [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
            for n in block_n for k in block_k for w in warps for s in stages]


def fits(variant: Variant, tiles: dict[str, int]) -> bool:
    """FP8 tiles must sit inside one 128 × 128 scale block."""
    return variant.fmt != "fp8" or not (128 % tiles["BLOCK_N"] or 128 % tiles["BLOCK_K"])


def mxfp4_experts(shape: Shape, gen: torch.Generator, device: str) -> tuple[torch.Tensor, ...]:
    """Random MXFP4 experts (w13 [E, 2I, H / 2], w13_scale, w2 [E, H, I / 2], w2_scale; uint8)."""
    e, h, i = shape.experts, shape.hidden, shape.inter

    def codes(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.randint(0, 256, (e, rows, cols // 2), generator=gen, device=device, dtype=torch.uint8)
        scale = torch.randint(117, 122, (e, rows, cols // 32), generator=gen, device=device, dtype=torch.uint8)
        return packed, scale

    return (*codes(2 * i, h), *codes(h, i))


def experts(shape: Shape, formats: list[str], gen: torch.Generator, device: str, dtype,
            packed: bool = False) -> dict[str, tuple]:
    """The experts of each format asked for: bf16 (w13, w2), FP8 block 128 and MXFP4 (w13, scale,
    w2, scale); with `packed`, also the MXFP4 ones with their codes re-packed ("mxfp4_packed")."""
    out = {}
    if "bf16" in formats or "fp8" in formats:
        w13 = torch.randn(shape.experts, 2 * shape.inter, shape.hidden, generator=gen, device=device)
        w13 = w13.mul_(shape.hidden**-0.5).to(dtype)
        w2 = torch.randn(shape.experts, shape.hidden, shape.inter, generator=gen, device=device)
        w2 = w2.mul_(shape.inter**-0.5).to(dtype)
        if "bf16" in formats:
            out["bf16"] = (w13, w2)
        if "fp8" in formats:
            out["fp8"] = quantised(w13, w2, ("fp8",))["fp8"]
    if "mxfp4" in formats:
        out["mxfp4"] = mxfp4_experts(shape, gen, device)
        if packed:
            w13, s13, w2, s2 = out["mxfp4"]
            out["mxfp4_packed"] = (repack_mxfp4_for_decode(w13), s13, repack_mxfp4_for_decode(w2), s2)
    return out


def calls(variant: Variant, weights: tuple, shape: Shape, x, ids, routing, tiles: dict[str, int]):
    """(the small-batch kernels with this decoder and tile, the reference op)."""
    if variant.fmt == "bf16":
        w13, w2 = weights
        return (lambda: moe._experts(x, ids, routing, w13, w2, LIMIT, moe.PLAIN, w13, w2, 1, shape.inter,
                                     tiles=tiles),
                lambda: reference.moe_experts(x, ids, routing, w13, w2, LIMIT))
    w13, s13, w2, s2 = weights
    if variant.fmt == "fp8":
        return (lambda: moe._experts(x, ids, routing, w13, w2, LIMIT, moe.FP8_BLOCK, s13, s2, 128, shape.inter,
                                     tiles=tiles),
                lambda: reference.moe_experts_fp8(x, ids, routing, w13, s13, w2, s2, LIMIT, 128))
    packed = variant.decode == mxfp4.MX_PACKED
    return (lambda: moe._experts(x, ids, routing, w13, w2, LIMIT, moe.MXFP4, s13, s2, 32, shape.inter,
                                 decode=variant.decode, tiles=tiles),
            lambda: reference.moe_experts_mxfp4(x, ids, routing, w13, s13, w2, s2, LIMIT, packed=packed))


@dataclass(frozen=True, slots=True)
class Batch:
    size: int
    x: torch.Tensor
    ids: torch.Tensor
    routing: torch.Tensor
    distinct: int


def batch(size: int, shape: Shape, gen: torch.Generator, device: str, dtype) -> Batch:
    x = torch.randn(size, shape.hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(size, shape.experts, generator=gen, device=device)
    ids, routing = reference.route(logits, None, TOP_K, scoring_func="sqrtsoftplus", normalize=True, scaling=1.5)
    return Batch(size, x, ids, routing, ids.unique().numel())


def runs(variant: Variant, b: Batch) -> bool:
    """bf16 above FUSED_MAX_PAIRS pairs takes cuBLAS's grouped GEMMs, not these kernels."""
    return not (variant.fmt == "bf16" and b.size * TOP_K > moe.FUSED_MAX_PAIRS)


def compile_all(jobs: list, threads: int) -> dict[tuple, str]:
    """Run each job (key, callable) once, `threads` at a time (Triton's compiler releases the GIL):
    every kernel is built before timing. Returns the keys that failed (too much shared memory for the
    tile, or any other error: reported, and the sweep goes on), with the error."""
    def one(job):
        key, fn = job
        try:
            fn()
            return key, None
        except Exception as err:            # one tile's failure must not end the run
            return key, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"

    with ThreadPoolExecutor(max(threads, 1)) as pool:
        failed = {key: err for key, err in pool.map(one, jobs) if err is not None}
    for (variant, *tile), err in failed.items():
        print(f"skipped {variant.name} {'x'.join(map(str, tile[:2]))}w{tile[2]}s{tile[3]}: {err}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return failed


def time_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def sweep(shape: Shape, variants: list[Variant], batches: list[Batch], weights: dict[str, tuple],
          tiles: list[dict[str, int]], threads: int, smoke: bool) -> list[dict]:
    cases = [(v, b, t) for v in variants for b in batches for t in tiles if runs(v, b) and fits(v, t)]
    jobs = [((v, t["BLOCK_N"], t["BLOCK_K"], t["num_warps"], t["num_stages"]),
             lambda v=v, t=t: [calls(v, weights[v.weights], shape, b.x, b.ids, b.routing, t)[0]()
                               for b in batches if runs(v, b)])
            for v in variants for t in tiles if fits(v, t)]
    failed = {}
    if not smoke:                 # the interpreter compiles nothing (and is not thread-safe)
        start = time.perf_counter()
        failed = compile_all(jobs, threads)
        print(f"compiled {len(jobs)} (variant, tile) pairs in {time.perf_counter() - start:.0f} s; "
              f"{len(failed)} failed", flush=True)
    wants = {}
    rows = []
    for v, b, t in cases:
        if (v, t["BLOCK_N"], t["BLOCK_K"], t["num_warps"], t["num_stages"]) in failed:
            continue
        fused, ref = calls(v, weights[v.weights], shape, b.x, b.ids, b.routing, t)
        if (v.fmt, b.size) not in wants:
            wants[v.fmt, b.size] = ref().float()
        want = wants[v.fmt, b.size]
        start = time.perf_counter()
        got = fused()
        us = (time.perf_counter() - start) * 1e6 if smoke else time_us(fused)
        error = (got.float() - want).abs().max().item()
        stored = b.distinct * sum(w[0].numel() * w.element_size() for w in weights[v.fmt])
        rows.append({"batch": b.size, "format": v.fmt, "decode": None if v.decode is None else DECODE_NAMES[v.decode],
                     "distinct_experts": b.distinct, **t, "us": us, "weight_GBps": stored / us / 1e3,
                     "max_error": error, "max_rel_error": error / max(want.abs().max().item(), 1e-30)})
    return rows


def summary(rows: list[dict]) -> list[str]:
    """The best tile per (batch, format / decoder), one line each; MXFP4 decoders with their speed-up
    over dot_scaled's best at that batch."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["batch"], r["format"], r["decode"] or "")
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    lines = [f"{'batch':>5}  {'format/decoder':<18} {'tile':<13} {'us':>9} {'GB/s':>7} {'rel err':>8} {'vs dot':>6}"]
    for (size, fmt, decode), r in sorted(best.items()):
        tile = f"{r['BLOCK_N']}x{r['BLOCK_K']}w{r['num_warps']}s{r['num_stages']}"
        name = f"{fmt}/{decode}" if decode else fmt
        base = best.get((size, "mxfp4", "dot_scaled"))
        ratio = f"{base['us'] / r['us']:>5.2f}x" if decode and base else ""
        lines.append(f"{size:>5}  {name:<18} {tile:<13} {r['us']:>9.1f} {r['weight_GBps']:>7.0f} "
                     f"{r['max_rel_error']:>8.1e} {ratio:>6}")
    return lines


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def decodes(text: str) -> list[int]:
    """"0,4" or "dot_scaled,asm" → decoder codes."""
    return [int(v) if v.isdigit() else mxfp4.DECODES[v] for v in text.split(",") if v]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="v4")
    ap.add_argument("--batches", default="1,8,32,256")
    ap.add_argument("--formats", default="bf16,fp8,mxfp4")
    ap.add_argument("--decodes", default=",".join(str(d) for d in sorted(mxfp4.DECODES.values())),
                    help="MXFP4 decoders, by number or name (triton_ops.mxfp4.DECODES)")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--block-k", default="128,256")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 16), help="compile threads")
    ap.add_argument("--out", default="moe_tile_sweep.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    shape = SMOKE if smoke else SHAPES[args.shape]
    formats = args.formats.split(",")
    chosen = decodes(args.decodes)
    if smoke:      # what the interpreter runs; one tile
        chosen = sorted({mxfp4.runnable_decode(d, torch.zeros(1)) for d in chosen})
        args.batches, args.block_n, args.block_k, args.warps, args.stages = "3", "32", "128", "4", "3"
    variants = [Variant(f, d) for f in formats for d in (chosen if f == "mxfp4" else [None])]
    gen = torch.Generator(device=device).manual_seed(0)
    weights = experts(shape, formats, gen, device, dtype, packed=mxfp4.MX_PACKED in chosen)
    batches = [batch(b, shape, gen, device, dtype) for b in ints(args.batches)]
    tiles = grid(ints(args.block_n), ints(args.block_k), ints(args.warps), ints(args.stages))
    rows = sweep(shape, variants, batches, weights, tiles, args.threads, smoke)
    with open(args.out, "w") as f:
        json.dump({"gpu": "cpu (Triton interpreter)" if smoke else torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__,
                   "shape": {"name": "smoke" if smoke else args.shape, "experts": shape.experts,
                             "hidden": shape.hidden, "inter": shape.inter, "top_k": TOP_K},
                   "shipped": {"mxfp4_decode": DECODE_NAMES[moe.MXFP4_DECODE],
                               "mxfp4_tiles": {DECODE_NAMES[d]: list(t) for d, t in moe.MXFP4_TILES.items()},
                               **{name: moe._tiles(fmt, 128) for name, fmt in
                                  (("bf16", moe.PLAIN), ("fp8", moe.FP8_BLOCK))}},
                   "rows": rows}, f, indent=1)
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
