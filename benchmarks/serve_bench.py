"""Serving benchmark (issue #20): `deepinfer serve` under a concurrency and a request-rate sweep, and
its overhead against the offline engine at 64 concurrent requests.

    .venv/bin/python benchmarks/serve_bench.py [--concurrency 1 8 64] [--request-rates 4 16]
        [--input-len 64] [--output-len 64] [--threads 1] [--base-url URL] [--output-json FILE]

Without --base-url it starts `deepinfer serve` (the embedded model unless --model) in a child
process, then runs --repeats pairs at --overhead-concurrency: the offline engine
(`deepinfer.engine.bench.run_bench`: an `LLMEngine` stepped in this process, no HTTP; the server
idle meanwhile) and the server over HTTP, alternately; then the sweep on the server alone.
Every request is the same kind as bench's: random token ids (seeded; the same prompts for the
offline run and every server point), greedy, EOS ignored, exactly --output-len tokens, streamed
(`stream_options.include_usage`).

Per point: request and output-token throughput, and p50 / p90 / p99 of
  TTFT  first streamed chunk - the request's start (its arrival, or when a concurrency slot freed);
  TPOT  (last chunk - first chunk) / (completion_tokens - 1), per request;
  ITL   gaps between consecutive chunks of a request (a chunk holds the tokens of one engine step
        unless the client lagged; `tokens_per_chunk` says how often that happened).
Server overhead = 1 - server output tok/s / offline output tok/s of a pair (median over pairs), and
the CPU overhead = the server's CPU time per output token (all threads of the server process and of
the processes below it: the engine process, by default; `api_cpu_ms_per_token` and
`engine_cpu_ms_per_token` split it) / the offline run's CPU time per output token - 1, which other
load on a shared machine disturbs far less than wall-clock throughput; the engine CPU overhead
compares the engine process alone with the offline run (where the engine's host time bounds a
step, as on a GPU, this is what the server adds to it; with --engine-in-thread the server process
is the engine's and the two overheads are one). The
client runs on the same machine as the server, in this process or, with --client-processes P > 1 (the
default from 16 CPUs on), in P processes that share each point's requests round-robin: one asyncio
client needs ~0.25 ms of CPU per streamed token, so alone it caps what it can measure near 4,000
tokens/s. On a small CPU the client competes with the server for cores (--threads sets the torch
threads of both engines, OMP_NUM_THREADS of the child).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import torch

from deepinfer.engine import EngineArgs, LLMEngine
from deepinfer.engine.bench import BenchWorkload, run_bench

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Trace:
    """One streamed request: its start, the arrival time of each chunk, and its completion tokens."""

    start: float
    chunk_times: tuple[float, ...]
    num_tokens: int


def _percentiles(name: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"p{p}_{name}_ms": None for p in PERCENTILES}
    values = np.percentile(np.asarray(seconds) * 1000.0, PERCENTILES)
    return {f"p{p}_{name}_ms": round(float(v), 2) for p, v in zip(PERCENTILES, values)}


def metrics(traces: list[Trace], elapsed: float) -> dict[str, Any]:
    """Throughput and TTFT / TPOT / ITL percentiles of the traces over `elapsed` seconds."""
    num_tokens = sum(t.num_tokens for t in traces)
    num_chunks = sum(len(t.chunk_times) for t in traces)
    result: dict[str, Any] = {
        "num_completed": len(traces), "elapsed_s": round(elapsed, 3),
        "request_throughput": round(len(traces) / elapsed, 2), "output_tokens_per_s": round(num_tokens / elapsed, 2),
        "tokens_per_chunk": round(num_tokens / num_chunks, 3),
    }
    result |= _percentiles("ttft", [t.chunk_times[0] - t.start for t in traces])
    result |= _percentiles("tpot", [(t.chunk_times[-1] - t.chunk_times[0]) / (t.num_tokens - 1)
                                    for t in traces if t.num_tokens > 1])
    result |= _percentiles("itl", [b - a for t in traces for a, b in zip(t.chunk_times, t.chunk_times[1:])])
    return result


async def stream_completion(http: httpx.AsyncClient, body: dict[str, Any], output_len: int) -> tuple[float, ...]:
    """POST `body` to /v1/completions as a stream (greedy, ignore_eos, usage asked for): the arrival
    time of each chunk that carries text; the usage must say `output_len` tokens were made."""
    body = {**body, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times: list[float] = []
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    assert usage is not None and usage["completion_tokens"] == output_len, usage
    return tuple(times)


async def _one(http: httpx.AsyncClient, prompt: list[int], output_len: int, start: float) -> Trace:
    return Trace(start, await stream_completion(http, {"prompt": prompt}, output_len), output_len)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3 on)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by process `pid` (all its threads), from /proc."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):     # the process exited meanwhile
                children.setdefault(int(_stat(int(entry))[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def server_cpu_s(pid: int, engine_pids: list[int]) -> tuple[float, float]:
    """(CPU seconds of the server process `pid`, of its engine processes `engine_pids`) so far."""
    return process_cpu_s(pid), sum(process_cpu_s(p) for p in engine_pids)


async def _drive(base_url: str, prompts: list[list[int]], starts: list[float], output_len: int,
                 max_concurrency: int) -> list[Trace]:
    """Stream `prompts`, each sent at its absolute `starts` time (time.perf_counter(): CLOCK_MONOTONIC,
    one clock for every process of the machine), at most `max_concurrency` at once."""
    slots = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as http:

        async def arrive(prompt: list[int], start: float) -> Trace:
            await asyncio.sleep(max(0.0, start - time.perf_counter()))
            arrival = time.perf_counter()
            async with slots:
                return await _one(http, prompt, output_len, max(arrival, time.perf_counter()))

        return list(await asyncio.gather(*(arrive(p, t) for p, t in zip(prompts, starts))))


def _client_process(job: tuple[str, list[list[int]], list[float], int, int]) -> tuple[list[Trace], float]:
    """One client process's share of a point: its traces and the CPU seconds it used."""
    cpu_before = time.process_time()
    traces = asyncio.run(_drive(*job))
    return traces, time.process_time() - cpu_before


