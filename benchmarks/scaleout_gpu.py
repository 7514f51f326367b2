"""Decode over data-parallel ranks with the routed experts split by EP, beside one device holding half
the layers (issue #21; run on purpose, on a machine with --ranks GPUs).

    python3 benchmarks/scaleout_gpu.py --ranks 2 --layers 8 --batches 1,8,32,128,256 --output scaleout.json
    python3 benchmarks/scaleout_gpu.py --device cpu --shape tiny --layers 4 --batches 1,2 --steps 3 \\
        --prompt-len 8 --output smoke.json          # a function check over gloo, not a measurement

EP: --ranks processes (spawned here, rendezvous on a local port), each a `DPRank` of
`EngineArgs(data_parallel_size=ranks, expert_parallel=True)` on the dummy V4-Flash-shaped model of
--layers layers (`load_format="dummy"`, config from benchmarks/v4_flash_dummy.py; each rank keeps
its share of the routed experts, attention and shared experts whole). For each batch B (requests per
rank) every rank gets B greedy requests (random-token prompts of --prompt-len, EOS ignored), all
ranks step in lockstep until all decode (`engine_decode_gpu.steady`), then --steps decode steps are
timed (`engine_decode_gpu.time_steps`, device synchronised before and after the window):

- step_ms: the mean wall time of one decode step (the slowest rank's; every rank's in step_ms_by_rank);
- output_tokens_per_s: ranks × B tokens per step over step_ms (per rank: B over step_ms);
- all_to_all_ms: per step, the time inside the model's EP `all_to_all_single` calls (the
  fixed-capacity exchange of moe_ep_fixed, 3 per MoE layer: slot ids, rows, results), timed on each
  rank around each call: CUDA events on the current stream on GPUs, the host clock on CPU (gloo is
  blocking). It includes waiting for the slower peer. Reported for rank 0 and by rank.

On CUDA `DPRank` decodes EP ranks eagerly (no CUDA graphs; see deepinfer/engine/parallel/rank.py), ZOS on.
A dummy-format model loads whole on every rank before keeping its share of the experts: the peak is
the whole model's weights (benchmarks/v4_flash_dummy.py prints them per expert_dtype).
The fixed-capacity exchange moves max_num_seqs × top-k rows per peer whatever B holds: by default
max_num_seqs = B (the capacity a deployment sized for B would have); --max-num-seqs fixes it instead.

Baseline: one process, one device, an `LLMEngine` of --baseline-layers (default --layers / 2) layers,
the same batches and timing, with CUDA graphs and with enforce_eager (the EP ranks' mode).

Output (--output): {"setup": {...}, "ep": [row per B], "baseline": [row per (B, enforce_eager)]}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from engine_decode_gpu import steady, time_steps
from v4_flash_dummy import flash_config, tiny_flash_config

from deepinfer.engine import LLMEngine, OutputKind, SamplingParams
from deepinfer.engine.config.engine_args import EngineArgs
from deepinfer.engine.parallel import DPRank, RankSpec
from deepinfer.engine.parallel.launcher import free_port
from deepinfer.model.layers import moe_ep, moe_ep_fixed

SETTLE_STEPS = 64       # decode steps a request lasts beyond the timed ones (steady's ramp and margin)


class AllToAllTimer:
    """Stands in for `torch.distributed` inside moe_ep and moe_ep_fixed: their `all_to_all_single`
    calls are timed (CUDA events, or the host clock on CPU), every other name is torch's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.num_calls = 0
        self._cpu_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __getattr__(self, name: str):
        return getattr(dist, name)

    def all_to_all_single(self, *args, **kwargs):
        self.num_calls += 1
        if self.device.type != "cuda":
            start = time.perf_counter()
            result = dist.all_to_all_single(*args, **kwargs)
            self._cpu_s += time.perf_counter() - start
            return result
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(self.device)
        start.record(stream)
        result = dist.all_to_all_single(*args, **kwargs)
        end.record(stream)
        self._events.append((start, end))
        return result

    def reset(self) -> None:
        self.num_calls, self._cpu_s, self._events = 0, 0.0, []

    def total_ms(self) -> float:
        """Milliseconds inside the calls since `reset` (the device must have been synchronised)."""
        return self._cpu_s * 1e3 + sum(start.elapsed_time(end) for start, end in self._events)

    def install(self) -> None:
        moe_ep.dist = moe_ep_fixed.dist = self


