"""Time `Scheduler.schedule()` per decode step with N running sequences (goal: < 100 us at 1024).

    .venv/bin/python benchmarks/sched_decode_step.py [--num-seqs 256 1024] [--steps 3000]

Setup: block_size 64, prompts of 64..2047 tokens (seeded), nextn 0, a single rank (trivial vote
group); after each decode step the engine's fast path `append_decode_tokens` records one token per
sequence (timed separately, as is the one-call-per-sequence `append_tokens`). The cache and the
slots are sized so nothing is preempted. The first 10% of the steps are dropped as warm-up.
Wall time and this thread's CPU time are both reported: on a shared machine the wall time also
counts the time other processes held the core.
Each configuration runs with Python's garbage collector on (default) and off: with it on, a
collection triggered by the engine-side allocations sometimes lands inside schedule().
"""

from __future__ import annotations

import argparse
import gc
import platform
import time

import numpy as np

from deepinfer.cache import BlockManager
from deepinfer.sched import Scheduler, SchedulerConfig, StepKind


def build(num_seqs: int, native: bool, seed: int = 0) -> Scheduler:
    config = SchedulerConfig(
        block_size=64, max_model_len=8192, max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20,
        max_num_prompts=num_seqs, prefill_attempt_interval=10**6, prefill_any_attempt_interval=10**6,
    )
    sched = Scheduler(config, BlockManager(num_seqs * 80 + 1), BlockManager.for_state_slots(num_seqs, 1.2),
                      native=native)
    rng = np.random.default_rng(seed)
    for index in range(num_seqs):
        sched.add_seq(f"req-{index}", rng.integers(0, 50000, rng.integers(64, 2048)).tolist(), 4096)
    num_prefilled = 0
    while num_prefilled < num_seqs:   # decode step 0 is an ANY point: prefill runs until done
        out = sched.schedule()
        assert out.kind is StepKind.PREFILL
        for chunk in out.prefill:
            if chunk.completes_prefill:
                sched.append_tokens(chunk.seq_id, [1])
                num_prefilled += 1
    return sched


def measure(num_seqs: int, steps: int, native: bool, collect_garbage: bool) -> dict[str, np.ndarray]:
    sched = build(num_seqs, native)
    times = {"schedule": [], "schedule_cpu": [], "append_decode_tokens": [], "append_tokens": []}
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    ones = np.ones(num_seqs, dtype=np.int32)
    if not collect_garbage:
        gc.disable()
    try:
        for step in range(steps):
            start, cpu_start = clock(), cpu_clock()
            out = sched.schedule()
            middle, cpu_end = clock(), cpu_clock()
            batch = out.decode
            assert out.kind is StepKind.DECODE and batch.num_seqs == num_seqs
            if step % 2:
                sched.append_decode_tokens(batch.seq_ids, np.full((num_seqs, 1), 7), ones)
                times["append_decode_tokens"].append((clock() - middle) / 1000)
            else:
                for seq_id in batch.seq_ids:
                    sched.append_tokens(seq_id, [7])
                times["append_tokens"].append((clock() - middle) / 1000)
            times["schedule"].append((middle - start) / 1000)
            times["schedule_cpu"].append((cpu_end - cpu_start) / 1000)
    finally:
        gc.enable()
    return {name: np.array(values[len(values) // 10:]) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    print(f"# {platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, "
          f"Python {platform.python_version()}, numpy {np.__version__}, {args.steps} steps each")
    print("| running seqs | decode core | GC | schedule() wall median us | wall p90 | wall mean "
          "| thread CPU median | CPU p90 | append_decode_tokens median us | append_tokens x N median us |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for num_seqs in args.num_seqs:
        for native in (True, False):
            for collect_garbage in (True, False):
                result = measure(num_seqs, args.steps, native, collect_garbage)
                schedule, cpu = result["schedule"], result["schedule_cpu"]
                print(f"| {num_seqs} | {'cython' if native else 'numpy twin'} | "
                      f"{'on' if collect_garbage else 'off'} | {np.median(schedule):.1f} | "
                      f"{np.percentile(schedule, 90):.1f} | {schedule.mean():.1f} | "
                      f"{np.median(cpu):.1f} | {np.percentile(cpu, 90):.1f} | "
                      f"{np.median(result['append_decode_tokens']):.0f} | "
                      f"{np.median(result['append_tokens']):.0f} |")


if __name__ == "__main__":
    main()