async def run_point(base_url: str, prompts: list[list[int]], output_len: int, *, request_rate: float,
                    max_concurrency: int | None, seed: int, server_pid: int | None = None,
                    clients: ProcessPoolExecutor | None = None, num_clients: int = 1) -> dict[str, Any]:
    """Send every prompt (Poisson arrivals at request_rate, at most max_concurrency at once); the metrics,
    with the client's CPU milliseconds per output token, and the server's when its pid is known.
    With `clients` (a pool of `num_clients` processes) the prompts are dealt round-robin to that many
    client processes, each with its share of max_concurrency, so that the client's own per-chunk work
    (SSE parsing, JSON) does not cap a fast server's throughput."""
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for _ in prompts:
        offsets.append(at)
        at += 0.0 if math.isinf(request_rate) else rng.expovariate(request_rate)
    concurrency = max_concurrency or len(prompts)
    procs = max(1, min(num_clients if clients is not None else 1, concurrency, len(prompts)))
    engine_pids = descendants(server_pid) if server_pid is not None else []
    cpu_before = server_cpu_s(server_pid, engine_pids) if server_pid is not None else None
    t0 = time.perf_counter() + (0.2 if procs > 1 else 0.0)      # time for the client processes to get going
    starts = [t0 + o for o in offsets]
    if procs == 1:
        client_cpu_before = time.process_time()
        traces = await _drive(base_url, prompts, starts, output_len, concurrency)
        client_cpu_s = time.process_time() - client_cpu_before
    else:
        jobs = [(base_url, prompts[i::procs], starts[i::procs], output_len,
                 concurrency // procs + (i < concurrency % procs)) for i in range(procs)]
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(loop.run_in_executor(clients, _client_process, job) for job in jobs))
        traces = [t for part, _ in parts for t in part]
        client_cpu_s = sum(cpu for _, cpu in parts)
    elapsed = max(t.chunk_times[-1] for t in traces) - t0
    result = {"request_rate": "inf" if math.isinf(request_rate) else request_rate,
              "max_concurrency": max_concurrency, "client_processes": procs, **metrics(traces, elapsed)}
    num_tokens = sum(t.num_tokens for t in traces)
    result["client_cpu_ms_per_token"] = round(1000 * client_cpu_s / num_tokens, 4)
    if cpu_before is not None:
        api_s, engine_s = (after - before for after, before in zip(server_cpu_s(server_pid, engine_pids), cpu_before))
        result["cpu_ms_per_token"] = round(1000 * (api_s + engine_s) / num_tokens, 4)
        if engine_pids:               # else the engine steps in the server process: no split
            result["api_cpu_ms_per_token"] = round(1000 * api_s / num_tokens, 4)
        result["engine_cpu_ms_per_token"] = round(1000 * (engine_s if engine_pids else api_s) / num_tokens, 4)
    return result


def launch_serve(flags: list[str], threads: int, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """`deepinfer serve *flags` on a free port (OMP_NUM_THREADS=threads), waited for until /health
    answers 200: the process and its URL. Raises RuntimeError with the end of its stderr when it exits
    first, or when it is not up within timeout_s (it is killed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "deepinfer.engine.cli", "serve", "--port", str(port), "--log-level", "warning",
               *flags]
    log = tempfile.TemporaryFile()          # the server's stderr, shown if it does not come up
    child = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                             stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if child.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"deepinfer serve exited with {child.returncode}; its stderr ends:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return child, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            child.kill()
            raise RuntimeError(f"deepinfer serve did not come up in {timeout_s:.0f} s")
        time.sleep(0.2)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--seed", str(args.seed),
             "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.model:
        flags += ["--model", args.model]
    if args.engine_in_thread:
        flags += ["--engine-in-thread"]
    return launch_serve(flags, args.threads, timeout_s=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="bench this running server (no offline comparison)")
    parser.add_argument("--model", default=None, help="model folder or cached repo id [default: the embedded model]")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--request-rates", type=float, nargs="*", default=[4.0, 16.0])
    parser.add_argument("--overhead-concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="offline / server pairs at --overhead-concurrency, "
                        "run alternately so that a shared machine's noise hits both alike")
    parser.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per point = this x concurrency "
                        "(at least 8); rate points send 2 x overhead-concurrency")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                        help="each engine's share of the GPU (on CUDA the offline engine and the server share one)")
    parser.add_argument("--threads", type=int, default=1, help="torch / OMP threads of each engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-in-thread", action="store_true",
                        help="serve with the engine in a thread of the server's process (the old way) rather than "
                             "in an engine process of its own")
    parser.add_argument("--client-processes", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                        help="client processes sharing each point's requests [default: a quarter of the CPUs, "
                             "1 to 4]: one asyncio client spends ~0.25 ms of CPU per streamed token, which caps "
                             "what it can measure near 4,000 tokens/s")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.client_processes < 1:
        parser.error(f"--client-processes={args.client_processes} must be >= 1")
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                              "torch": torch.__version__, "args": vars(args)}
    num_overhead = args.prompts_per_slot * args.overhead_concurrency
    engine = LLMEngine(EngineArgs(model=args.model, max_num_seqs=args.max_num_seqs, seed=args.seed,
                                  gpu_memory_utilization=args.gpu_memory_utilization))
    vocab_size = engine.model.cfg.vocab_size

    def prompts(count: int) -> list[list[int]]:
        return BenchWorkload(count, args.input_len, args.output_len, args.seed).requests(vocab_size).prompts

    def point(count: int, request_rate: float, max_concurrency: int | None) -> dict[str, Any]:
        out = asyncio.run(run_point(url, prompts(count), args.output_len, request_rate=request_rate,
                                    max_concurrency=max_concurrency, seed=args.seed,
                                    server_pid=None if child is None else child.pid,
                                    clients=clients, num_clients=args.client_processes))
        print(json.dumps(out), flush=True)
        return out

    clients = None
    if args.client_processes > 1:     # started before the server and warmed, so no point pays for it
        clients = ProcessPoolExecutor(args.client_processes, mp_context=multiprocessing.get_context("spawn"))
        list(clients.map(abs, range(args.client_processes)))
    child, url = start_server(args) if args.base_url is None else (None, args.base_url)
    try:
        point(4, math.inf, 4)                                   # warm-up
        if child is not None:                                   # the offline engine only shares our machine
            pairs = []
            run_bench(engine, 8, args.input_len, args.output_len, args.seed)          # warm-up
            for _ in range(args.repeats):
                cpu_before = time.process_time()
                offline = run_bench(engine, num_overhead, args.input_len, args.output_len, args.seed,
                                    max_concurrency=args.overhead_concurrency)
                offline["cpu_ms_per_token"] = round(1000 * (time.process_time() - cpu_before)
                                                    / (num_overhead * args.output_len), 4)
                served = point(num_overhead, math.inf, args.overhead_concurrency)
                pairs.append({"offline": offline, "server": served,
                              "overhead": round(1 - served["output_tokens_per_s"] / offline["output_tokens_per_s"], 4),
                              "cpu_overhead": round(served["cpu_ms_per_token"] / offline["cpu_ms_per_token"] - 1, 4),
                              "engine_cpu_overhead": round(served["engine_cpu_ms_per_token"]
                                                           / offline["cpu_ms_per_token"] - 1, 4)})
            result["overhead"] = {"concurrency": args.overhead_concurrency,
                                  "median": statistics.median(p["overhead"] for p in pairs),
                                  "median_cpu": statistics.median(p["cpu_overhead"] for p in pairs),
                                  "median_engine_cpu": statistics.median(p["engine_cpu_overhead"] for p in pairs),
                                  "pairs": pairs}
        del engine
        result["server"] = [point(max(8, args.prompts_per_slot * c), math.inf, c) for c in args.concurrency]
        result["server"] += [point(num_overhead, rate, None) for rate in args.request_rates]
    finally:
        if clients is not None:
            clients.shutdown()
        if child is not None:
            child.terminate()
            child.wait(timeout=120)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
