"""Fused GPU kernels against their PyTorch reference twins at V4-Flash decode shapes.

    python benchmarks/kernels_gpu.py --batches 1,8,32,128,256 --out kernels.json

Each row: the kernel's median time (`triton.testing.do_bench`), the reference's, and for the MoE the
Triton expert kernels against the cuBLAS grouped GEMMs (`torch_ops.moe_experts_grouped`) with the
bytes of expert weights they must read, and the same kernels on the experts kept in FP8 (block
128) and MXFP4 (`moe_experts_fp8_fused`, `moe_experts_mxfp4_fused`; bytes as stored); once, the
prefill's attention over gathered rows (`sparse_attention_fused`). Shapes: 64
heads × 512, window 128, CSA ratio 4 with 512 picks (context 4096) and a 64 × 128 indexer, hidden
4096, hc 4, 256 experts × 2048, top-6; the sampler's `sample_race` over a 129,280-token vocabulary.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch
import triton

from deepinfer.kernels import reference, torch_ops, triton_ops


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def attention_inputs(b: int, gen: torch.Generator) -> tuple[tuple, int]:
    """`paged_decode_attention` arguments for b CSA sequences at context 4096 (V4-Flash: 64 heads ×
    512, window 128, 512 picked compressed rows), and the KV bytes a call must read."""
    heads, dim, window, ratio, picks, block = 64, 512, 128, 4, 512, 128
    context = 4096
    blocks = context // block + 1
    q = torch.randn(b, heads, dim, generator=gen).cuda().bfloat16()
    ring = torch.randn(b + 1, window, dim, generator=gen).cuda().bfloat16()
    paged = torch.randn(b * blocks + 1, block // ratio, dim, generator=gen).cuda().bfloat16()
    tables = (torch.arange(b * blocks).view(b, blocks) + 1).cuda()
    ids = torch.stack([torch.randperm(context // ratio, generator=gen)[:picks] for _ in range(b)]).cuda()
    slots, pos = torch.arange(1, b + 1).cuda(), torch.full((b,), context, dtype=torch.int64).cuda()
    sink = torch.randn(heads, generator=gen).cuda()
    return (q, ring, slots, pos, window, sink, dim**-0.5, paged, tables, ids, ratio), b * (window + picks) * dim * 2


def attention_rows(b: int, gen: torch.Generator) -> dict:
    args, kv_bytes = attention_inputs(b, gen)
    fused = bench(lambda: triton_ops.paged_decode_attention_fused(*args))
    return {"op": "paged_decode_attention (CSA, 128 + 512 rows)", "batch": b,
            "fused_us": fused * 1000, "reference_us": bench(lambda: reference.paged_decode_attention(*args)) * 1000,
            "kv_bytes": kv_bytes, "fused_GBps": kv_bytes / fused / 1e6}


def indexer_rows(b: int, gen: torch.Generator) -> dict:
    heads, dim, ratio, block, entries = 64, 128, 4, 128, 1024
    blocks = entries * ratio // block
    q = torch.randn(b, heads, dim, generator=gen).cuda().bfloat16()
    keys = torch.randn(b * blocks + 1, block // ratio, dim, generator=gen).cuda().bfloat16()
    tables = (torch.arange(b * blocks).view(b, blocks) + 1).cuda()
    w = torch.randn(b, heads, generator=gen).cuda()
    args = (q, keys, tables, entries, w, dim**-0.5, ratio)
    scores = triton_ops.paged_indexer_scores_fused(*args)
    visible = torch.full((b,), entries, dtype=torch.int64).cuda()
    return {"op": "paged_indexer_scores + top-512 (1024 entries)", "batch": b,
            "fused_us": (bench(lambda: triton_ops.paged_indexer_scores_fused(*args))
                         + bench(lambda: triton_ops.topk_lowest_index_fused(scores, visible, 512))) * 1000,
            "reference_us": (bench(lambda: reference.paged_indexer_scores(*args))
                             + bench(lambda: reference.topk_lowest_index(scores, visible, 512))) * 1000}


def compress_rows(b: int, gen: torch.Generator) -> dict:
    width, ratio, block = 512, 4, 128
    kv = torch.randn(b, 2 * width, generator=gen).cuda().bfloat16()
    gate = torch.randn(b, 2 * width, generator=gen).cuda().bfloat16()
    ape = torch.randn(ratio, 2 * width, generator=gen).cuda()
    ring_kv = torch.randn(b + 1, 2 * ratio, 2 * width, generator=gen).cuda()
    ring_g = torch.randn(b + 1, 2 * ratio, 2 * width, generator=gen).cuda()
    paged = torch.zeros(b * 8 + 1, block // ratio, width, dtype=torch.bfloat16, device="cuda")
    tables = (torch.arange(b * 8).view(b, 8) + 1).cuda()
    pos = torch.full((b,), 4 * ratio - 1, dtype=torch.int64).cuda()      # every window closes
    inv = reference.rope_inv_freq(64, 160000.0).cuda()
    norm = torch.ones(width, device="cuda")
    args = (kv, gate, ape, pos, torch.arange(1, b + 1).cuda(), ring_kv, ring_g, norm, inv, 1e-6)
    kw = dict(overlap=True, paged=paged, block_tables=tables)
    return {"op": "compress_decode (CSA KV, closing)", "batch": b,
            "fused_us": bench(lambda: triton_ops.compress_decode_fused(*args, **kw)) * 1000,
            "reference_us": bench(lambda: reference.compress_decode(*args, **kw)) * 1000}


def mhc_rows(b: int, gen: torch.Generator) -> dict:
    hc, dim = 4, 4096
    streams = torch.randn(b, hc, dim, generator=gen).cuda().bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=gen).cuda() * 0.01
    scale, base = torch.ones(3).cuda(), torch.zeros((2 + hc) * hc).cuda()
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    x = torch.randn(b, dim, generator=gen).cuda().bfloat16()
    _, post, comb = reference.hc_pre(streams, fn, scale, base, **kw)
    return {"op": "hc_pre + hc_post", "batch": b,
            "fused_us": (bench(lambda: triton_ops.hc_pre_fused(streams, fn, scale, base, **kw))
                         + bench(lambda: triton_ops.hc_post_fused(x, streams, post, comb))) * 1000,
            "reference_us": (bench(lambda: reference.hc_pre(streams, fn, scale, base, **kw))
                             + bench(lambda: reference.hc_post(x, streams, post, comb))) * 1000}


def prefill_attention_row(gen: torch.Generator, queries: int = 1024) -> dict:
    """The prefill's attention over gathered rows (a block of `queries` queries, 128 window + 512
    picks each): the Triton kernel against the reference."""
    heads, dim, rows = 64, 512, 640
    q = torch.randn(queries, heads, dim, generator=gen).cuda().bfloat16()
    kv = torch.randn(queries, rows, dim, generator=gen).cuda().bfloat16()
    valid = (torch.rand(queries, rows, generator=gen) < 0.9).cuda()
    sink = torch.randn(heads, generator=gen).cuda()
    args = (q, kv, valid, sink, dim**-0.5)
    fused = bench(lambda: triton_ops.sparse_attention_fused(*args))
    return {"op": f"sparse_attention (prefill, {queries} queries × {rows} rows)", "fused_us": fused * 1000,
            "reference_us": bench(lambda: reference.sparse_attention(*args)) * 1000,
            "rows_GBps": kv.numel() * 2 / fused / 1e6}


def sampling_rows(b: int, gen: torch.Generator) -> dict:
    """`sample_race` over V4's vocabulary: temperature only, top-k 50, and top-p 0.9 without top-k
    (the reference sorts the whole vocabulary for it)."""
    vocab = 129280
    logits = (torch.randn(b, vocab, generator=gen) * 3).cuda()
    noise = torch.empty(b, vocab, device="cuda").exponential_()
    temperature, min_p = torch.full((b,), 0.8, device="cuda"), torch.zeros(b, device="cuda")
    row = {"op": f"sample_race (vocab {vocab})", "batch": b}
    for name, top_k, top_p, hint in (("temperature", vocab, 1.0, 0), ("top_k_50", 50, 1.0, 50),
                                     ("top_p_0.9", vocab, 0.9, vocab)):
        args = (logits, temperature, torch.full((b,), top_k, device="cuda"), torch.full((b,), top_p, device="cuda"),
                min_p, noise, hint)
        with (mock.patch.object(triton_ops.sampling, "FUSED_MIN_ROWS", 0),   # the kernel at every batch
              mock.patch.object(triton_ops.sampling, "FUSED_MIN_ROWS_SORTING", 0)):
            for impl, op in (("fused", triton_ops.sample_race_fused), ("reference", reference.sample_race)):
                # eager (what the sampler pays today) and inside a CUDA graph (the GPU's own time)
                row[f"{name}_{impl}_us"] = bench(lambda op=op, args=args: op(*args)) * 1000
                row[f"{name}_{impl}_graph_us"] = triton.testing.do_bench_cudagraph(
                    lambda op=op, args=args: op(*args), rep=100) * 1000
    return row


def quantised(w13: torch.Tensor, w2: torch.Tensor,
              names: tuple[str, ...] = ("fp8", "mxfp4")) -> dict[str, tuple[torch.Tensor, ...]]:
    """The experts in FP8 (block 128) and / or MXFP4, as `names` asks: (w13, w13_scale, w2, w2_scale) each."""
    out = {}
    for name, quant in (("fp8", lambda w: reference.quant_fp8_block(w, 128)), ("mxfp4", reference.quant_mxfp4)):
        if name not in names:
            continue
        parts = [[quant(w[e]) for e in range(w.shape[0])] for w in (w13, w2)]
        out[name] = tuple(torch.stack([p[i] for p in ps]) for ps in parts for i in (0, 1))
    return out


def moe_rows(b: int, gen: torch.Generator, w13: torch.Tensor, w2: torch.Tensor,
             quant: dict[str, tuple[torch.Tensor, ...]]) -> dict:
    experts, top_k = w13.shape[0], 6
    x = torch.randn(b, w13.shape[2], generator=gen).cuda().bfloat16()
    logits = torch.randn(b, experts, generator=gen).cuda()
    ids, weights = reference.route(logits, None, top_k, scoring_func="sqrtsoftplus", normalize=True, scaling=1.5)
    distinct = ids.unique().numel()
    nbytes = distinct * (w13[0].numel() + w2[0].numel()) * 2
    row = {"op": "moe_experts (256 × 2048, top-6)", "batch": b, "distinct_experts": distinct,
           "weight_bytes": nbytes}
    if b * top_k <= triton_ops.moe.FUSED_MAX_PAIRS:
        t = bench(lambda: triton_ops.moe_experts_fused(x, ids, weights, w13, w2, 10.0))
        row.update(fused_us=t * 1000, fused_GBps=nbytes / t / 1e6)
    t = bench(lambda: torch_ops.moe_experts_grouped(x, ids, weights, w13, w2, 10.0))
    row.update(cublas_grouped_us=t * 1000, cublas_grouped_GBps=nbytes / t / 1e6)
    calls = {"fp8": lambda q: triton_ops.moe_experts_fp8_fused(x, ids, weights, *q, 10.0, 128),
             "mxfp4": lambda q: triton_ops.moe_experts_mxfp4_fused(x, ids, weights, *q, 10.0)}
    for name, q in quant.items():
        stored = distinct * sum(t[0].numel() * t.element_size() for t in q)
        t = bench(lambda call=calls[name], q=q: call(q))
        row.update({f"{name}_us": t * 1000, f"{name}_weight_bytes": stored, f"{name}_GBps": stored / t / 1e6})
    row["route_fused_us"] = bench(lambda: triton_ops.route_fused(
        logits, None, top_k, scoring_func="sqrtsoftplus", normalize=True, scaling=1.5)) * 1000
    row["route_reference_us"] = bench(lambda: reference.route(
        logits, None, top_k, scoring_func="sqrtsoftplus", normalize=True, scaling=1.5)) * 1000
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--out", default="kernels.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(256, 4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02)
    w2 = (torch.randn(256, 4096, 2048, device="cuda", dtype=torch.bfloat16) * 0.02)
    quant = quantised(w13, w2)
    rows = [prefill_attention_row(gen)]
    print(json.dumps(rows[-1]), flush=True)
    for b in [int(x) for x in args.batches.split(",") if x]:
        for make in (attention_rows, indexer_rows, compress_rows, mhc_rows, sampling_rows):
            rows.append(make(b, gen))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(moe_rows(b, gen, w13, w2, quant))
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
