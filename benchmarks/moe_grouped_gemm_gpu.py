"""Routed-expert GEMMs of prefill on the GPU (issue #22 item 2): the grouped kernels of
`triton_ops.moe_grouped` against the previous kernels and cuBLAS's grouped GEMMs.

    python3 benchmarks/moe_grouped_gemm_gpu.py --out moe.json [--tokens 2048,8192] [--formats bf16,fp8,mxfp4]
    python3 benchmarks/moe_grouped_gemm_gpu.py --sweep --tokens 8192 --out moe_sweep.json

V4-Flash's routed experts (256 × width 2048, hidden 4096, top-6), random bf16 weights (FP8 block-128
and MXFP4 copies quantised from them), x of T random tokens routed by `reference.route` (sqrt-softplus,
normalised) over random logits plus a fixed per-expert offset, so the experts' loads differ as in a
real model (seed fixed). For each T and weight format, median times (`triton.testing.do_bench`, L2
flushed between calls) of:
- new: the registered op (`moe_experts*_fused`: the grouped kernels from `GROUPED_MIN_PAIRS` pairs),
  and its stages (FP8 quantisation of x, the tile plan, the up GEMM + SwiGLU, the down GEMM, the sum
  over each token's slots);
- old: what the op ran before — bf16: cuBLAS's grouped GEMMs with the gathers and scatters around
  them (`torch_ops.moe_experts_grouped`), FP8 / MXFP4: the small-batch expert kernels at any batch
  (`moe_experts_fp8_invariant` / `moe_experts_mxfp4_invariant`);
- torch: bf16 cuBLAS grouped GEMMs alone (`F.grouped_mm` on pre-gathered rows, no gather, SwiGLU or
  scatter): the library's GEMM rate on the same groups (for every format: a bf16 figure).
TFLOP/s count the useful FLOPs 6·T·k·hidden·width; the fraction is of 790 TFLOP/s (bf16, MXFP4 decoded
to bf16) or 1580 (FP8). Correctness: max |Δ| and ‖Δ‖ / ‖ref‖ of new against its PyTorch twin
(`reference.moe_experts`, `reference.moe.moe_experts_fp8_w8a8`, `reference.moe_experts_mxfp4`) and of
old against its own (FP8: `reference.moe_experts_fp8`, bf16 activations).
`--sweep` times the up and down GEMMs alone over a few tile shapes (`SWEEP`) instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
import torch.nn.functional as F

EXPERTS, HIDDEN, INTER, TOP_K, LIMIT = 256, 4096, 2048, 6, 10.0
PEAK = {"bf16": 790e12, "fp8": 1580e12, "mxfp4": 790e12}
DEVICE, DTYPE = "cuda", torch.bfloat16


def log(*args) -> None:
    print(*args, flush=True)


def bench(fn, rep: int = 100) -> float:
    if DEVICE == "cpu":                     # --cpu-smoke: one timed call
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_experts(formats: list[str]) -> dict[str, tuple]:
    """The experts in each asked format (bf16 always: the torch baseline): bf16 (w13, w2); FP8 block
    128 and MXFP4 (w13, w13_scale, w2, w2_scale), quantised expert by expert from the bf16 ones."""
    from deepinfer.kernels import reference

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=DEVICE).mul_(HIDDEN**-0.5).to(DTYPE)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=DEVICE).mul_(INTER**-0.5).to(DTYPE)
    out = {"bf16": (w13, w2)}
    quants = {"fp8": lambda w: reference.quant_fp8_block(w, 128), "mxfp4": reference.quant_mxfp4}
    for name in formats:
        if name in quants:
            parts = [[quants[name](w[e]) for e in range(EXPERTS)] for w in (w13, w2)]
            out[name] = tuple(torch.stack([p[i] for p in ps]) for ps in parts for i in (0, 1))
            sync()
            log(f"  {name} experts quantised")
    return out


def make_tokens(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from deepinfer.kernels import reference

    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen, device=DEVICE).to(DTYPE)
    popularity = torch.randn(EXPERTS, generator=torch.Generator(device=DEVICE).manual_seed(1), device=DEVICE) * 0.3
    logits = torch.randn(num_tokens, EXPERTS, generator=gen, device=DEVICE) + popularity
    ids, weights = reference.route(logits, None, TOP_K, scoring_func="sqrtsoftplus", normalize=True, scaling=1.5)
    return x, ids, weights


def ops(name: str, w: tuple):
    """(new op, old op, new's twin, old's twin) for a format, each (x, ids, weights) -> out."""
    from deepinfer.kernels import reference, torch_ops
    from deepinfer.kernels.reference.moe import moe_experts_fp8_w8a8
    from deepinfer.kernels.triton_ops import moe

    if name == "bf16":
        return (lambda x, i, r: moe.moe_experts_fused(x, i, r, *w, LIMIT),
                lambda x, i, r: torch_ops.moe_experts_grouped(x, i, r, *w, LIMIT),
                lambda x, i, r: reference.moe_experts(x, i, r, *w, LIMIT), None)
    if name == "fp8":
        return (lambda x, i, r: moe.moe_experts_fp8_fused(x, i, r, *w, LIMIT, 128),
                lambda x, i, r: moe.moe_experts_fp8_invariant(x, i, r, *w, LIMIT, 128),
                lambda x, i, r: moe_experts_fp8_w8a8(x, i, r, *w, LIMIT, 128),
                lambda x, i, r: reference.moe_experts_fp8(x, i, r, *w, LIMIT, 128))
    return (lambda x, i, r: moe.moe_experts_mxfp4_fused(x, i, r, *w, LIMIT),
            lambda x, i, r: moe.moe_experts_mxfp4_invariant(x, i, r, *w, LIMIT),
            lambda x, i, r: reference.moe_experts_mxfp4(x, i, r, *w, LIMIT), None)


def errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = got.float() - want.float()
    return {"max_abs": d.abs().max().item(), "rel": (d.norm() / want.float().norm()).item(),
            "nan": bool(torch.isnan(got).any())}


def weights_of(name: str, w: tuple):
    """(Weights of w13, Weights of w2, format code, block) for the grouped kernels."""
    from deepinfer.kernels.triton_ops import moe
    from deepinfer.kernels.triton_ops.moe_grouped import Weights

    if name == "bf16":
        return Weights(w[0], w[0], moe.PLAIN, 1), Weights(w[1], w[1], moe.PLAIN, 1), moe.PLAIN, 1
    fmt, block = (moe.FP8_BLOCK, 128) if name == "fp8" else (moe.MXFP4, 32)
    return Weights(w[0].view(torch.uint8) if name == "mxfp4" else w[0], w[1], fmt, block), Weights(
        w[2].view(torch.uint8) if name == "mxfp4" else w[2], w[3], fmt, block), fmt, block


def stage_times(name: str, w: tuple, x, ids, routing) -> dict:
    """Median ms of each stage of the grouped path, and the tiles' share of useful rows."""
    from deepinfer.kernels.triton_ops import moe_grouped as mg

    w13, w2, fmt, block = weights_of(name, w)
    tiles = mg.expert_tiles(fmt, HIDDEN, INTER, 128)
    up_plan, down_plan = mg.plans(ids, EXPERTS, tiles)
    xq, xs = mg.quant_groups(x, block) if name == "fp8" else (x, x)
    act, acts = mg.run_up(xq, xs, up_plan, w13, TOP_K, LIMIT, INTER, tiles.up)
    flat = routing.reshape(-1).float().contiguous()
    y = mg.run_down(act, acts, down_plan, flat, w2, HIDDEN, x.dtype, tiles.down)
    out = {"plan_ms": bench(lambda: mg.plans(ids, EXPERTS, tiles), rep=30),
           "up_ms": bench(lambda: mg.run_up(xq, xs, up_plan, w13, TOP_K, LIMIT, INTER, tiles.up)),
           "down_ms": bench(lambda: mg.run_down(act, acts, down_plan, flat, w2, HIDDEN, x.dtype, tiles.down)),
           "sum_ms": bench(lambda: mg.sum_slots(y, x.shape[0], TOP_K, x.dtype), rep=30),
           "tiles": {"up": vars_of(tiles.up), "down": vars_of(tiles.down)},
           "useful_rows": {"up": useful(up_plan, tiles.up), "down": useful(down_plan, tiles.down)}}
    if name == "fp8":
        out["quant_ms"] = bench(lambda: mg.quant_groups(x, block), rep=30)
    pairs = ids.numel()
    out["up_tflops"] = 2 * pairs * HIDDEN * 2 * INTER / out["up_ms"] / 1e9
    out["down_tflops"] = 2 * pairs * INTER * HIDDEN / out["down_ms"] / 1e9
    return out


