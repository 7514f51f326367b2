"""Decode step time of a V4-Flash-shaped model on one GPU, against the memory roofline and
transformers' DeepseekV4ForCausalLM on the same GPU.

    python benchmarks/v4_decode_gpu.py --layers 4 --batches 1,8,32,128,256 --context 1024 \
        --hf-batches 1,32 --out results.json

The model has the real V4-Flash dimensions (hidden 4096, 64 heads × 512, q_lora 1024, 256 experts ×
2048, top-6, hc 4, window 128, CSA ratio 4 / HCA ratio 128) and random bf16 weights; `--layers`
of them in the repeating pattern window-only, CSA, HCA, CSA (4 layers = 1 sliding, 2 CSA, 1 HCA).
Decode runs at context `--context` with the cache filled with random values (the
step's work and bytes do not depend on them) — eager and CUDA-graph replay. The roofline of a step
is (weights touched + KV bytes read) / copy bandwidth measured in the same run; weights touched =
attention + mHC + shared expert of every layer + the expected number of distinct routed experts
for the batch (uniform routing: E·(1 − (1 − k/E)^B)) + the LM head. `--expert-dtype fp8|fp4` keeps
the routed experts in FP8 (block-128 scales) or MXFP4 (ours only; the roofline counts the bytes as
stored); `--mxfp4-decode NAME` picks the small-batch kernels' MXFP4 decoder (`triton_ops.mxfp4.DECODES`;
`packed` re-packs the experts' codes first, as the loader does with `moe.MXFP4_REPACK`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time

# With 8 bf16 V4-Flash layers the card is ~80% weights: without expandable segments the caching
# allocator fragments during an 8K prefill and retries (synchronising) on every miss — 6.7 s
# instead of 0.58 s measured on the H200. Must be set before CUDA initialises.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

from deepinfer.engine.core.cuda_graphs import DecodeGraphs
from deepinfer.kernels import kernels_for, reference
from deepinfer.kernels.triton_ops import moe, mxfp4
from deepinfer.model import DeepseekV4Config, ForwardBatch, ModelCache
from deepinfer.model.layers.moe import Experts
from deepinfer.model.model import build_model

FLASH = dict(
    vocab_size=129280, hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, n_routed_experts=256,
    num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048, hc_mult=4, hc_sinkhorn_iters=20,
    index_n_heads=64, index_head_dim=128, index_topk=512, rope_theta=10000, compress_rope_theta=160000,
    rope_scaling={"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 65536},
    max_position_embeddings=1048576, routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-6,
)


def layer_schedule(n: int) -> list[int]:
    """Compress ratios: window-only, CSA (4), HCA (128), CSA repeated — 1 : 2 : 1 like the 4-layer
    model of the issue's transformers figures (8 layers = 2 window-only, 4 CSA, 2 HCA)."""
    return [(0, 4, 128, 4)[i % 4] for i in range(n)]


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    del a, b
    return 2 * n * 2 / sorted(times)[len(times) // 2]


def roofline_bytes(model, cfg: DeepseekV4Config, batch: int, context: int) -> dict[str, float]:
    elem = 2
    experts = model.layers[0].ffn.experts                # bytes of one expert as stored (FP8: + its scales)
    expert = sum(getattr(experts, n)[0].numel() * getattr(experts, n).element_size()
                 for n in ("w13", "w2", "w13_scale", "w2_scale") if hasattr(experts, n))
    distinct = cfg.n_routed_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch)
    dense = 0
    for name, p in model.named_parameters():
        if ".ffn.experts." in name or name == "embed.weight":
            continue
        dense += p.numel() * p.element_size()
    kv = 0
    for kind, r in zip(cfg.attention_types, cfg.compress_ratios):
        kv += cfg.sliding_window * cfg.head_dim * elem
        if kind == "csa":
            visible = context // r
            kv += visible * cfg.index_head_dim * elem + min(cfg.index_topk, visible) * cfg.head_dim * elem
        elif kind == "hca":
            kv += (context // r) * cfg.head_dim * elem
    layers = cfg.num_hidden_layers
    routed = layers * distinct * expert
    return {"dense_weights": dense, "routed_weights": routed, "kv": batch * kv,
            "total": dense + routed + batch * kv, "distinct_experts_per_layer": distinct}


def time_steps(fn, steps: int) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


class DecodeFeed:
    """Decode batches of `num_seqs` sequences advancing from position `context`."""

    def __init__(self, cfg: DeepseekV4Config, num_seqs: int, context: int, tables: list[list[int]]) -> None:
        self.cfg, self.num_seqs, self.tables = cfg, num_seqs, tables
        self.positions = [context] * num_seqs
        self.gen = torch.Generator().manual_seed(num_seqs)

    def next(self) -> ForwardBatch:
        toks = torch.randint(0, self.cfg.vocab_size, (self.num_seqs,), generator=self.gen).tolist()
        batch = ForwardBatch.build([[t] for t in toks], self.positions, self.tables,
                                   list(range(1, self.num_seqs + 1)), device="cuda")
        self.positions = [p + 1 for p in self.positions]
        return batch


@torch.no_grad()
def bench_batch(model, cfg: DeepseekV4Config, b: int, context: int, steps: int, bandwidth: float) -> dict:
    block_size = 128
    max_context = context + 2 * steps + 8
    blocks_per_seq = math.ceil(max_context / block_size)
    cache = ModelCache.allocate(model.cache_spec(block_size), b * blocks_per_seq + 1, b + 1, "cuda")
    for t in list(cache.paged.values()) + list(cache.state.values()):
        t.normal_()
    feed = DecodeFeed(cfg, b, context, [[1 + i * blocks_per_seq + j for j in range(blocks_per_seq)] for i in range(b)])
    row: dict = {"batch": b}
    model(feed.next(), cache)
    torch.cuda.synchronize()
    row["eager_ms"] = time_steps(lambda: model(feed.next(), cache), max(3, steps // 4))
    try:
        t0 = time.perf_counter()
        graphs = DecodeGraphs(model, cache, max_seqs=b, max_blocks=blocks_per_seq, max_context_len=max_context,
                              interval=b)
        row["capture_s"] = round(time.perf_counter() - t0, 2)
        pending = iter([feed.next() for _ in range(steps)])
        row["graph_ms"] = time_steps(lambda: graphs.run(next(pending)), steps)
    except Exception as err:                      # report, keep going
        row["graph_error"] = f"{type(err).__name__}: {err}"[:300]
    step_ms = row.get("graph_ms", row["eager_ms"])
    need = roofline_bytes(model, cfg, b, context)
    row["roofline_ms"] = need["total"] / bandwidth * 1000
    row["step_over_roofline"] = step_ms / row["roofline_ms"]
    row["output_tokens_per_s"] = b / step_ms * 1000
    row["bytes"] = need
    return row


@torch.no_grad()
def profile_batch(model, cfg: DeepseekV4Config, b: int, context: int, steps: int = 3) -> dict:
    """Kernels per decode step and the ops that take the GPU time (torch.profiler, eager)."""
    from torch.profiler import ProfilerActivity, profile

    block_size = 128
    blocks_per_seq = math.ceil((context + steps + 8) / block_size)
    cache = ModelCache.allocate(model.cache_spec(block_size), b * blocks_per_seq + 1, b + 1, "cuda")
    feed = DecodeFeed(cfg, b, context, [[1 + i * blocks_per_seq + j for j in range(blocks_per_seq)] for i in range(b)])
    model(feed.next(), cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model(feed.next(), cache)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"] if hasattr(prof, "key_averages") else []
    kernels = sum(e.count for e in events)
    total_us = sum(e.self_device_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:15]
    return {
        "batch": b, "kernels_per_step": kernels / steps, "gpu_busy_ms_per_step": total_us / steps / 1000,
        "top_kernels": [{"name": e.key[:90], "calls_per_step": e.count / steps,
                         "ms_per_step": e.self_device_time_total / steps / 1000} for e in top],
    }


@torch.no_grad()
def bench_prefill(model, cfg: DeepseekV4Config, prompt_len: int) -> dict:
    """One prompt of prompt_len tokens in one eager forward, after a warm-up prompt of the same
    length (so Triton's kernels are compiled for the shapes' specialisations before the clock runs)."""
    block_size = 128
    blocks = math.ceil(prompt_len / block_size)
    cache = ModelCache.allocate(model.cache_spec(block_size), 2 * blocks + 1, 3, "cuda")
    gen = torch.Generator().manual_seed(prompt_len)
    tables = [list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))]
    warm = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    model(ForwardBatch.build([warm], [0], [tables[0]], [1], device="cuda"), cache)
    ids = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    batch = ForwardBatch.build([ids], [0], [tables[1]], [2], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model(batch, cache)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"prompt_len": prompt_len, "prefill_s": seconds, "prefill_tokens_per_s": prompt_len / seconds,
            "peak_memory_GB": torch.cuda.max_memory_allocated() / 1e9}


@torch.no_grad()
def bench_hf_prefill(model, vocab_size: int, prompt_len: int) -> dict:
    ids = torch.randint(0, vocab_size, (1, prompt_len), device="cuda")
    model(ids, use_cache=True)                 # warm-up at the same length, as ours
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model(ids, use_cache=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"prompt_len": prompt_len, "hf_prefill_s": seconds, "hf_prefill_tokens_per_s": prompt_len / seconds}


def bench_ours(cfg: DeepseekV4Config, batches: list[int], context: int, steps: int, bandwidth: float,
               profile_batches: list[int] | None = None, prefill_len: int = 0,
               expert_dtype: str | None = None, mxfp4_decode: str | None = None) -> list[dict]:
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, expert_dtype=expert_dtype)
    model.init_weights(seed=0, std=0.02)
    model.eval()
    if mxfp4_decode == "packed":
        for module in model.modules():
            if isinstance(module, Experts) and module.expert_dtype == "fp4":
                module.repack_for_decode_()
    elif mxfp4_decode:
        moe.MXFP4_DECODE = mxfp4.DECODES[mxfp4_decode]
    results = []
    for b in batches:
        try:
            row = bench_batch(model, cfg, b, context, steps, bandwidth)
        except Exception as err:                  # e.g. out of memory at a large batch
            row = {"batch": b, "error": f"{type(err).__name__}: {err}"[:300]}
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "bytes"}), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    if prefill_len:
        try:
            row = {"prefill": bench_prefill(model, cfg, prefill_len)}
        except Exception as err:
            row = {"prefill": {"error": f"{type(err).__name__}: {err}"[:300]}}
        results.append(row)
        print(json.dumps(row), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    for b in profile_batches or []:
        try:
            prof = profile_batch(model, cfg, b, context)
        except Exception as err:
            prof = {"batch": b, "error": f"{type(err).__name__}: {err}"[:300]}
        results.append({"profile": prof})
        print(json.dumps(prof)[:3000], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return results


@torch.no_grad()
def bench_hf(raw, batches, context, new_tokens, prefill_len: int = 0) -> list[dict]:
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM as HFModel

    hf_raw = {k: v for k, v in raw.items() if k not in ("compress_ratios", "rope_scaling")}
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    hf_raw["layer_types"] = [kinds[r] for r in raw["compress_ratios"]]
    hf_raw["rope_parameters"] = {"rope_type": "yarn", **{k: v for k, v in raw["rope_scaling"].items() if k != "type"}}
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = HFModel(HFConfig(**hf_raw)).eval()
    torch.set_default_dtype(torch.float32)
    results = []
    for b in batches:
        ids = torch.randint(0, raw["vocab_size"], (b, context), device="cuda")
        timings = []
        for n in (2, 1, 1 + new_tokens):       # the first call warms up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            timings.append(time.perf_counter() - t0)
        step_ms = (timings[2] - timings[1]) / new_tokens * 1000
        row = {"batch": b, "hf_step_ms": step_ms, "hf_output_tokens_per_s": b / step_ms * 1000}
        print(json.dumps(row), flush=True)
        results.append(row)
    if prefill_len:
        try:
            row = bench_hf_prefill(model, raw["vocab_size"], prefill_len)
        except Exception as err:                  # e.g. out of memory: keep the decode rows
            row = {"prompt_len": prefill_len, "hf_prefill_error": f"{type(err).__name__}: {err}"[:300]}
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--hf-batches", default="1,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-batches", default="", help="also profile eager decode at these batch sizes")
    ap.add_argument("--prefill-len", type=int, default=0, help="also time one prompt of this length (both engines)")
    ap.add_argument("--reference-ops", default="", help="ablation: run these ops with their reference twins")
    ap.add_argument("--expert-dtype", default=None, choices=["fp8", "fp4"], help="quantised routed experts (ours)")
    ap.add_argument("--mxfp4-decode", default=None, choices=sorted(mxfp4.DECODES),
                    help="the small-batch kernels' MXFP4 decoder (default: as shipped); packed re-packs the codes")
    ap.add_argument("--out", default="decode_results.json")
    args = ap.parse_args()
    ops = kernels_for("cuda")                     # the cached set every forward uses
    for name in [x for x in args.reference_ops.split(",") if x]:
        setattr(ops, name, getattr(reference, name))
        ops.sources[name] = "reference"
    raw = dict(FLASH, num_hidden_layers=args.layers, compress_ratios=layer_schedule(args.layers),
               num_hash_layers=1)
    cfg = DeepseekV4Config.from_dict(raw)
    bandwidth = copy_bandwidth()
    print(json.dumps({"copy_bandwidth_GBps": bandwidth / 1e9, "layers": cfg.compress_ratios}), flush=True)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": list(cfg.compress_ratios),
              "kernels": dict(ops.sources),
              "context": args.context, "copy_bandwidth_Bps": bandwidth,
              "ours": bench_ours(cfg, [int(x) for x in args.batches.split(",") if x], args.context, args.steps,
                                 bandwidth, [int(x) for x in args.profile_batches.split(",") if x], args.prefill_len,
                                 args.expert_dtype, args.mxfp4_decode),
              "mxfp4_decode": args.mxfp4_decode}
    if args.hf_batches or args.prefill_len:
        try:
            report["transformers"] = bench_hf(raw, [int(x) for x in args.hf_batches.split(",") if x], args.context, 8,
                                              args.prefill_len)
        except Exception as err:
            report["transformers_error"] = f"{type(err).__name__}: {err}"[:500]
            print(report["transformers_error"], flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
