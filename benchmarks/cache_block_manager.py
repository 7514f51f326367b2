"""Micro-benchmark: allocate/free throughput of the Cython BlockManager against its pure-Python twin.

    .venv/bin/python benchmarks/cache_block_manager.py [--iterations 20000] [--repeats 5]

Each workload is a tight loop of one allocate(n) then one free(ids) of those ids (plus pin/free for
the fork workload) on a pool of 4096 blocks; the best of `--repeats` timed runs is reported as
cycles per second. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

from deepinfer.cache._block_pool import BlockManager as CythonBlockManager
from deepinfer.cache._pure.block_pool import BlockManager as PureBlockManager

NUM_BLOCKS = 4096


def alloc_free(num: int) -> Callable[[object, int], None]:
    def run(manager, iterations: int) -> None:
        allocate, free = manager.allocate, manager.free
        for _ in range(iterations):
            free(allocate(num))

    return run


def fork_free(num: int) -> Callable[[object, int], None]:
    """allocate(num), pin the same ids (a fork), free both owners."""

    def run(manager, iterations: int) -> None:
        allocate, free, pin = manager.allocate, manager.free, manager.pin
        for _ in range(iterations):
            ids = allocate(num)
            pin(ids)
            free(ids)
            free(ids)

    return run


WORKLOADS = {
    "allocate 1 / free 1": alloc_free(1),
    "allocate 32 / free 32": alloc_free(32),
    "allocate 32 / pin 32 / free 32 x2": fork_free(32),
}


def cycles_per_second(impl: type, workload: Callable[[object, int], None], iterations: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        manager = impl(NUM_BLOCKS)
        workload(manager, iterations // 10)  # warm-up
        start = time.perf_counter()
        workload(manager, iterations)
        best = min(best, time.perf_counter() - start)
        manager.check_integrity()
        assert manager.num_free == NUM_BLOCKS - 1
    return iterations / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"python {platform.python_version()}, {platform.machine()}, pool of {NUM_BLOCKS} blocks, "
          f"{args.iterations} cycles, best of {args.repeats}\n")
    print("| workload | Cython cycles/s | pure-Python cycles/s | Cython / pure |")
    print("|---|---:|---:|---:|")
    for name, workload in WORKLOADS.items():
        fast = cycles_per_second(CythonBlockManager, workload, args.iterations, args.repeats)
        slow = cycles_per_second(PureBlockManager, workload, args.iterations, args.repeats)
        print(f"| {name} | {fast:,.0f} | {slow:,.0f} | {fast / slow:.1f}x |")


if __name__ == "__main__":
    main()