def vars_of(t) -> dict:
    return {k: getattr(t, k) for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages", "half")}


def useful(plan, t) -> float:
    """Rows with a pair over rows the tiles' products compute (a half-height product: block_m / 2)."""
    rows = (plan.tiles[2] - plan.tiles[1]).long()
    half = t.half & (rows <= t.block_m // 2)
    computed = torch.where(rows > 0, torch.where(half, t.block_m // 2, t.block_m), 0).sum().item()
    return plan.order.numel() / max(computed, 1)


def run_case(num_tokens: int, name: str, w: tuple, torch_ms: float) -> dict:
    new, old, twin, old_twin = ops(name, w)
    x, ids, routing = make_tokens(num_tokens)
    flops = 6 * num_tokens * TOP_K * HIDDEN * INTER
    row = {"tokens": num_tokens, "format": name, "flops": flops, "torch_bf16_gemm_ms": torch_ms}
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS).float()
    row["expert_load"] = {"mean": counts.mean().item(), "max": counts.max().item(), "min": counts.min().item()}
    got = new(x, ids, routing)
    row["new_vs_twin"] = errors(got, twin(x, ids, routing))
    old_out = old(x, ids, routing)
    row["old_vs_twin"] = errors(old_out, (old_twin or twin)(x, ids, routing))
    del got, old_out
    row["new_ms"] = bench(lambda: new(x, ids, routing))
    row["old_ms"] = bench(lambda: old(x, ids, routing), rep=60)
    row.update(stage_times(name, w, x, ids, routing))
    for key in ("new", "old"):
        row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
        row[f"{key}_peak_frac"] = flops / row[f"{key}_ms"] / 1e-3 / PEAK[name]
    row["torch_bf16_gemm_tflops"] = flops / torch_ms / 1e9
    return row


def torch_gemms_ms(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor) -> float:
    """cuBLAS's two grouped GEMMs alone on rows already gathered and sorted (bf16)."""
    x, ids, _ = make_tokens(num_tokens)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0).to(torch.int32)
    rows = x[order // TOP_K]
    act = torch.randn(rows.shape[0], INTER, device=DEVICE).to(DTYPE)
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    return bench(lambda: (F.grouped_mm(rows, w13t, offs=offs), F.grouped_mm(act, w2t, offs=offs)))


# Tiles per GEMM and format: block_m, block_n (up: gate columns), block_k, warps, stages, half-height last tiles
SWEEP = {
    ("bf16", "up"): [(128, 128, 64, 8, 3, True), (128, 128, 64, 8, 4, True), (128, 128, 64, 8, 3, False),
                     (128, 64, 64, 4, 4, True), (64, 128, 64, 4, 4, False), (64, 256, 64, 8, 3, False),
                     (128, 128, 32, 8, 4, True)],
    ("bf16", "down"): [(128, 256, 64, 8, 3, True), (128, 256, 64, 8, 4, True), (128, 256, 64, 8, 3, False),
                       (128, 128, 64, 8, 4, True), (64, 256, 64, 4, 3, False), (64, 512, 64, 8, 3, False),
                       (128, 128, 64, 4, 4, True)],
    ("fp8", "up"): [(64, 128, 128, 8, 4, False), (64, 128, 128, 8, 3, False), (64, 128, 128, 4, 4, False),
                    (128, 128, 128, 8, 3, True)],
    ("fp8", "down"): [(128, 128, 128, 8, 4, True), (128, 128, 128, 8, 3, True), (128, 128, 128, 8, 4, False),
                      (64, 256, 128, 8, 3, False), (64, 128, 128, 4, 4, False), (128, 256, 128, 8, 3, True)],
    ("mxfp4", "up"): [(128, 64, 64, 8, 3, True), (128, 128, 64, 8, 3, True), (64, 128, 64, 4, 3, False)],
    ("mxfp4", "down"): [(128, 128, 64, 8, 3, True), (128, 256, 64, 8, 3, True)],
}


def sweep_case(num_tokens: int, name: str, w: tuple, deadline: float) -> list[dict]:
    from deepinfer.kernels.triton_ops import moe_grouped as mg

    w13, w2, _, block = weights_of(name, w)
    x, ids, routing = make_tokens(num_tokens)
    xq, xs = mg.quant_groups(x, block) if name == "fp8" else (x, x)
    flat = routing.reshape(-1).float().contiguous()
    pairs = ids.numel()
    base = mg.plan_tiles(ids, EXPERTS, 64)
    act, acts = mg.run_up(xq, xs, base, w13, TOP_K, LIMIT, INTER, mg.GemmTiles(64, 128, 128 if name == "fp8" else 64,
                                                                                   4, 3))      # the down GEMM's input
    rows = []
    for gemm in ("up", "down"):
        for shape in SWEEP[(name, gemm)]:
            if time.time() > deadline:
                log("  sweep: out of time budget, stopping")
                return rows
            t = mg.GemmTiles(*shape)
            plan = mg.plan_tiles(ids, EXPERTS, t.block_m)
            if gemm == "up":
                def fn(plan=plan, t=t):
                    return mg.run_up(xq, xs, plan, w13, TOP_K, LIMIT, INTER, t)
                flops = 2 * pairs * HIDDEN * 2 * INTER
            else:
                def fn(plan=plan, t=t):
                    return mg.run_down(act, acts, plan, flat, w2, HIDDEN, x.dtype, t)
                flops = 2 * pairs * INTER * HIDDEN
            row = {"tokens": num_tokens, "format": name, "gemm": gemm, "tiles": shape}
            try:
                fn()
                ms = bench(fn, rep=50)
                row.update(ms=ms, tflops=flops / ms / 1e9, peak_frac=flops / ms / 1e-3 / PEAK[name])
            except Exception as exc:                       # out of shared memory, compile failure
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            log(f"  sweep {name:5s} {gemm:4s} {shape}: " + (
                f"{row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s ({row['peak_frac']:.2f})" if "ms" in row
                else row["error"]))
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--formats", default="bf16,fp8,mxfp4")
    ap.add_argument("--sweep", action="store_true", help="time the up / down GEMMs over SWEEP's tiles instead")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop starting new cases after this many seconds")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny float32 shapes on the CPU under TRITON_INTERPRET=1 (checks this script, times nothing)")
    args = ap.parse_args()
    start = time.time()
    if args.cpu_smoke:
        global EXPERTS, HIDDEN, INTER, TOP_K, DEVICE, DTYPE
        EXPERTS, HIDDEN, INTER, TOP_K, DEVICE, DTYPE = 8, 256, 256, 2, "cpu", torch.float32
    elif not torch.cuda.is_available():
        log("error: needs a CUDA GPU (or --cpu-smoke under TRITON_INTERPRET=1)")
        return 2
    import triton

    from deepinfer.kernels.triton_ops import moe

    if args.cpu_smoke:
        moe.GROUPED_MIN_PAIRS = 1                 # the tiny batches take the grouped kernels too
    tokens = [int(t) for t in args.tokens.split(",") if t]
    formats = [f for f in args.formats.split(",") if f]
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke run)"
    log(f"{gpu}  torch {torch.__version__}  triton {triton.__version__}  GROUPED_MIN_PAIRS {moe.GROUPED_MIN_PAIRS}")
    weights = make_experts(formats)
    log(f"experts ready ({time.time() - start:.0f} s)")
    result = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
              "shape": {"experts": EXPERTS, "hidden": HIDDEN, "inter": INTER, "top_k": TOP_K},
              "peak_flops": PEAK, "rows": [], "sweep": [], "errors": []}
    deadline = start + args.budget_s
    for t in tokens:
        torch_ms = None if args.sweep else torch_gemms_ms(t, *weights["bf16"])
        for name in formats:
            if time.time() > deadline:
                result["errors"].append(f"T={t} {name}: skipped, past --budget-s")
                log(f"T={t} {name}: skipped (time budget)")
                continue
            log(f"T={t} {name} ...")
            try:
                if args.sweep:
                    result["sweep"] += sweep_case(t, name, weights[name], deadline)
                else:
                    row = run_case(t, name, weights[name], torch_ms)
                    result["rows"].append(row)
                    log(f"  new {row['new_ms']:.3f} ms ({row['new_peak_frac']:.2f} of peak)  old {row['old_ms']:.3f}"
                        f"  |Δ| {row['new_vs_twin']['max_abs']:.2e} rel {row['new_vs_twin']['rel']:.1e}")
            except Exception as exc:
                result["errors"].append(f"T={t} {name}: {type(exc).__name__}: {exc}")
                log(f"  FAILED: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    result["wall_s"] = time.time() - start
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if result["rows"]:
        log("\n   T format   new ms  TFLOP/s  peak   old ms  old pk  cuBLAS bf16 ms   up ms  down ms  useful"
            "  max|Δ|     rel")
        for r in result["rows"]:
            log(f"{r['tokens']:5d} {r['format']:6s} {r['new_ms']:7.3f} {r['new_tflops']:8.0f} {r['new_peak_frac']:5.2f}"
                f" {r['old_ms']:8.3f} {r['old_peak_frac']:6.2f} {r['torch_bf16_gemm_ms']:15.3f} {r['up_ms']:7.3f}"
                f" {r['down_ms']:8.3f} {r['useful_rows']['up']:7.2f} {r['new_vs_twin']['max_abs']:7.1e}"
                f" {r['new_vs_twin']['rel']:7.1e}")
    if result["sweep"]:
        log("\nbest per (T, format, GEMM):")
        keys = sorted({(r["tokens"], r["format"], r["gemm"]) for r in result["sweep"]})
        for key in keys:
            ok = [r for r in result["sweep"] if (r["tokens"], r["format"], r["gemm"]) == key and "ms" in r]
            if ok:
                b = min(ok, key=lambda r: r["ms"])
                log(f"  {key}: {b['tiles']}  {b['ms']:.3f} ms  {b['peak_frac']:.2f} of peak")
    log(f"wrote {args.out} ({result['wall_s']:.0f} s)" + (f"; {len(result['errors'])} errors" if result["errors"]
                                                           else ""))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
