"""Prefill of V4-Flash-shaped layers on one GPU: tokens/s, the FLOP and byte model per op class, the
time of one marked prompt per op class (CUDA events), MFU and bandwidth per class.

    source .device/activate.sh && source benchmarks/device_env.sh
    python3 benchmarks/prefill_gpu.py --layers 8 --out $OUT/prefill.json
    python3 benchmarks/prefill_gpu.py --layers 8 --dry-run          # the FLOP table only, no GPU

The model is `v4_decode_gpu.py`'s (real V4-Flash dimensions, seeded random weights, layers in its
repeating window-only, CSA, HCA, CSA pattern, one hash layer: the model of issue #22's 21.9k
tokens/s), or with `--schedule release` `v4_flash_dummy.py`'s cut of the released schedule. Per
expert dtype (`--expert-dtypes`, bf16 and FP8 block-scaled by default) and per case (`--cases`,
prompt:chunk — a one-shot 8K prompt, a 32K prompt in 8K and in 2K chunks by default): one warm-up
prompt (Triton compiles for the shapes), then `--repeats` prompts of fresh random tokens, the whole
prompt timed by CUDA events (chunks back to back, one sequence, one forward per chunk), the median
reported. The cases in `--attribute-cases` then run once more, separately, with a pair of CUDA
events around every hooked module forward and kernel-set op (`prefill_ranges.py`): each class gets
the exclusive stream time of its ranges, and the classes add up to the marked prompt's time, which
the event records make slightly longer than the unmarked median. FLOPs and floor bytes come from
`prefill_flops.py`; MFU = FLOPs / time / peak (the FP8 peak for FP8 experts), overall as the time at
peak over the time taken. Sections fail independently (an error is recorded, the rest runs); past
`--budget-s` the remaining sections are skipped. JSON to `--out` after every section.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import time
import traceback
from collections import defaultdict

# Before CUDA initialises: 8 bf16 layers leave ~20% of the card to activations (v4_decode_gpu.py).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
from prefill_flops import CLASSES, OpCost, chunked, prefill_costs
from prefill_ranges import CudaClock, OpClassTimer
from v4_decode_gpu import FLASH, copy_bandwidth, layer_schedule
from v4_flash_dummy import flash_config

from deepinfer.kernels import KernelSet
from deepinfer.model import DeepseekV4Config, ForwardBatch, ModelCache
from deepinfer.model.model import build_model

BLOCK_SIZE = 128
# Timed classes beyond the FLOP model's: the attention's time outside any op (row gathers, cache
# writes, casts), and what no range claims (prefill_ranges.py).
TIMED_CLASSES = (*CLASSES, "data_movement", "other")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--schedule", default="issue", choices=["issue", "release"],
                    help="issue: v4_decode_gpu.py's 0,4,128,4 pattern; release: the released schedule's first layers")
    ap.add_argument("--cases", default="8192:8192,32768:8192,32768:2048", help="prompt:chunk lengths")
    ap.add_argument("--expert-dtypes", default="bf16,fp8", help="routed experts: bf16, fp8, fp4")
    ap.add_argument("--attribute-cases", default="8192:8192", help="cases also run once with op-class ranges marked")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-bf16", type=float, default=790e12, help="FLOP/s, dense bf16")
    ap.add_argument("--peak-fp8", type=float, default=1580e12, help="FLOP/s, dense FP8")
    ap.add_argument("--peak-bw", type=float, default=4.3e12, help="bytes/s, device memory")
    ap.add_argument("--budget-s", type=float, default=180.0, help="skip sections that would start later")
    ap.add_argument("--no-grouped-fp8", dest="grouped_fp8", action="store_false",
                    help="ablation: FP8 experts through the small-batch kernels, not the grouped GEMMs "
                         "(triton_ops.moe.GROUPED_FP8, on in the engine)")
    ap.add_argument("--dry-run", action="store_true", help="print the FLOP and byte model only (no GPU)")
    ap.add_argument("--out", help="JSON report")
    return ap.parse_args()


def model_config(layers: int, schedule: str) -> DeepseekV4Config:
    """The benchmark's V4-Flash-shaped config of `layers` layers."""
    if schedule == "release":
        return DeepseekV4Config.from_dict(flash_config(layers))
    return DeepseekV4Config.from_dict(dict(FLASH, num_hidden_layers=layers, compress_ratios=layer_schedule(layers),
                                           num_hash_layers=1))


def parse_cases(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item]


