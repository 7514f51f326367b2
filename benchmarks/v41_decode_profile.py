"""Where the GPU time of a DeepSeek-V4.1-Flash-shaped decode step goes: device time per kernel-set op
and per module, from one eager run of the static decode path (the path the CUDA graphs capture), and
per kernel name from graph replays.

    source .device/activate.sh && source benchmarks/device_env.sh
    python benchmarks/v41_decode_profile.py --layers 8 --batches 1,256 --context 4096 --out prof.json

The model and cache are `v41_decode_gpu.py`'s (V4.1-Flash dimensions, dummy weights, packed cache of
random rows). Each kernel-set op call and each sub-module forward runs inside a
`torch.profiler.record_function` range named `op.<name>` / `mod.<Class>`; a range's device time is the
sum of the kernels launched inside it (nested ranges counted in each). JSON to `--out`: per batch, the
graph step time, the eager static-path device total, the op and module tables, and the top kernels of
the graph replays.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--expert-dtype", default="fp4", choices=["fp4", "fp8", "bf16"])
    ap.add_argument("--engram-vocab", type=int, default=65536)
    ap.add_argument("--top", type=int, default=40, help="kernels kept per table")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def _bench_module():
    path = Path(__file__).with_name("v41_decode_gpu.py")
    spec = importlib.util.spec_from_file_location("v41_decode_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class AnnotatedOps:
    """A kernel set whose every op call runs inside a record_function range `op.<name>`."""

    def __init__(self, ops, torch) -> None:
        self._ops, self._torch = ops, torch
        self.device_type, self.batch_invariant, self.sources = ops.device_type, ops.batch_invariant, ops.sources

    def __getattr__(self, name: str):
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn
        rf = self._torch.profiler.record_function

        def wrapped(*args, **kwargs):
            with rf(f"op.{name}"):
                return fn(*args, **kwargs)
        return wrapped


def annotate_modules(model, torch) -> None:
    """Wrap every sub-module's forward in a record_function range `mod.<Class>`."""
    rf = torch.profiler.record_function
    for _, module in model.named_modules():
        if module is model:
            continue
        fwd = module.forward
        label = f"mod.{type(module).__name__}"

        def wrapped(*args, _fwd=fwd, _label=label, **kwargs):
            with rf(_label):
                return _fwd(*args, **kwargs)
        module.forward = wrapped


def _table(events, prefix: str, top: int) -> list[dict]:
    rows = [{"name": e.key, "device_ms": e.device_time_total / 1000, "calls": e.count}
            for e in events if e.key.startswith(prefix)]
    rows.sort(key=lambda r: -r["device_ms"])
    return rows[:top]


def _kernel_table(prof, top: int, steps: int) -> list[dict]:
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            t = totals.setdefault(e.name, [0.0, 0])
            t[0] += e.time_range.elapsed_us()
            t[1] += 1
    rows = [{"kernel": k[:120], "device_ms_per_step": v[0] / 1000 / steps, "launches_per_step": v[1] / steps}
            for k, v in totals.items()]
    rows.sort(key=lambda r: -r["device_ms_per_step"])
    return rows[:top]


def main() -> None:
    args = parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.engine.core.cuda_graphs import DecodeGraphs
    from deepinfer.kernels import kernels_for
    from deepinfer.model import DeepseekV41Config, ForwardBatch, ModelCache
    from deepinfer.model.dummy import dummy_model
    from deepinfer.model.layers.engram import table_rows

    bench = _bench_module()
    raw = bench.v41_config(args.layers, args.engram_vocab)
    raw["engram_num_embeddings"] = table_rows(DeepseekV41Config.from_dict({**raw, "engram_num_embeddings": [1, 1]}))
    cfg = DeepseekV41Config.from_dict(raw)
    model = dummy_model(cfg, dtype=torch.bfloat16, device="cuda",
                        expert_dtype=None if args.expert_dtype == "bf16" else args.expert_dtype)
    model.eval()
    ops = kernels_for("cuda")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
              "context": args.context, "runs": []}
    steps = 5
    for b in [int(x) for x in args.batches.split(",") if x]:
        block_size = 128
        max_context = args.context + 64
        blocks_per_seq = math.ceil(max_context / block_size)
        cache = ModelCache.allocate(model.cache_spec(block_size), b * blocks_per_seq + 1, b + 1, "cuda")
        bench._fill_cache(torch, model, cache)
        tables = [[1 + i * blocks_per_seq + j for j in range(blocks_per_seq)] for i in range(b)]
        gen = torch.Generator().manual_seed(b)
        tokens = torch.randint(3, cfg.vocab_size, (b,), generator=gen).tolist()
        batch = ForwardBatch.build([[t] for t in tokens], [args.context] * b, tables, list(range(1, b + 1)),
                                   device="cuda")
        with torch.no_grad():
            graphs = DecodeGraphs(model, cache, max_seqs=b, max_blocks=blocks_per_seq, max_context_len=max_context,
                                  interval=b, ops=ops)
            graphs.run(batch)
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graphs.run(batch)
            stop.record()
            torch.cuda.synchronize()
            graph_ms = start.elapsed_time(stop) / 10
            with profile(activities=[ProfilerActivity.CUDA]) as gprof:
                for _ in range(steps):
                    graphs.run(batch)
                torch.cuda.synchronize()
            static = graphs._batch(graphs.bucket(b))     # the captured path, run eagerly
            annotated = AnnotatedOps(ops, torch)
            model(static, cache, annotated)
            torch.cuda.synchronize()
            saved = {name: m.forward for name, m in model.named_modules() if m is not model}
            annotate_modules(model, torch)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as eprof:
                model(static, cache, annotated)
                torch.cuda.synchronize()
            for name, m in model.named_modules():
                if m is not model:
                    m.forward = saved[name]
            del graphs
        averages = eprof.key_averages()
        kernels_total = sum(e.self_device_time_total for e in averages) / 1000
        row = {"batch": b, "graph_ms": graph_ms, "eager_kernel_ms": kernels_total,
               "ops": _table(averages, "op.", args.top), "modules": _table(averages, "mod.", args.top),
               "graph_kernels": _kernel_table(gprof, args.top, steps)}
        report["runs"].append(row)
        print(f"== batch {b}: graph {graph_ms:.2f} ms, eager static-path kernels {kernels_total:.2f} ms")
        for r in row["ops"][:18]:
            print(f"  {r['name']:<28} {r['device_ms']:8.3f} ms  x{r['calls']}")
        for r in row["modules"][:12]:
            print(f"  {r['name']:<28} {r['device_ms']:8.3f} ms  x{r['calls']}")
        for r in row["graph_kernels"][:14]:
            print(f"  {r['device_ms_per_step']:8.3f} ms x{r['launches_per_step']:.0f} {r['kernel'][:90]}")
        del cache
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
