"""Prefix caching on a multi-turn chat workload: TTFT and prefill tokens with caching on vs off (and,
optionally, on with a small device cache backed by the host tier).

    .venv/bin/python benchmarks/prefix_cache.py --out DIR                 # embedded model, CPU
    .venv/bin/python benchmarks/prefix_cache.py --tiny --out DIR          # function check (CPU, seconds)
    python benchmarks/prefix_cache.py --flash-layers 8 --device cuda --expert-dtype fp8 \\
        --conversations 64 --turns 6 --system-tokens 2048 --user-tokens 128 --output-tokens 64 \\
        --max-model-len 4096 --repeats 1 --out DIR                        # V4-Flash-shaped, one GPU

Workload (seeded): `conversations` chats share one system prompt of `system-tokens` random token ids;
each turn appends a user message of `user-tokens` random ids to the chat's history (system prompt,
earlier messages and replies) and asks for `output-tokens` greedy tokens (EOS ignored). Closed loop:
the chats start together and each sends its next turn as soon as its reply is complete; at most
`max-num-seqs` (default: all) run at once, the others wait in the engine's queue.

Models: the embedded model (default); `--flash-layers N`: a V4-Flash-shaped model of N layers with
random weights (`load_format="dummy"`, config from benchmarks/v4_flash_dummy.py; bf16 on CUDA, routed
experts in `--expert-dtype`); `--tiny`: the same layer schedule at tiny widths (4 layers) on the CPU
with a small workload, for checking this script (its times mean nothing).

Modes (`--modes`, each a fresh engine after a warm-up request; they alternate over `--repeats`):
`on` prefix caching with the device cache only, `off` without it, `host` prefix caching with the
device KV cache cut to `--host-mode-kv-blocks` blocks and the host tier on (`--prefix-cache-host-mb`):
with max-num-seqs below the chats, the running ones evict the waiting ones' blocks, which then come
back from host memory. Reported per mode: mean and
median TTFT (add_request to the first output carrying a token) of turn 1 and of turns >= 2, prefill
tokens computed (every chunk of every prefill step), prompt tokens served from the cache (of them
from host memory), wall time, the cache's sizes; whether all modes gave the same tokens; and each
mode's best run (other processes only ever add time), with the off/on later-turn TTFT ratio (the
issue's device target: >= 3). The JSON goes to DIR/prefix_cache_<model>_<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from deepinfer.engine import EngineArgs, LLMEngine, SamplingParams
from deepinfer.sched import StepKind

# Blocks of 128 tokens: turn 2 of a chat caches a block of its own, evicted by the other chats in host mode.
TINY_WORKLOAD = {"conversations": 4, "max_num_seqs": 2, "turns": 3, "system_tokens": 128, "user_tokens": 64,
                 "output_tokens": 8, "max_model_len": 512, "kv_cache_memory_mb": 16.0, "host_mode_kv_blocks": 8,
                 "prefix_cache_host_mb": 4.0, "repeats": 1}


def model_args(args: argparse.Namespace, folder: Path) -> dict:
    """EngineArgs of the model: embedded, or a V4-Flash-shaped dummy (`--flash-layers`, `--tiny`)."""
    if not (args.tiny or args.flash_layers):
        return {"model": args.model}
    sys.path.insert(0, str(Path(__file__).parent))
    from v4_flash_dummy import flash_config, tiny_flash_config

    config = tiny_flash_config(4) if args.tiny else flash_config(args.flash_layers)
    (folder / "config.json").write_text(json.dumps(config))
    return {"model": str(folder), "load_format": "dummy",
            "expert_dtype": None if args.expert_dtype == "bf16" else args.expert_dtype}


def mode_args(args: argparse.Namespace, mode: str) -> dict:
    on_cuda = args.device.startswith("cuda")
    memory = {"kv_cache_memory_mb": None if on_cuda and args.kv_cache_memory_mb is None else
              args.kv_cache_memory_mb or 256.0}
    if mode == "off":
        return {**memory, "enable_prefix_caching": False}
    if mode == "on":
        return {**memory, "prefix_cache_host_mb": 0, "prefix_cache_snapshots": args.prefix_cache_snapshots}
    return {"num_kv_blocks": args.host_mode_kv_blocks, "prefix_cache_host_mb": args.prefix_cache_host_mb,
            "prefix_cache_snapshots": args.prefix_cache_snapshots}


def run(args: argparse.Namespace, base: dict, mode: str) -> dict:
    engine = LLMEngine(EngineArgs(**base, **mode_args(args, mode), device=args.device, seed=0,
                                  max_num_seqs=args.max_num_seqs or args.conversations,
                                  max_model_len=args.max_model_len))
    vocab = engine.model.cfg.vocab_size
    warm_up(engine, args, vocab)
    prefill_tokens = count_prefill_tokens(engine)
    rng = np.random.default_rng(args.seed)
    system = rng.integers(3, vocab, args.system_tokens).tolist()
    user = [[rng.integers(3, vocab, args.user_tokens).tolist() for _ in range(args.turns)]
            for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    histories = [list(system) for _ in range(args.conversations)]
    sent: dict[str, float] = {}
    ttft: dict[int, list[float]] = {turn: [] for turn in range(args.turns)}
    outputs: dict[str, list[int]] = {}
    cached = 0

    def send(chat: int, turn: int) -> None:
        histories[chat] += user[chat][turn]
        request_id = f"c{chat}t{turn}"
        sent[request_id] = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": list(histories[chat])}, params)

    started = time.perf_counter()
    for chat in range(args.conversations):
        send(chat, 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            chat, turn = (int(part) for part in out.request_id[1:].split("t"))
            if out.request_id in sent and out.outputs[0].token_ids:
                ttft[turn].append(time.perf_counter() - sent.pop(out.request_id))
            if out.finished:
                tokens = out.outputs[0].token_ids
                outputs[out.request_id] = tokens
                cached += out.num_cached_tokens
                histories[chat] += tokens
                if turn + 1 < args.turns:
                    send(chat, turn + 1)
    wall = time.perf_counter() - started
    first, later = ttft[0], [t for turn in range(1, args.turns) for t in ttft[turn]]
    stats = engine.scheduler.prefix_cache_stats
    plan = engine.runner.plan
    return {"mode": mode, "ttft_turn1_mean_s": statistics.mean(first),
            "ttft_turn1_median_s": statistics.median(first),
            "ttft_later_turns_mean_s": statistics.mean(later) if later else None,
            "ttft_later_turns_median_s": statistics.median(later) if later else None,
            "prefill_tokens": sum(prefill_tokens.values()), "cached_prompt_tokens": cached,
            "host_cached_prompt_tokens": stats.host_hits, "host_spilled_blocks": stats.num_host_spills,
            "wall_s": wall, "cache": dataclasses.asdict(plan), "outputs": outputs}


def run_freed(args: argparse.Namespace, base: dict, mode: str) -> dict:
    """`run`, then its engine's memory freed: the next mode's engine needs it."""
    result = run(args, base, mode)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def warm_up(engine: LLMEngine, args: argparse.Namespace, vocab: int) -> None:
    """One request of the workload's first-turn shape (other tokens), then an empty cache: the first
    forwards of a process are slower (allocator, kernel set-up), which would count against whichever
    mode runs first."""
    prompt = np.random.default_rng(args.seed + 1).integers(3, vocab, args.system_tokens + args.user_tokens).tolist()
    engine.add_request("warm-up", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def count_prefill_tokens(engine: LLMEngine) -> dict[str, int]:
    counts: dict[str, int] = {}
    schedule: Callable = engine.scheduler.schedule

    def counted():
        out = schedule()
        if out.kind is StepKind.PREFILL:
            for chunk in out.prefill:
                counts[chunk.seq_id] = counts.get(chunk.seq_id, 0) + chunk.num_tokens
        return out

    engine.scheduler.schedule = counted
    return counts


def summary(runs: list[dict], modes: list[str]) -> dict:
    """Each mode's best run of every time (other processes only ever add time), its exact counts, and
    the off / on ratios."""
    best = {mode: {key: min(r[key] for r in runs if r["mode"] == mode)
                   for key in runs[0] if key.endswith("_s") and runs[0][key] is not None} for mode in modes}
    first = {mode: next(r for r in runs if r["mode"] == mode) for mode in modes}
    out = {"best": best, "prefill_tokens": {mode: first[mode]["prefill_tokens"] for mode in modes},
           "cached_prompt_tokens": {mode: first[mode]["cached_prompt_tokens"] for mode in modes}}
    for mode in (m for m in modes if m != "off"):
        if "off" in modes and "ttft_later_turns_mean_s" in best[mode]:
            out[f"ttft_later_turns_speedup_{mode}"] = (best["off"]["ttft_later_turns_mean_s"]
                                                       / best[mode]["ttft_later_turns_mean_s"])
        if "off" in modes:
            out[f"prefill_tokens_ratio_{mode}"] = first["off"]["prefill_tokens"] / first[mode]["prefill_tokens"]
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: --conversations")
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--flash-layers", type=int, default=0, help="a V4-Flash-shaped dummy model of this many layers")
    parser.add_argument("--expert-dtype", choices=("bf16", "fp8", "fp4"), default="bf16")
    parser.add_argument("--tiny", action="store_true", help="tiny V4-Flash-shaped model and workload on the CPU")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-mb", type=float, default=None,
                        help="the cache budget of modes on and off (default: 256 on CPU, 0.9 of the GPU on CUDA)")
    parser.add_argument("--modes", default="on,off", help="comma-separated, of on, off, host")
    parser.add_argument("--host-mode-kv-blocks", type=int, default=512, help="the KV blocks of mode host")
    parser.add_argument("--prefix-cache-host-mb", type=float, default=1024.0, help="the host tier of mode host")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-cache-snapshots", type=int, default=None, help="default: the engine's")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the JSON into (made if absent)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.modes = "on,off,host"
        vars(args).update(TINY_WORKLOAD)
    args.modes = args.modes.split(",")
    if not set(args.modes) <= {"on", "off", "host"}:
        parser.error(f"--modes {','.join(args.modes)}: each must be on, off or host")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as folder:
        base = model_args(args, Path(folder))
        runs = [run_freed(args, base, mode) for _ in range(args.repeats) for mode in args.modes]
    outputs = [result.pop("outputs") for result in runs]
    model = "tiny-flash" if args.tiny else f"flash{args.flash_layers}l" if args.flash_layers else "embedded"
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"workload": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
              "model": model, "same_tokens": all(tokens == outputs[0] for tokens in outputs),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "device": device},
              "runs": runs, **summary(runs, args.modes)}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefix_cache_{model}_{'cuda' if args.device.startswith('cuda') else 'cpu'}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
