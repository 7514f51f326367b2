"""Time `deepinfer.engine.sampling.sampler.Sampler` per step for several batch mixes (run on purpose).

    PYTHONPATH=packages/deepinfer-engine/src python benchmarks/engine_sampler.py --device cpu \
        --batch-sizes 1 8 32 --vocab-size 129280 --iters 10

Prints a markdown table: milliseconds per sampler call (median over iters, after warm-up), for the
whole call (logits already on the device; the SamplingBatch is built outside the timed region and
its build time is reported separately).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.engine.sampling.sampler import Sampler
from deepinfer.engine.sampling.sampling_batch import RequestRng, build_sampling_batch
from deepinfer.engine.sampling.sampling_params import SamplingParams

MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature only": lambda i: SamplingParams(temperature=0.8),
    "top-k 50 + top-p 0.9": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top-p 0.9 + min-p, 25% seeded": lambda i: SamplingParams(
        temperature=0.8, top_p=0.9, min_p=0.05, seed=i if i % 4 == 0 else None
    ),
    "all seeded + logprobs 5": lambda i: SamplingParams(temperature=0.8, top_p=0.9, seed=i, logprobs=5),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    sync(device)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vocab-size", type=int, default=129280)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--force-top-k", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    sampler = Sampler(seed=0, force_top_k=args.force_top_k)
    print(f"device={device} vocab_size={args.vocab_size} force_top_k={args.force_top_k} "
          f"torch={torch.__version__} threads={torch.get_num_threads()}")
    print("| mix | batch | sampler ms | batch build ms |")
    print("|---|---:|---:|---:|")
    for mix_name, make in MIXES.items():
        for batch_size in args.batch_sizes:
            params = [make(i) for i in range(batch_size)]
            rngs = [RequestRng.for_params(p, device) for p in params]
            logits = torch.randn(batch_size, args.vocab_size, device=device) * 4

            def build(params=params, rngs=rngs, batch_size=batch_size):
                return build_sampling_batch(params, rngs=rngs, num_output_tokens=[5] * batch_size,
                                            eos_token_ids=[1], vocab_size=args.vocab_size, device=device)

            batch = build()
            sample_ms = time_call(lambda batch=batch, logits=logits: sampler(logits, batch), device, args.iters)
            build_ms = time_call(build, device, args.iters)
            print(f"| {mix_name} | {batch_size} | {sample_ms:.3f} | {build_ms:.3f} |")


if __name__ == "__main__":
    main()