def model_folder(shape: str, layers: int, folder: Path) -> str:
    """A folder with the config.json of the V4-Flash-shaped model (or its tiny-width twin)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = (flash_config if shape == "flash" else tiny_flash_config)(layers)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def engine_args(args: argparse.Namespace, model: str, batch: int, **extra) -> EngineArgs:
    max_num_seqs = args.max_num_seqs or batch
    max_model_len = args.prompt_len + args.steps + SETTLE_STEPS + 64
    blocks_per_seq = -(-max_model_len // args.block_size) + 2
    return EngineArgs(model=model, load_format="dummy", device=args.device, dtype=args.dtype, seed=0,
                      expert_dtype=args.expert_dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      block_size=args.block_size, num_kv_blocks=blocks_per_seq * max_num_seqs + 1,
                      max_num_batched_tokens=args.max_batched_tokens, zero_overhead_scheduling=True, **extra)


def add_requests(engine: LLMEngine, args: argparse.Namespace, batch: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.steps + SETTLE_STEPS)
    for index in range(batch):
        engine.add_request(f"r{index}", rng.integers(0, engine.model.cfg.vocab_size, args.prompt_len).tolist(),
                           params, output_kind=OutputKind.FINAL_ONLY)


def ep_batch(rank: int, args: argparse.Namespace, model: str, batch: int, port: int, timer: AllToAllTimer) -> dict:
    """One batch on one EP rank: a fresh `DPRank` (rendezvous on `port`), steady decode, the timed
    window; the row of every rank's figures (the same on every rank)."""
    dp = DPRank(engine_args(args, model, batch, data_parallel_size=args.ranks, expert_parallel=True,
                            distributed_timeout_s=args.timeout_s),
                RankSpec(rank, args.ranks, f"tcp://127.0.0.1:{port}"))
    engine, group = dp.engine, dp.vote_group.process_group
    add_requests(engine, args, batch, seed=1000 * rank + batch)
    steady(engine, batch, step=dp.step, agree=lambda done: not dp.vote_group.any_true(not done))
    dist.barrier(group=group)
    timer.reset()
    step_s = time_steps(engine, args.steps, step=dp.step)      # synchronised: the events are done
    mine = (step_s * 1e3, timer.total_ms() / args.steps, timer.num_calls / args.steps)
    every: list[tuple[float, float, float] | None] = [None] * args.ranks
    dist.all_gather_object(every, mine, group=group)
    dp.close()
    step_ms, max_num_seqs = max(r[0] for r in every), args.max_num_seqs or batch
    return {
        "batch_per_rank": batch, "ranks": args.ranks, "layers": args.layers, "max_num_seqs": max_num_seqs,
        "capacity_rows_per_peer": max_num_seqs * engine.model.cfg.num_experts_per_tok,
        "step_ms": round(step_ms, 4), "step_ms_by_rank": [round(r[0], 4) for r in every],
        "output_tokens_per_s": round(args.ranks * batch / step_ms * 1e3, 1),
        "output_tokens_per_s_per_rank": round(batch / step_ms * 1e3, 1),
        "all_to_all_ms": round(every[0][1], 4), "all_to_all_ms_by_rank": [round(r[1], 4) for r in every],
        "all_to_all_share": round(every[0][1] / every[0][0], 4), "all_to_all_calls_per_step": every[0][2]}


def release_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def ep_worker(rank: int, args: argparse.Namespace, model: str, ports: list[int], out_path: str) -> None:
    """One EP rank over every batch (each with its own rendezvous port); rank 0 writes the rows to
    `out_path`."""
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())     # the GPU DPRank gives this rank
        torch.cuda.set_device(device)      # as DPRank does, before anything touches the GPU
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    timer = AllToAllTimer(device)
    timer.install()
    rows = []
    for batch, port in zip(args.batches, ports):
        rows.append(ep_batch(rank, args, model, batch, port, timer))
        release_memory(args.device)
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


def run_ep(args: argparse.Namespace, model: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as temp:
        out_path = str(Path(temp) / "ep.json")
        ports = [free_port() for _ in args.batches]
        mp.start_processes(ep_worker, args=(args, model, ports, out_path), nprocs=args.ranks, start_method="spawn")
        return json.loads(Path(out_path).read_text())


def run_baseline(args: argparse.Namespace, model: str) -> list[dict]:
    rows = []
    for batch in args.batches:
        for eager in ((False, True) if args.device == "cuda" else (True,)):
            engine = LLMEngine(engine_args(args, model, batch, enforce_eager=eager))
            add_requests(engine, args, batch, seed=batch)
            steady(engine, batch)
            step_ms = time_steps(engine, args.steps) * 1e3
            rows.append({"batch": batch, "layers": args.baseline_layers, "enforce_eager": eager,
                         "step_ms": round(step_ms, 4), "output_tokens_per_s": round(batch / step_ms * 1e3, 1)})
            print(json.dumps(rows[-1]), flush=True)
            del engine
            release_memory(args.device)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="EP = DP ranks, one device each [default: 2]")
    parser.add_argument("--layers", type=int, default=8, help="layers of the EP model [default: 8]")
    parser.add_argument("--baseline-layers", type=int, help="layers of the one-device model [default: --layers / 2]")
    parser.add_argument("--batches", default="1,8,32,128,256", help="requests per rank, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch [default: 20]")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=("flash", "tiny"), default="flash",
                        help="V4-Flash widths, or tiny ones for CPU function checks [default: flash]")
    parser.add_argument("--dtype", help="[default: bfloat16 on cuda, float32 on cpu]")
    parser.add_argument("--expert-dtype", choices=("fp8", "fp4"), help="keep the routed experts quantised")
    parser.add_argument("--max-num-seqs", type=int, help="fixed for every batch [default: the batch]")
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="distributed_timeout_s of the ranks")
    parser.add_argument("--output", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.baseline_layers = args.baseline_layers or max(1, args.layers // 2)
    if args.ranks < 2:
        parser.error("argument --ranks: must be >= 2 (EP size = DP size)")
    if args.max_num_seqs is not None and args.max_num_seqs < max(args.batches):
        parser.error(f"argument --max-num-seqs: {args.max_num_seqs} < the largest batch {max(args.batches)}")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        parser.error(f"--ranks {args.ranks} needs {args.ranks} GPUs; {torch.cuda.device_count()} visible")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    setup = {"device": device_name, "num_devices": args.ranks, "torch": torch.__version__,
             "date": time.strftime("%Y-%m-%d"), "host_cpus": os.cpu_count(),
             **{key: value for key, value in vars(args).items() if key != "output"}}
    print(json.dumps(setup), flush=True)
    with tempfile.TemporaryDirectory() as temp:
        ep = run_ep(args, model_folder(args.shape, args.layers, Path(temp) / "ep"))
        result = {"setup": setup, "ep": ep, "baseline": []}
        args.output.write_text(json.dumps(result, indent=1))
        baseline_model = model_folder(args.shape, args.baseline_layers, Path(temp) / "baseline")
        result["baseline"] = run_baseline(args, baseline_model)
    args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
