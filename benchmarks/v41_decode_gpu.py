"""Decode step time of a DeepSeek-V4.1-Flash-shaped model on one GPU, against its memory roofline,
with the packed cache (MXFP8 window rows, FP4 compressed rows and index keys, read in place by the
V4.1 Triton kernels) and with a bf16 cache (plain rows, same kernels), at batches 1 to 256.

    source .device/activate.sh && source benchmarks/device_env.sh
    python benchmarks/v41_decode_gpu.py --layers 12 --batches 1,8,32,128,256 --context 4096 --out v41.json

The model has the real V4.1-Flash dimensions (hidden 5120, 64 heads × 512, q_lora 1280, 384 experts ×
2304 top-6 (MXFP4 by default, as released), hc 4, window 128, index 32 heads × 128, top-512, candidate
blocks 2048 × 8) and seeded dummy weights (`dummy_model`), `--layers` of them scheduled like the release
in miniature: layers 0, 1 window-only (1 with Engram), a ratio-2 half starting with its KV source (an
Engram layer too, as layer 14), a ratio-1 half starting with the ratio-1 KV source (the candidate
source) and, with 4 or more ratio-1 layers, a reindex layer. The Engram tables are trimmed
(`--engram-vocab`: prime buckets searched from there, not from 16M; a lookup reads the same 24 rows per
token and layer whatever the table size). The cache holds valid packed rows of random values.

Each batch: eager decode steps and CUDA-graph replays (deepinfer.engine.core.cuda_graphs.DecodeGraphs),
median of `--steps`. Roofline of a step = bytes it must read / the copy bandwidth measured in the same
run: dense weights (everything but the routed experts, the embedding and the Engram tables) + the
expected distinct routed experts of the batch (uniform routing: E·(1 − (1 − k/E)^B)) per layer, as
stored + the Engram rows looked up + per sequence: every layer's window rows, every layer with a ratio
its min(top-k, visible) compressed rows, every index source the visible index keys of its key source,
each at the cache format's bytes per row. JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="backbone layers (>= 8); ~7.5 GB each with FP4 experts")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--context", type=int, default=4096, help="tokens already cached per sequence")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--caches", default="packed,bf16", help="cache formats to run: packed, bf16")
    ap.add_argument("--expert-dtype", default="fp4", choices=["fp4", "fp8", "bf16"])
    ap.add_argument("--engram-vocab", type=int, default=65536, help="start of the Engram prime search (16M released)")
    ap.add_argument("--no-graphs", action="store_true", help="eager steps only")
    ap.add_argument("--mxfp4-decode", default=None,
                    help="the small-batch expert kernels' MXFP4 decoder (triton_ops.mxfp4.DECODES; default: shipped; "
                         "packed re-packs the experts' codes first)")
    ap.add_argument("--out", required=True, help="where the JSON report goes")
    return ap.parse_args()


def v41_config(num_layers: int, engram_vocab: int) -> dict:
    """A V4.1-Flash text config of `num_layers` layers (see the module docstring)."""
    if num_layers < 8:
        raise SystemExit(f"--layers {num_layers}: need at least 8 (window-only, two KV sources and their consumers)")
    half2 = (num_layers - 2) // 2
    half1 = num_layers - 2 - half2
    src2, src1 = 2, 2 + half2
    index = [src2, src1] + ([src1 + 2] if half1 >= 4 else [])
    return {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": num_layers,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024, "rms_norm_eps": 1e-20, "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "max_position_embeddings": 1048576, "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": 2304, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * half2 + [1] * half1 + [0, 0, 0],
        "kv_source_layer_ids": [src2, src1], "index_source_layer_ids": index, "index_n_heads": 32,
        "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": src1, "candidate_topk_blocks": 2048,
        "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, src2], "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_vocab_size": engram_vocab, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3, "bos_token_id": 0, "eos_token_id": 1, "dtype": "bfloat16",
    }


def main() -> None:
    args = parse_args()
    # Must be set before CUDA initialises (a large model fragments the caching allocator otherwise).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from deepinfer.kernels import kernels_for
    from deepinfer.model import DeepseekV41Config
    from deepinfer.model.dummy import dummy_model
    from deepinfer.model.layers.engram import table_rows
    from deepinfer.model.layers.moe import Experts

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    raw = v41_config(args.layers, args.engram_vocab)
    raw["engram_num_embeddings"] = table_rows(DeepseekV41Config.from_dict({**raw, "engram_num_embeddings": [1, 1]}))
    cfg = DeepseekV41Config.from_dict(raw)
    bandwidth = _copy_bandwidth(torch)
    print(json.dumps({"copy_bandwidth_GBps": bandwidth / 1e9, "compress_ratios": list(cfg.compress_ratios)}),
          flush=True)
    model = dummy_model(cfg, dtype=torch.bfloat16, device="cuda",
                        expert_dtype=None if args.expert_dtype == "bf16" else args.expert_dtype)
    model.eval()
    ops = kernels_for("cuda")
    from deepinfer.kernels.triton_ops import moe, mxfp4
    if args.mxfp4_decode == "packed":            # its own code layout: re-pack, as the loader does
        for module in model.modules():
            if isinstance(module, Experts) and module.expert_dtype == "fp4":
                module.repack_for_decode_()
    elif args.mxfp4_decode is not None:
        moe.MXFP4_DECODE = mxfp4.DECODES[args.mxfp4_decode]
    decoder = args.mxfp4_decode or next(k for k, v in mxfp4.DECODES.items() if v == moe.MXFP4_DECODE)
    report = {"mxfp4_decode": decoder, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "layers": args.layers,
              "compress_ratios": list(cfg.compress_ratios)[:args.layers], "context": args.context,
              "expert_dtype": args.expert_dtype, "engram_rows": list(cfg.engram_num_embeddings),
              "copy_bandwidth_Bps": bandwidth, "kernels": dict(ops.sources), "runs": []}
    packed_codecs = model.codecs
    for cache_format in [c for c in args.caches.split(",") if c]:
        model.codecs = packed_codecs if cache_format == "packed" else _plain_codecs(model, torch)
        for b in [int(x) for x in args.batches.split(",") if x]:
            try:
                row = _bench_batch(torch, model, cfg, b, args, bandwidth, ops)
            except Exception as err:                      # e.g. out of memory at a large batch: keep going
                row = {"batch": b, "error": f"{type(err).__name__}: {err}"[:400]}
            row = {"cache": cache_format, **row}
            report["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "bytes"}), flush=True)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{'cache':>7} {'batch':>5} {'eager ms':>9} {'graph ms':>9} {'roof ms':>8} {'x roof':>7} {'tok/s':>9}")
    for r in report["runs"]:
        if "error" in r:
            print(f"{r['cache']:>7} {r['batch']:>5} {r['error'][:60]}")
            continue
        print(f"{r['cache']:>7} {r['batch']:>5} {r['eager_ms']:9.2f} {r.get('graph_ms', float('nan')):9.2f} "
              f"{r['roofline_ms']:8.2f} {r['step_over_roofline']:7.2f} {r['output_tokens_per_s']:9.0f}")


def _copy_bandwidth(torch, gib: float = 4.0) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 10."""
    n = int(gib * 2**30) // 2
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    del a, b
    return 2 * n * 2 / sorted(times)[len(times) // 2]


def _plain_codecs(model, torch):
    """A `model.codecs` giving plain bf16 rows for every cache stream (the bf16-cache comparison: the
    same kernels read unquantised rows)."""
    from deepinfer.model.layers.csa2 import Codecs
    from deepinfer.model.layers.v41_codecs import RowCodec

    cfg = model.cfg

    def codecs(dtype=None, ops=None):
        kw = {} if ops is None else {"ops": ops}
        return Codecs(RowCodec("plain", cfg.head_dim, torch.bfloat16, **kw),
                      RowCodec("plain", cfg.head_dim, torch.bfloat16, **kw),
                      RowCodec("plain", cfg.index_head_dim, torch.bfloat16, **kw))
    return codecs


def _fill_cache(torch, model, cache) -> None:
    """Valid rows of random values in every stream and ring (never time on zeros or NaN codes)."""
    codecs = model.codecs()
    device = model.embed.weight.device
    gen = torch.Generator(device=device).manual_seed(0)
    for name, t in list(cache.paged.items()) + list(cache.state.items()):
        if t.dtype == torch.uint8:
            codec = codecs.window if name.endswith(".window") else codecs.index if name.endswith(".index_k") \
                else codecs.kv
            flat = t.view(-1, t.shape[-1])
            for lo in range(0, flat.shape[0], 1 << 16):
                hi = min(flat.shape[0], lo + (1 << 16))
                flat[lo:hi] = codec.encode(torch.randn(hi - lo, codec.dim, device=device, generator=gen))
        elif t.dtype == torch.int64:
            t.random_(0, model.cfg.engram_compressed_vocab_size, generator=gen)
        else:
            t.normal_(generator=gen)


def _roofline_bytes(torch, model, cfg, b: int, context: int) -> dict:
    codecs = model.codecs()

    def row_bytes(codec) -> int:
        return codec.row_dim * (1 if codec.fmt != "plain" else torch.empty(0, dtype=codec.dtype).element_size())

    layer0 = model.layers[0].ffn.experts
    expert = sum(getattr(layer0, n)[0].numel() * getattr(layer0, n).element_size()
                 for n in ("w13", "w2", "w13_scale", "w2_scale") if hasattr(layer0, n))
    distinct = cfg.n_routed_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** b)
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if ".ffn.experts." not in name and name != "embed.weight" and ".engram.embed." not in name)
    engram = 0
    for block in model.layers:
        if block.engram is not None:
            table = block.engram.embed
            per_row = table.weight[0].numel() * table.weight.element_size() + (
                table.scale[0].numel() if table.fp8 else 0)
            engram += b * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * per_row
    kv = 0
    for layer in range(cfg.num_hidden_layers):
        kv += cfg.sliding_window * row_bytes(codecs.window)
        r = cfg.compress_ratios[layer]
        if r:
            src = cfg.kv_source_of(layer)
            kv += min(cfg.index_topk, context // cfg.compress_ratios[src]) * row_bytes(codecs.kv)
            key_source = cfg.key_source_of(layer)
            if layer in cfg.index_source_layer_ids and key_source is not None:
                kv += (context // cfg.compress_ratios[key_source]) * row_bytes(codecs.index)
    routed = cfg.num_hidden_layers * distinct * expert
    total = dense + routed + engram + b * kv
    return {"dense_weights": dense, "routed_weights": routed, "engram_rows": engram, "kv": b * kv,
            "kv_per_sequence": kv, "total": total, "distinct_experts_per_layer": distinct}


def _time(torch, fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def _bench_batch(torch, model, cfg, b: int, args, bandwidth: float, ops) -> dict:
    import math
    import time

    from deepinfer.model import ForwardBatch, ModelCache

    block_size = 128
    max_context = args.context + 4 * args.steps + 16
    blocks_per_seq = math.ceil(max_context / block_size)
    cache = ModelCache.allocate(model.cache_spec(block_size), b * blocks_per_seq + 1, b + 1, "cuda")
    _fill_cache(torch, model, cache)
    tables = [[1 + i * blocks_per_seq + j for j in range(blocks_per_seq)] for i in range(b)]
    gen = torch.Generator().manual_seed(b)
    positions = [args.context] * b

    def next_batch():
        tokens = torch.randint(3, cfg.vocab_size, (b,), generator=gen).tolist()
        batch = ForwardBatch.build([[t] for t in tokens], list(positions), tables, list(range(1, b + 1)),
                                   device="cuda")
        for i in range(b):
            positions[i] += 1
        return batch

    row: dict = {"batch": b}
    with torch.no_grad():
        model(next_batch(), cache, ops)                       # compiles the kernels for these shapes
        torch.cuda.synchronize()
        row["eager_ms"] = _time(torch, lambda: model(next_batch(), cache, ops), max(3, args.steps // 4))
        if not args.no_graphs:
            from deepinfer.engine.core.cuda_graphs import DecodeGraphs
            try:
                t0 = time.perf_counter()
                graphs = DecodeGraphs(model, cache, max_seqs=b, max_blocks=blocks_per_seq, max_context_len=max_context,
                                      interval=b, ops=ops)
                row["capture_s"] = round(time.perf_counter() - t0, 2)
                pending = iter([next_batch() for _ in range(args.steps)])
                row["graph_ms"] = _time(torch, lambda: graphs.run(next(pending)), args.steps)
                del graphs
            except Exception as err:                          # report, keep the eager figure
                row["graph_error"] = f"{type(err).__name__}: {err}"[:400]
    need = _roofline_bytes(torch, model, cfg, b, args.context)
    step_ms = row.get("graph_ms", row["eager_ms"])
    row["roofline_ms"] = need["total"] / bandwidth * 1000
    row["step_over_roofline"] = step_ms / row["roofline_ms"]
    row["output_tokens_per_s"] = b / step_ms * 1000
    row["bytes"] = need
    return row


if __name__ == "__main__":
    main()
