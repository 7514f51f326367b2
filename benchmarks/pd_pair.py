"""Prefill/decode pair vs one engine (issue #33): TTFT and TPOT of a mixed workload, served over HTTP.

    .venv/bin/python benchmarks/pd_pair.py [--device cuda] [--num-decode 8] [--decode-output-len 64] [--num-long 4]
        [--long-input-len 1536] [--long-interval-s 1.0] [--threads 1] [--output-json FILE]

Starts `deepinfer serve` (the embedded model unless --model) as one NORMAL server, then as a pair
(`--pd-role prefill` + `--pd-role decode --pd-prefill-url`), each in child processes, and sends the
same workload to each in turn (to the decode server for the pair):
  decode requests   --num-decode of them at t = 0: a short prompt (--decode-input-len) and
                    --decode-output-len tokens each (greedy, EOS ignored, streamed);
  long prompts      --num-long of them, one every --long-interval-s from t = 0.5 s: --long-input-len
                    tokens of prompt and --long-output-len of output.
The workload runs twice on each server and the second run is reported (the first warms it up). Per
class: p50 / p90 / mean of TTFT (first streamed chunk - the request's start) and TPOT ((last chunk
- first chunk) / (tokens - 1)). On one engine a long prompt's prefill steps stall every running
decode; on the pair the prefill runs in another process, and the decode side only imports its KV.
Each engine runs --threads torch threads (OMP_NUM_THREADS of its process), so the pair uses twice the
engine threads of one server: that is the deployment (each side sized for its work), not a like-for-
like core count. Prompts are seeded random token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from serve_bench import launch_serve, stream_completion


@dataclass(frozen=True, slots=True)
class Trace:
    """One streamed request: its class, start, the arrival time of each chunk and its tokens."""

    kind: str
    start: float
    chunk_times: tuple[float, ...]
    num_tokens: int


async def _one(http: httpx.AsyncClient, kind: str, prompt: list[int], output_len: int, delay: float,
               t0: float) -> Trace:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    start = time.perf_counter()
    times = await stream_completion(http, {"model": "m", "prompt": prompt}, output_len)
    return Trace(kind, start, times, output_len)


def _stats(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_p50_ms": None, f"{name}_p90_ms": None, f"{name}_mean_ms": None}
    ordered = sorted(v * 1000 for v in values)
    return {f"{name}_p50_ms": round(statistics.median(ordered), 1),
            f"{name}_p90_ms": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 1),
            f"{name}_mean_ms": round(statistics.fmean(ordered), 1)}


def summary(traces: list[Trace], elapsed: float) -> dict[str, Any]:
    result: dict[str, Any] = {"elapsed_s": round(elapsed, 2)}
    for kind in ("decode", "long"):
        mine = [t for t in traces if t.kind == kind]
        result[kind] = {"num_requests": len(mine)} | _stats("ttft", [t.chunk_times[0] - t.start for t in mine]) | \
            _stats("tpot", [(t.chunk_times[-1] - t.chunk_times[0]) / (t.num_tokens - 1) for t in mine
                            if t.num_tokens > 1])
    return result


async def run_workload(url: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    jobs = [("decode", [rng.randrange(3, vocab) for _ in range(args.decode_input_len)], args.decode_output_len, 0.0)
            for _ in range(args.num_decode)]
    jobs += [("long", [rng.randrange(3, vocab) for _ in range(args.long_input_len)], args.long_output_len,
              0.5 + i * args.long_interval_s) for i in range(args.num_long)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for _ in range(2):          # the first run warms up (batch shapes, allocator); the second is kept
            t0 = time.perf_counter()
            traces = await asyncio.gather(*(_one(http, kind, prompt, n, delay, t0)
                                            for kind, prompt, n, delay in jobs))
    return summary(list(traces), time.perf_counter() - t0)


def start(args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, str]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
             "--kv-cache-memory-mb", str(args.kv_cache_memory_mb), "--seed", str(args.seed),
             "--served-model-name", "m", *extra]
    if args.model:
        flags += ["--model", args.model]
    if args.device:
        flags += ["--device", args.device, "--dtype", args.dtype]
    return launch_serve(flags, args.threads, timeout_s=180)


def stop(*children: subprocess.Popen) -> None:
    for child in children:
        child.terminate()
    for child in children:
        child.wait(timeout=120)


def transfer_metrics(url: str) -> dict[str, float]:
    return {line.split()[0]: float(line.split()[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("deepinfer_kv_transfer")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--device", default=None, help="the engines' device (default: the server's, the CPU)")
    parser.add_argument("--dtype", default="bfloat16", help="the engines' dtype when --device is given")
    parser.add_argument("--num-decode", type=int, default=8)
    parser.add_argument("--decode-input-len", type=int, default=32)
    parser.add_argument("--decode-output-len", type=int, default=64)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--long-input-len", type=int, default=1536)
    parser.add_argument("--long-output-len", type=int, default=8)
    parser.add_argument("--long-interval-s", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine process")
    parser.add_argument("--vocab", type=int, default=4000, help="token ids are drawn from [3, vocab)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or ''}",
                              "torch": torch.__version__, "args": vars(args)}
    child, url = start(args, [])
    try:
        result["one_engine"] = asyncio.run(run_workload(url, args, args.vocab))
    finally:
        stop(child)
    prefill, prefill_url = start(args, ["--pd-role", "prefill"])
    try:
        decode, decode_url = start(args, ["--pd-role", "decode", "--pd-prefill-url", prefill_url])
        try:
            result["pair"] = asyncio.run(run_workload(decode_url, args, args.vocab))
            result["pair"]["kv_transfer_decode_side"] = transfer_metrics(decode_url)
            result["pair"]["kv_transfer_prefill_side"] = transfer_metrics(prefill_url)
        finally:
            stop(decode)
    finally:
        stop(prefill)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
