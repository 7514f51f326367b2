"""Steady-state decode step through `LLMEngine` on a GPU, ZOS on and off, beside the kernels alone
(issue #17; run on purpose, on a CUDA machine).

    python3 benchmarks/engine_decode_gpu.py --model embedded --num-seqs 1 64 256 --out embedded.json
    python3 benchmarks/engine_decode_gpu.py --model v4-flash --layers 8 --num-seqs 1 32 256 --out flash.json

For each N, one engine (bf16, CUDA graphs up to N) is given N greedy requests (random-token prompts of
--prompt-len, EOS ignored) and stepped until all N decode. Then, with ZOS off and on in turn:

- step: the mean wall time of `engine.step()` over --steps consecutive decode steps (a device
  synchronisation before and after the window: under ZOS the steps overlap, so only the window's
  mean is a step time);
- gpu busy / idle: a torch.profiler trace of --profile-steps further steps: the union of the CUDA
  kernel and memcpy intervals per step, and the share of the trace's span with nothing running
  (the GPU waiting for the host);
- graph: the decode CUDA graph of the step's size replayed alone, back to back (CUDA events, median
  of 20 × 5 replays): the forward's kernel time without any host work; the step also samples.

--output-kind sets the timed requests' `OutputKind` (default cumulative, `step()`'s default).

With --bench, `run_bench` (the code behind `deepinfer bench`) then runs N requests of --bench-output
tokens at concurrency N on the same engine (ZOS on) and its TPOT and decode-step time are recorded.

--model embedded is the tiny model shipped with deepinfer-model; --model v4-flash builds a
V4-Flash-shaped model of --layers layers with random weights (`load_format="dummy"`, config from
benchmarks/v4_flash_dummy.py). --expert-dtype keeps its routed experts in bf16 (default), FP8
(e4m3, block-128 scales) or MXFP4 (`EngineArgs.expert_dtype`), as the released checkpoints do:

    python3 benchmarks/engine_decode_gpu.py --model v4-flash --layers 8 --expert-dtype fp4 --num-seqs 1 32 256

Results: a JSON list, one row per (N, zos).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from deepinfer.engine import LLMEngine, OutputKind, SamplingParams
from deepinfer.engine.bench import run_bench
from deepinfer.engine.config.engine_args import EngineArgs
from deepinfer.sched import StepKind


def model_args(name: str, layers: int, folder: Path) -> dict:
    if name == "embedded":
        return {"model": None}
    sys.path.insert(0, str(Path(__file__).parent))
    from v4_flash_dummy import flash_config

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(flash_config(layers)))
    return {"model": str(folder), "load_format": "dummy"}


def steady(engine: LLMEngine, num_seqs: int, step: Callable[[], object] | None = None,
           agree: Callable[[bool], bool] = bool) -> None:
    """Step until every request decodes, and a few decode steps more. `step` stands in for
    `engine.step` (a DP rank's step); `agree` turns this engine's "steady" into its group's, so that
    every rank stops at the same step."""
    step = step or engine.step
    decoding = 0
    for _ in range(100_000):
        step()
        all_in = engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == num_seqs
        decoding = decoding + 1 if all_in and engine.last_step_kind is StepKind.DECODE else 0
        if agree(decoding >= 5):
            return
    raise RuntimeError("never reached steady decode")


def synchronize(engine: LLMEngine) -> None:
    """Wait for the engine's device (nothing to wait for on CPU)."""
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def time_steps(engine: LLMEngine, steps: int, step: Callable[[], object] | None = None) -> float:
    """Mean seconds of `steps` decode steps (`step` stands in for `engine.step`, as in `steady`)."""
    step = step or engine.step
    synchronize(engine)
    start = time.perf_counter()
    for _ in range(steps):
        step()
        if engine.last_step_kind is not StepKind.DECODE:
            raise RuntimeError(f"a {engine.last_step_kind} step inside the timed window")
    synchronize(engine)
    return (time.perf_counter() - start) / steps


def profile_steps(engine: LLMEngine, steps: int) -> dict:
    """GPU busy time per step and the idle share of the trace span, from a profiler trace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not intervals:
        return {"gpu_busy_ms": None, "gpu_idle_share": None, "kernels_per_step": 0}
    busy, (run_start, run_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > run_end:
            busy += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    span = intervals[-1][1] - intervals[0][0]
    return {"gpu_busy_ms": round(busy / steps / 1e3, 4), "gpu_idle_share": round(1 - busy / span, 4),
            "kernels_per_step": round(len(intervals) / steps, 1)}


def graph_ms(engine: LLMEngine, num_seqs: int) -> float | None:
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    graph = graphs.graphs[graphs.bucket(num_seqs)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 5)
    return statistics.median(times)


def run(args: argparse.Namespace, num_seqs: int, folder: Path) -> list[dict]:
    # Decode steps the requests must last: 3 modes × (settle + timed + cProfile'd + profiled) + margin.
    total_steps = 3 * (5 + 2 * args.steps + args.profile_steps) + 50
    max_model_len = args.prompt_len + total_steps + 64
    block_size = 128
    blocks_per_seq = -(-max_model_len // block_size) + 2
    engine = LLMEngine(EngineArgs(
        **model_args(args.model, args.layers, folder), device="cuda", dtype="bfloat16", seed=0,
        expert_dtype=None if args.expert_dtype == "bf16" else args.expert_dtype,
        max_num_seqs=num_seqs, max_model_len=max_model_len, block_size=block_size,
        num_kv_blocks=blocks_per_seq * num_seqs * (2 if args.bench else 1) + 1,
        max_num_batched_tokens=args.max_batched_tokens, zero_overhead_scheduling=True,
    ))
    vocab = engine.model.cfg.vocab_size
    rng = np.random.default_rng(num_seqs)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=total_steps)
    for index in range(num_seqs):
        engine.add_request(f"r{index}", rng.integers(0, vocab, args.prompt_len).tolist(), params,
                           output_kind=OutputKind(args.output_kind))
    steady(engine, num_seqs)
    rows = []
    kernels = graph_ms(engine, num_seqs)
    modes = [(False, True), (True, True)] + ([(True, False)] if args.no_guard_too else [])
    for zos, guard in modes:
        engine.zos, engine.sampling.sync_guard = zos, guard
        for _ in range(5):       # settle into the mode
            engine.step()
        step = time_steps(engine, args.steps)
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.runcall(time_steps, engine, args.steps)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
            print(f"--- cProfile, {num_seqs} seqs, zos={zos}, guard={guard}, {args.steps} steps", flush=True)
            print("\n".join(line[:150] for line in text.getvalue().splitlines()[4:]), flush=True)
        row = {"model": args.model, "layers": args.layers if args.model != "embedded" else None,
               "expert_dtype": args.expert_dtype, "num_seqs": num_seqs, "zos": zos, "sync_guard": guard,
               "output_kind": args.output_kind,
               "step_ms": round(step * 1e3, 4),
               "graph_ms": None if kernels is None else round(kernels, 4),
               "step_over_graph": None if kernels is None else round(step * 1e3 / kernels, 3)}
        row.update(profile_steps(engine, args.profile_steps))
        if row["gpu_busy_ms"]:
            row["step_over_gpu_busy"] = round(row["step_ms"] / row["gpu_busy_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for rid in list(engine._requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    if args.bench:
        engine.zos = True
        result = run_bench(engine, num_seqs, args.prompt_len, args.bench_output, max_concurrency=num_seqs)
        bench = {"model": args.model, "num_seqs": num_seqs, "bench": True,
                 **{k: result[k] for k in ("output_tokens_per_s", "mean_tpot_ms", "p50_tpot_ms",
                                           "mean_decode_step_ms", "p50_decode_step_ms", "num_decode_steps",
                                           "mean_ttft_ms")}}
        rows.append(bench)
        print(json.dumps(bench), flush=True)
    del engine
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("embedded", "v4-flash"), default="embedded")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--expert-dtype", choices=("bf16", "fp8", "fp4"), default="bf16",
                        help="the routed experts as stored: bf16, FP8 block-scaled or MXFP4")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--bench-output", type=int, default=64)
    parser.add_argument("--output-kind", choices=[k.value for k in OutputKind], default="cumulative",
                        help="the timed requests' OutputKind (LLM.generate: final_only; a server: delta)")
    parser.add_argument("--no-guard-too", action="store_true", help="also time ZOS without the sync guard")
    parser.add_argument("--cprofile", type=int, default=0, help="print the top N host functions of each mode")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as temp:
        for num_seqs in args.num_seqs:
            rows += run(args, num_seqs, Path(temp) / "model")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
