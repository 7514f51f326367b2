"""Peak host memory of `load_model` on a synthetic multi-GB checkpoint (run on purpose).

    python benchmarks/load_memory.py --dir /tmp/deepinfer-load-memory            # write (once) and measure
    python benchmarks/load_memory.py --dir /tmp/deepinfer-load-memory --src /tmp/old/packages/deepinfer-model/src

A DeepSeek-V4 config (4 layers, hidden 2048, 32 routed experts of width 1536, vocab 64000) is
written as a bf16 checkpoint in the official layout — per-expert keys, several shards and an index —
one shard at a time, with random values, unless `--dir` already holds it. Then, in a fresh
subprocess per repeat, `load_model(dir, dtype=--dtype)` runs on CPU and the child reports:
VmHWM (peak resident set, anonymous + file-backed), the peaks of RssAnon and RssFile sampled every
5 ms, the RSS just before the load, the model's own bytes and the wall time. `--src` puts another
deepinfer-model source tree first on the child's path (e.g. the pre-streaming loader, extracted with
`git archive <commit> packages/deepinfer-model/src | tar -x -C /tmp/old`).

On a CPU target the model lives in host memory, so the number to read is the overhead:
peak RSS − RSS before the load − model bytes, against the largest tensor and the checkpoint size.
With `--device cuda` the model is on the GPU (its host bytes count as 0; the CUDA context is made
before the "before" reading).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CONFIG = {
    "model_type": "deepseek_v4", "vocab_size": 64000, "hidden_size": 2048, "num_hidden_layers": 4,
    "num_attention_heads": 16, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 4,
    "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": [0, 4, 128, 4], "index_n_heads": 16,
    "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 32, "num_experts_per_tok": 6,
    "n_shared_experts": 1, "moe_intermediate_size": 1536, "num_hash_layers": 1, "hc_mult": 4,
    "max_position_embeddings": 65536, "bos_token_id": 0, "eos_token_id": 1,
}
NUM_SHARDS = 6

CHILD = r"""
import json, os, sys, threading, time
if sys.argv[2]:
    sys.path.insert(0, sys.argv[2])
import torch
from deepinfer.model import load_model

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out

peaks = {"RssAnon": 0, "RssFile": 0}
done = threading.Event()
def sample():
    while not done.is_set():
        now = status()
        for key in peaks:
            peaks[key] = max(peaks[key], now[key])
        time.sleep(0.005)

torch.set_num_threads(1)
device = sys.argv[4]
if device.startswith("cuda"):
    torch.empty(1, device=device)           # the CUDA context's host memory is not the loader's
before = status()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
started = time.perf_counter()
model = load_model(sys.argv[1], dtype=getattr(torch, sys.argv[3]), device=device)
seconds = time.perf_counter() - started
done.set(); thread.join()
after = status()
model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.device.type == "cpu")
import deepinfer.model
print(json.dumps({"rss_before": before["VmRSS"], "anon_before": before["RssAnon"], "file_before": before["RssFile"],
                  "vm_hwm": after["VmHWM"], "peak_anon": peaks["RssAnon"], "peak_file": peaks["RssFile"],
                  "rss_after": after["VmRSS"], "file_after": after["RssFile"], "model_bytes": model_bytes,
                  "seconds": seconds, "loader": deepinfer.model.__file__}))
"""


def write_checkpoint(folder: Path, seed: int = 0) -> None:
    """Random bf16 tensors under official names, grouped into NUM_SHARDS files written one by one."""
    import torch
    from safetensors.torch import save_file

    from deepinfer.model import DeepseekV4Config, DeepseekV4ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=1))
    cfg = DeepseekV4Config.from_dict(CONFIG)
    with torch.device("meta"):
        shapes = {k: (tuple(t.shape), t.dtype) for k, t in DeepseekV4ForCausalLM(cfg).state_dict().items()}
    keys: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for key, (shape, dtype) in shapes.items():
        if key.endswith((".experts.w13", ".experts.w2")):
            prefix = key.rsplit(".", 1)[0]
            for e in range(shape[0]):
                if key.endswith("w13"):
                    half = (shape[1] // 2, shape[2])
                    keys += [(f"{prefix}.{e}.w1.weight", half, dtype), (f"{prefix}.{e}.w3.weight", half, dtype)]
                else:
                    keys.append((f"{prefix}.{e}.w2.weight", shape[1:], dtype))
        else:
            keys.append((key, shape, dtype))
    total = sum(_numel(s) * 2 for _, s, _ in keys)
    per_shard, shard, weight_map = total / NUM_SHARDS, [], {}
    gen = torch.Generator().manual_seed(seed)

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        tensors = {}
        for key, shape, dtype in shard:
            if dtype == torch.int64:
                tensors[key] = torch.randint(0, cfg.n_routed_experts, shape, generator=gen)
            else:
                tensors[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            weight_map[key] = name
        save_file(tensors, str(folder / name))
        shard.clear()

    size = 0
    for item in keys:
        shard.append(item)
        size += _numel(item[1]) * 2
        if size >= per_shard * (len(set(weight_map.values())) + 1):
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def checkpoint_facts(folder: Path) -> dict[str, float]:
    from safetensors import safe_open

    largest, total, count = 0, 0, 0
    files = sorted(folder.glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                nbytes = _numel(tuple(s.get_shape())) * {"BF16": 2, "F32": 4, "I64": 8}[s.get_dtype()]
                largest, total, count = max(largest, nbytes), total + nbytes, count + 1
    return {"checkpoint_bytes": total, "largest_tensor_bytes": largest, "num_tensors": count, "num_files": len(files)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/deepinfer-load-memory"))
    parser.add_argument("--src", default="", help="a deepinfer-model src folder to load with instead")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the model is then not in host memory")
    args = parser.parse_args()
    if not (args.dir / "model.safetensors.index.json").is_file():
        write_checkpoint(args.dir)
    facts = checkpoint_facts(args.dir)
    mib = 2**20
    print(f"checkpoint: {facts['checkpoint_bytes'] / mib:,.0f} MiB in {facts['num_files']} files, "
          f"{facts['num_tensors']} tensors, largest {facts['largest_tensor_bytes'] / mib:,.1f} MiB")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(args.repeats):
        run = subprocess.run([sys.executable, "-c", CHILD, str(args.dir), args.src, args.dtype, args.device],
                             capture_output=True, text=True, env=env, check=True)
        r = json.loads(run.stdout.strip().splitlines()[-1])
        overhead = r["vm_hwm"] - r["rss_before"] - r["model_bytes"]
        anon_overhead = r["peak_anon"] - r["anon_before"] - r["model_bytes"]
        print(json.dumps({**facts, **r, "overhead_bytes": overhead, "anon_overhead_bytes": anon_overhead}))
        print(f"  loader {r['loader']} ({args.dtype} on {args.device})\n  model in host memory "
              f"{r['model_bytes'] / mib:,.0f} MiB; RSS before "
              f"{r['rss_before'] / mib:,.0f} MiB; peak RSS (VmHWM) {r['vm_hwm'] / mib:,.0f} MiB -> overhead "
              f"{overhead / mib:,.0f} MiB "
              f"({overhead / facts['checkpoint_bytes']:.2f}x checkpoint, "
              f"{overhead / facts['largest_tensor_bytes']:.1f}x largest tensor); peak RssAnon overhead "
              f"{anon_overhead / mib:,.0f} MiB, peak RssFile {r['peak_file'] / mib:,.0f} MiB; {r['seconds']:.1f} s")


if __name__ == "__main__":
    main()
