"""Prefill tokens/s of one long prompt through a DeepSeek-V4.1-Flash-shaped model on one GPU, with
CED / YOCO prefill truncation off and compact (and, to compare, mask).

    source .device/activate.sh && source benchmarks/device_env.sh
    python3 benchmarks/v41_prefill_gpu.py --layers 12 --prompt-lens 8192 --modes off,compact --out v41_prefill.json

The model is `v41_decode_gpu.py`'s: the real V4.1-Flash dimensions, seeded dummy weights, MXFP4 experts,
the packed cache, `--layers` layers scheduled like the release in miniature (window-only layers 0 and
1, a ratio-2 half starting with its KV source, a ratio-1 half starting with the ratio-1 KV source),
with the DSpark target layers (unused here, but checked by the truncation) all after the last KV source.
Truncation starts at the first consumer layer S (the layer after the last KV source); from there
only each prompt's last `--keep-tokens` rows (EngineArgs.yoco_prefill_keep_tokens, 140 by default) run
the layers, while every layer still writes the window KV of the whole prompt. The mode is set as the
engine sets it from EngineArgs.yoco_prefill_truncation_mode (`set_prefill_truncation`).

Per mode: one warm-up prompt of the same length (so every kernel is compiled for the shapes before
the clock runs), then `--repeats` prompts of fresh random tokens, each one eager forward timed on the
host around a synchronised step; the median is reported, with the per-layer times of one more prompt
(CUDA events at each layer's start and end), the peak GPU memory, and how far the last token's
logits moved from the untruncated ones (the truncation is approximate by design). Prompt lengths run
shortest first; a failure is reported with its traceback (run with CUDA_LAUNCH_BLOCKING=1 to have it
name the failing launch) and, when it leaves the GPU unusable, ends the run. JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="backbone layers (>= 8); ~7.5 GB each with FP4 experts")
    ap.add_argument("--prompt-lens", default="8192", help="prompt lengths to run, e.g. 1024,8192")
    ap.add_argument("--modes", default="off,compact", help="truncation modes to run: off, compact, mask")
    ap.add_argument("--keep-tokens", type=int, default=140, help="rows kept per prompt from layer S on")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--expert-dtype", default="fp4", choices=["fp4", "fp8", "bf16"])
    ap.add_argument("--engram-vocab", type=int, default=65536, help="start of the Engram prime search (16M released)")
    ap.add_argument("--out", required=True, help="where the JSON report goes")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    # Must be set before CUDA initialises (a large model fragments the caching allocator otherwise).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    from v41_decode_gpu import v41_config

    from deepinfer.kernels import kernels_for
    from deepinfer.model import DeepseekV41Config
    from deepinfer.model.ced import first_consumer_layer
    from deepinfer.model.dummy import dummy_model
    from deepinfer.model.layers.engram import table_rows

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    raw = v41_config(args.layers, args.engram_vocab)
    # DSpark targets all at or after S, as in the release (37-39 after 21): truncation refuses them on both sides
    kv_sources = raw["kv_source_layer_ids"]
    raw["dspark_target_layer_ids"] = list(range(max(max(kv_sources) + 1, args.layers - 3), args.layers))
    raw["engram_num_embeddings"] = table_rows(DeepseekV41Config.from_dict({**raw, "engram_num_embeddings": [1, 1]}))
    cfg = DeepseekV41Config.from_dict(raw)
    model = dummy_model(cfg, dtype=torch.bfloat16, device="cuda",
                        expert_dtype=None if args.expert_dtype == "bf16" else args.expert_dtype).eval()
    ops = kernels_for("cuda")
    first = first_consumer_layer(cfg)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
              "compress_ratios": list(cfg.compress_ratios)[:args.layers], "first_consumer_layer": first,
              "truncated_layers": args.layers - first, "keep_tokens": args.keep_tokens,
              "expert_dtype": args.expert_dtype, "runs": []}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    for prompt_len in sorted(int(x) for x in args.prompt_lens.split(",") if x):
        reference_logits = None
        for mode in [m for m in args.modes.split(",") if m]:
            model.set_prefill_truncation(mode, args.keep_tokens)
            try:
                row, logits = _bench_mode(torch, model, cfg, prompt_len, args, ops, first)
            except Exception as err:                      # e.g. out of memory: report, keep going
                row, logits = {"error": f"{type(err).__name__}: {err}"[:400],
                               "traceback": traceback.format_exc()[-3000:]}, None
            if logits is not None:
                if reference_logits is None and mode == "off":
                    reference_logits = logits
                elif reference_logits is not None:
                    row["last_logits_max_abs_diff_to_off"] = (logits - reference_logits).abs().max().item()
                    row["last_token_argmax_same_as_off"] = bool(logits.argmax() == reference_logits.argmax())
                    # the scale the difference is read against, and how close off's top two logits are
                    row["off_last_logits_max_abs"] = reference_logits.abs().max().item()
                    top2 = reference_logits.float().topk(2).values
                    row["off_top2_gap"] = (top2[0] - top2[1]).item()
                    row["last_logits_cosine_to_off"] = torch.nn.functional.cosine_similarity(
                        logits.float().flatten(), reference_logits.float().flatten(), dim=0).item()
            row = {"mode": mode, "prompt_len": prompt_len, **row}
            report["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("layer_ms", "traceback")}), flush=True)
            if "traceback" in row:
                print(row["traceback"], flush=True)
            try:
                torch.cuda.empty_cache()
            except Exception:                             # an illegal access leaves the context unusable
                _write(report, args.out)
                raise
    model.set_prefill_truncation("off")
    _write(report, args.out)
    print(f"{'prompt':>7} {'mode':>8} {'prefill s':>10} {'tokens/s':>10} {'vs off':>7} {'peak GB':>8}")
    for r in report["runs"]:
        if "error" in r:
            print(f"{r['prompt_len']:>7} {r['mode']:>8} {r['error'][:70]}")
            continue
        base = next((o["prefill_s"] for o in report["runs"]
                     if o["mode"] == "off" and o["prompt_len"] == r["prompt_len"] and "prefill_s" in o), None)
        speedup = base / r["prefill_s"] if base else float("nan")
        print(f"{r['prompt_len']:>7} {r['mode']:>8} {r['prefill_s']:10.3f} {r['prefill_tokens_per_s']:10.0f} "
              f"{speedup:7.2f} {r['peak_memory_GB']:8.1f}")


def _write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _bench_mode(torch, model, cfg, prompt_len: int, args, ops, first: int, device: str = "cuda"):
    """(row of figures, last token's logits [vocab] float32 of a fixed prompt) for the model's current
    truncation mode; `first`: the first consumer layer S."""
    import math

    from deepinfer.model import ForwardBatch, ModelCache

    block_size = 128
    blocks = math.ceil(prompt_len / block_size)
    cache = ModelCache.allocate(model.cache_spec(block_size), blocks + 1, 2, device)
    table = list(range(1, blocks + 1))
    gen = torch.Generator().manual_seed(prompt_len)

    def prompt(seed: int | None = None):
        g = torch.Generator().manual_seed(seed) if seed is not None else gen
        ids = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=g).tolist()
        return ForwardBatch.build([ids], [0], [table], [1], device=device)      # logits of the last token

    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(prompt(), cache, ops)                               # compiles the kernels for these shapes
        torch.cuda.synchronize()
        seconds = []
        for _ in range(args.repeats):
            batch = prompt()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(batch, cache, ops)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        layer_ms = _layer_times(torch, model, prompt(), cache, ops)
        logits = model(prompt(seed=0), cache, ops)[-1].float()
    median = statistics.median(seconds)
    return {"prefill_s": median, "prefill_s_all": seconds, "prefill_tokens_per_s": prompt_len / median,
            "peak_memory_GB": torch.cuda.max_memory_allocated() / 1e9,
            "layers_before_S_ms": sum(layer_ms[:first]), "layers_from_S_ms": sum(layer_ms[first:]),
            "layer_ms": layer_ms}, logits


def _layer_times(torch, model, batch, cache, ops) -> list[float]:
    """Milliseconds of each layer in one forward, from CUDA events recorded at its start and end."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in model.layers]
    hooks = []
    for block, (start, stop) in zip(model.layers, events):
        hooks.append(block.register_forward_pre_hook(lambda *_, e=start: e.record()))
        hooks.append(block.register_forward_hook(lambda *_, e=stop: e.record()))
    try:
        model(batch, cache, ops)
        torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    return [start.elapsed_time(stop) for start, stop in events]


if __name__ == "__main__":
    main()
