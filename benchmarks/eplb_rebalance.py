"""EPLB on Zipf-skewed synthetic loads: balance before/after and the cost of each step.

Shape of DeepSeek-V3/V4-style expert parallelism: 61 MoE layers x 256 experts, 64 GPUs on 8 nodes,
8 expert groups. Each layer gets its own random popularity ranking (p_i ~ 1 / rank^s); a 100-step
prefill window of 4096 tokens x top-8 is drawn as one multinomial sample per layer. Balance is
max / mean GPU load summed over layers (`overall_balance`), measured on the window the placement
was computed from ("fit") and on a fresh window from the same distribution ("fresh").

    .venv/bin/python benchmarks/eplb_rebalance.py            # prints a markdown report
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from deepinfer.eplb import (
    LoadRecorder,
    balance_ratio,
    num_redundant_experts,
    overall_balance,
    place_experts,
    plan_moves,
    rebalance_experts,
    round_robin_placement,
)

NUM_LAYERS, NUM_EXPERTS, NUM_GPUS, NUM_NODES, NUM_GROUPS = 61, 256, 64, 8, 8
TOKENS_PER_WINDOW = 100 * 4096 * 8


def zipf_windows(skew: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two independent windows [NUM_LAYERS, NUM_EXPERTS] of token counts from one distribution."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, NUM_EXPERTS + 1) ** skew
    probs = np.stack([weights[rng.permutation(NUM_EXPERTS)] for _ in range(NUM_LAYERS)])
    probs /= probs.sum(axis=1, keepdims=True)
    draw = lambda: np.stack([rng.multinomial(TOKENS_PER_WINDOW, p) for p in probs]).astype(np.float64)  # noqa: E731
    return draw(), draw()


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skews", type=float, nargs="+", default=[0.5, 1.0, 1.2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    redundant = num_redundant_experts(NUM_EXPERTS, NUM_GPUS, 4)  # the prefill floor
    slot_counts = (NUM_EXPERTS, NUM_EXPERTS + redundant, NUM_EXPERTS + 2 * redundant)
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    print(f"{NUM_LAYERS} layers x {NUM_EXPERTS} experts, {NUM_GPUS} GPUs / {NUM_NODES} nodes, "
          f"{NUM_GROUPS} groups, {TOKENS_PER_WINDOW} routed tokens per layer per window\n")
    print("| Zipf s | placement | slots | balance fit | balance fresh | worst layer (fresh) |")
    print("|---|---|---|---|---|---|")
    for index, skew in enumerate(args.skews):
        fit, fresh = zipf_windows(skew, args.seed + index)
        before = round_robin_placement(NUM_LAYERS, NUM_EXPERTS, NUM_EXPERTS, NUM_GPUS, NUM_NODES)
        rows = [("contiguous (before)", NUM_EXPERTS, before)]
        for slots in slot_counts:
            for policy in ("hierarchical", "global"):
                placement = place_experts(
                    fit, slots, num_gpus=NUM_GPUS, num_nodes=NUM_NODES, num_expert_groups=NUM_GROUPS,
                    policy=policy,
                )
                rows.append((f"EPLB {policy}", slots, placement))
        for name, slots, placement in rows:
            print(
                f"| {skew} | {name} | {slots} | {overall_balance(placement, fit):.3f} | "
                f"{overall_balance(placement, fresh):.3f} | {balance_ratio(placement, fresh).max():.3f} |"
            )

    fit, fresh = zipf_windows(1.0, args.seed)
    slots = NUM_EXPERTS + redundant
    print(f"\nTimings at Zipf s=1.0, {slots} slots, median of {args.repeats} runs:\n")
    print("| operation | median ms |")
    print("|---|---|")
    timings = {
        "rebalance_experts, hierarchical (8 groups, 8 nodes)": lambda: rebalance_experts(
            fit, slots, NUM_GROUPS, NUM_NODES, NUM_GPUS
        ),
        "rebalance_experts, global (1 group, 1 node)": lambda: rebalance_experts(fit, slots, 1, 1, NUM_GPUS),
        "place_experts, hierarchical (+ round-robin guard)": lambda: place_experts(
            fit, slots, num_gpus=NUM_GPUS, num_nodes=NUM_NODES, num_expert_groups=NUM_GROUPS
        ),
    }
    start = round_robin_placement(NUM_LAYERS, NUM_EXPERTS, slots, NUM_GPUS, NUM_NODES)
    target = place_experts(fit, slots, num_gpus=NUM_GPUS, num_nodes=NUM_NODES, policy="global")
    timings["plan_moves, round-robin -> global placement"] = lambda: plan_moves(start, target)
    recorder = LoadRecorder(NUM_LAYERS, NUM_EXPERTS, window_steps=1000)
    step = fit / 100
    timings["LoadRecorder.record, one step (window 1000)"] = lambda: recorder.record(step)
    for name, fn in timings.items():
        print(f"| {name} | {1000 * median_seconds(fn, args.repeats):.2f} |")
    print()
    next_target = place_experts(fresh, slots, num_gpus=NUM_GPUS, num_nodes=NUM_NODES, policy="global")
    for name, old, new in (
        ("round-robin -> global placement", start, target),
        ("global placement -> global placement of a fresh window (same distribution)", target, next_target),
    ):
        plan = plan_moves(old, new)
        print(f"plan_moves {name}: {plan.num_moves} of {NUM_LAYERS * slots} slots written, "
              f"{plan.num_remote} remote, {plan.num_local} local")


if __name__ == "__main__":
    main()