def case_name(case: tuple[int, int]) -> str:
    prompt, chunk = case
    return f"{prompt // 1024}K" + ("" if chunk >= prompt else f"@{chunk // 1024}K")


def peaks(args: argparse.Namespace, expert_dtype: str | None) -> dict[str, float]:
    """FLOP/s peak of each class: bf16, except routed experts stored in FP8 (FP8 peak)."""
    out = dict.fromkeys(TIMED_CLASSES, args.peak_bf16)
    if expert_dtype == "fp8":
        out["moe_routed"] = args.peak_fp8
    return out


def class_rows(costs: dict[str, OpCost], seconds: dict[str, float], peak: dict[str, float], bw: float) -> dict:
    """Per class: FLOPs, floor bytes, floor time, and with a measured time the achieved rates."""
    rows = {}
    for name in TIMED_CLASSES:
        cost = costs.get(name, OpCost(0.0, 0.0))
        floor = max(cost.flops / peak[name], cost.bytes / bw)
        row = {"gflop": cost.flops / 1e9, "gbytes": cost.bytes / 1e9, "floor_ms": floor * 1e3,
               "bound": "compute" if cost.flops / peak[name] >= cost.bytes / bw else "memory"}
        t = seconds.get(name)
        if t:
            row.update(ms=t * 1e3, tflops=cost.flops / t / 1e12, mfu=cost.flops / t / peak[name],
                       gbps=cost.bytes / t / 1e9, bw_frac=cost.bytes / t / bw, over_floor=t / floor if floor else None)
        if cost.flops or cost.bytes or t:
            rows[name] = row
    return rows


def overall(costs: dict[str, OpCost], seconds: float, peak: dict[str, float], bw: float) -> dict:
    """Whole-prefill figures: MFU as (Σ class FLOPs / class peak) / time; floor = Σ class floors."""
    at_peak = sum(c.flops / peak[n] for n, c in costs.items())
    floor = sum(max(c.flops / peak[n], c.bytes / bw) for n, c in costs.items())
    return {"tflop": sum(c.flops for c in costs.values()) / 1e12, "mfu": at_peak / seconds,
            "floor_ms": floor * 1e3, "over_floor": seconds / floor}


def dry_run(args: argparse.Namespace, cfg: DeepseekV4Config) -> None:
    for dtype in args.expert_dtypes.split(","):
        expert_dtype = None if dtype == "bf16" else dtype
        peak = peaks(args, expert_dtype)
        for case in parse_cases(args.cases):
            costs = prefill_costs(cfg, chunked(*case), expert_dtype=expert_dtype)
            rows = class_rows(costs, {}, peak, args.peak_bw)
            total = overall(costs, 1.0, peak, args.peak_bw)
            print(f"\n{case_name(case)} {dtype} experts, {cfg.num_hidden_layers} layers {list(cfg.compress_ratios)}: "
                  f"{total['tflop']:.2f} TFLOP, floor {total['floor_ms']:.1f} ms "
                  f"({case[0] / total['floor_ms'] * 1e3:,.0f} tokens/s at the floor)")
            print(f"{'class':<12}{'GFLOP':>10}{'GB':>9}{'floor ms':>10}  bound")
            for name, row in rows.items():
                print(f"{name:<12}{row['gflop']:10.1f}{row['gbytes']:9.2f}{row['floor_ms']:10.2f}  {row['bound']}")


def prompt_batches(cfg: DeepseekV4Config, case: tuple[int, int], table: list[int], seed: int) -> list[ForwardBatch]:
    """One prompt of random tokens as its chunks' batches (sequence in state slot 1)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (case[0],), generator=gen).tolist()
    return [ForwardBatch.build([ids[s:s + n]], [s], [table], [1], device="cuda") for s, n in chunked(*case)]


@torch.no_grad()
def run_prompt(model, cache: ModelCache, ops: KernelSet, batches: list[ForwardBatch]) -> tuple[float, list[float]]:
    """(seconds of the whole prompt, ms of each chunk) between CUDA events."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(batches) + 1)]
    events[0].record()
    for batch, stop in zip(batches, events[1:]):
        model(batch, cache, ops)
        stop.record()
    torch.cuda.synchronize()
    chunk_ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    return events[0].elapsed_time(events[-1]) / 1e3, chunk_ms


def time_case(model, cfg, ops, case, repeats: int) -> dict:
    blocks = -(-case[0] // BLOCK_SIZE)
    cache = ModelCache.allocate(model.cache_spec(BLOCK_SIZE), blocks + 1, 2, "cuda")
    table = list(range(1, blocks + 1))
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run_prompt(model, cache, ops, prompt_batches(cfg, case, table, seed=0))        # compiles for the shapes
    warm_s = time.perf_counter() - t0
    runs = [run_prompt(model, cache, ops, prompt_batches(cfg, case, table, seed=1 + i)) for i in range(repeats)]
    seconds = [s for s, _ in runs]
    median = statistics.median(seconds)
    chunk_ms = [round(statistics.median(ms), 2) for ms in zip(*(c for _, c in runs))]
    return {"prefill_s": median, "prefill_s_all": seconds, "tokens_per_s": case[0] / median, "warmup_s": warm_s,
            "chunk_ms": chunk_ms, "peak_memory_GB": torch.cuda.max_memory_allocated() / 1e9}


def attribute_case(model, cfg, base_ops, case) -> dict:
    """One more prompt of `case` with the op classes' ranges marked by CUDA events (prefill_ranges.py):
    the marked prompt's time and its seconds per class, summed over its chunks."""
    blocks = -(-case[0] // BLOCK_SIZE)
    cache = ModelCache.allocate(model.cache_spec(BLOCK_SIZE), blocks + 1, 2, "cuda")
    table = list(range(1, blocks + 1))
    run_prompt(model, cache, base_ops, prompt_batches(cfg, case, table, seed=0))   # stacked weights exist now
    timer = OpClassTimer(model, base_ops, CudaClock())
    try:
        with torch.no_grad():
            chunks = [timer.time(functools.partial(model, batch, cache))
                      for batch in prompt_batches(cfg, case, table, seed=99)]
    finally:
        timer.remove()
    class_s: dict[str, float] = defaultdict(float)
    for times in chunks:
        for name, seconds in times.class_s.items():
            class_s[name] += seconds
    return {"marked_s": sum(t.total_s for t in chunks), "num_ranges": sum(t.num_ranges for t in chunks),
            "class_s": dict(class_s)}


def measure_ceilings() -> dict:
    """Copy bandwidth and large-GEMM rates on this card (random data, median of 10 after 3)."""
    out = {"copy_Bps": copy_bandwidth()}
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out["gemm_bf16_flops"] = 2 * n**3 / _median_s(lambda: a @ b)
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device="cuda")
        out["gemm_fp8_flops"] = 2 * n**3 / _median_s(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except Exception as err:                     # report, keep going
        out["gemm_fp8_error"] = f"{type(err).__name__}: {err}"[:200]
    return out


def _median_s(fn) -> float:
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def guarded(report: dict, key: str, started: float, budget: float, fn) -> dict | None:
    """Run one section: its result or its error under report[key]; skipped past the budget."""
    if time.perf_counter() - started > budget:
        report[key] = {"skipped": "past --budget-s"}
        return None
    try:
        report[key] = fn()
        return report[key]
    except Exception as err:                     # e.g. out of memory at 32K: record, run the rest
        report[key] = {"error": f"{type(err).__name__}: {err}"[:300], "traceback": traceback.format_exc()[-1500:]}
        print(f"{key}: {report[key]['error']}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        return None


def main() -> None:
    args = parse_args()
    cfg = model_config(args.layers, args.schedule)
    if args.dry_run:
        dry_run(args, cfg)
        return
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device (--dry-run prints the FLOP model without one)")
    started = time.perf_counter()
    from deepinfer.kernels.triton_ops import moe
    moe.GROUPED_FP8 = args.grouped_fp8
    base_ops = KernelSet("cuda")
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "schedule": args.schedule,
                    "grouped_fp8": args.grouped_fp8,
                    "compress_ratios": list(cfg.compress_ratios), "peaks": {"bf16": args.peak_bf16,
                    "fp8": args.peak_fp8, "bw": args.peak_bw},
                    "reference_ops": sorted(n for n, s in base_ops.sources.items() if s == "reference")}
    guarded(report, "ceilings", started, args.budget_s, measure_ceilings)
    torch.cuda.empty_cache()
    print(json.dumps({k: v for k, v in report.items() if k != "reference_ops"}), flush=True)
    for dtype in args.expert_dtypes.split(","):
        expert_dtype = None if dtype == "bf16" else dtype
        peak = peaks(args, expert_dtype)

        def build(expert_dtype=expert_dtype):
            t0 = time.perf_counter()
            model = build_model(cfg, device="cuda", dtype=torch.bfloat16, expert_dtype=expert_dtype)
            model.init_weights(seed=0, std=0.02)
            torch.cuda.synchronize()
            return {"model": model.eval(), "build_s": time.perf_counter() - t0,
                    "weights_GB": torch.cuda.memory_allocated() / 1e9}

        built = guarded(report, f"{dtype}/build", started, args.budget_s, build)
        model = built.pop("model") if built else None
        for case in parse_cases(args.cases):
            key = f"{dtype}/{case_name(case)}"
            costs = prefill_costs(cfg, chunked(*case), expert_dtype=expert_dtype)
            if model is None:
                continue
            row = guarded(report, key, started, args.budget_s,
                          functools.partial(time_case, model, cfg, base_ops, case, args.repeats))
            if row and "prefill_s" in row:
                row.update(overall(costs, row["prefill_s"], peak, args.peak_bw))
                print(f"{key}: {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.3f}", flush=True)
            _write(report, args.out)
        for case in parse_cases(args.attribute_cases):
            key = f"{dtype}/{case_name(case)}/classes"
            if model is None:
                continue
            marked = guarded(report, key, started, args.budget_s,
                             functools.partial(attribute_case, model, cfg, base_ops, case))
            if marked and "class_s" in marked:
                costs = prefill_costs(cfg, chunked(*case), expert_dtype=expert_dtype)
                marked["classes"] = class_rows(costs, marked.pop("class_s"), peak, args.peak_bw)
            _write(report, args.out)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    report["runtime_s"] = time.perf_counter() - started
    _write(report, args.out)
    print_tables(report)


def _write(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)


def print_tables(report: dict) -> None:
    """The cases, then each marked prompt's classes (the figures the docs take)."""
    ceilings = report.get("ceilings", {})
    if "copy_Bps" in ceilings:
        print(f"\nceilings: copy {ceilings['copy_Bps'] / 1e12:.2f} TB/s, bf16 GEMM "
              f"{ceilings['gemm_bf16_flops'] / 1e12:.0f} TFLOP/s, FP8 GEMM "
              f"{ceilings.get('gemm_fp8_flops', float('nan')) / 1e12:.0f} TFLOP/s")
    print(f"\n{'case':<16}{'tokens/s':>10}{'s':>8}{'TFLOP':>8}{'MFU':>7}{'floor ms':>10}{'x floor':>8}{'peak GB':>8}")
    for key, row in report.items():
        if key.count("/") == 1 and isinstance(row, dict) and not key.endswith("/build"):
            if "prefill_s" in row:
                print(f"{key:<16}{row['tokens_per_s']:10,.0f}{row['prefill_s']:8.3f}{row['tflop']:8.1f}{row['mfu']:7.3f}"
                      f"{row['floor_ms']:10.1f}{row['over_floor']:8.2f}{row['peak_memory_GB']:8.1f}")
            else:
                print(f"{key:<16}{row.get('error', row.get('skipped', ''))[:60]}")
    for key, marked in report.items():
        if not key.endswith("/classes") or not isinstance(marked, dict):
            continue
        if "classes" not in marked:
            print(f"\n{key}: {marked.get('error', marked.get('skipped', ''))[:80]}")
            continue
        unmarked = report.get(key.removesuffix("/classes"), {}).get("prefill_s")
        slower = f" ({marked['marked_s'] / unmarked - 1:+.1%} against the unmarked median)" if unmarked else ""
        print(f"\n{key}: marked prompt {marked['marked_s'] * 1e3:.1f} ms{slower}, {marked['num_ranges']} ranges; "
              f"classes sum to {sum(r.get('ms', 0.0) for r in marked['classes'].values()):.1f} ms")
        print(f"{'class':<14}{'ms':>8}{'share':>7}{'GFLOP':>9}{'TFLOP/s':>9}{'MFU':>7}{'GB/s':>8}{'BW':>6}"
              f"{'x floor':>8}")
        for name, row in marked["classes"].items():
            if "ms" not in row:
                continue
            print(f"{name:<14}{row['ms']:8.2f}{row['ms'] / marked['marked_s'] / 1e3:7.1%}{row['gflop']:9.0f}"
                  f"{row['tflops']:9.1f}{row['mfu']:7.3f}{row['gbps']:8.0f}{row['bw_frac']:6.2f}"
                  f"{row['over_floor'] or float('nan'):8.2f}")

if __name__ == "__main__":
    main()
