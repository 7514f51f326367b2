"""Prefix caching on a multi-turn chat workload: TTFT and prefill tokens with caching on vs off.

    .venv/bin/python benchmarks/prefix_cache.py [--conversations 8] [--turns 4] [--system-tokens 512]
        [--user-tokens 64] [--output-tokens 16] [--model DIR --load-format dummy] [--device cpu]
        [--prefix-cache-snapshots N] [--repeats 3] [--json OUT]

Workload (seeded): `conversations` chats share one system prompt of `system-tokens` random token ids;
each turn appends a user message of `user-tokens` random ids to the chat's history (system prompt,
earlier messages and replies) and asks for `output-tokens` greedy tokens (EOS ignored). Closed loop:
the chats start together and each sends its next turn as soon as its reply is complete. The same
workload runs on an engine with prefix caching on and on one with it off (default: the embedded model
on the CPU), each after a warm-up request. Reported per mode: mean and median TTFT (add_request to
the first output carrying a token) of turn 1 and of turns >= 2, prefill tokens computed (every chunk
of every prefill step), prompt tokens served from the cache, wall time; and whether the two modes
gave the same tokens. Each mode runs `repeats` times, alternating; the summary takes each mode's best
time (other processes on a shared machine only ever add time).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from deepinfer.engine import EngineArgs, LLMEngine, SamplingParams
from deepinfer.sched import StepKind


def run(args: argparse.Namespace, enable: bool) -> dict:
    engine = LLMEngine(EngineArgs(model=args.model, load_format=args.load_format, device=args.device,
                                  max_num_seqs=args.conversations, max_model_len=args.max_model_len,
                                  kv_cache_memory_mb=args.kv_cache_memory_mb, enable_prefix_caching=enable,
                                  prefix_cache_snapshots=args.prefix_cache_snapshots if enable else None))
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
    return {"prefix_caching": enable, "ttft_turn1_mean_s": statistics.mean(first),
            "ttft_turn1_median_s": statistics.median(first),
            "ttft_later_turns_mean_s": statistics.mean(later) if later else None,
            "ttft_later_turns_median_s": statistics.median(later) if later else None,
            "prefill_tokens": sum(prefill_tokens.values()), "cached_prompt_tokens": cached, "wall_s": wall,
            "outputs": outputs}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--load-format", default="safetensors")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-mb", type=float, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-cache-snapshots", type=int, default=None, help="default: the engine's")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating on / off")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    runs = [run(args, enable) for _ in range(args.repeats) for enable in (True, False)]
    outputs = [result.pop("outputs") for result in runs]
    same = all(tokens == outputs[0] for tokens in outputs)
    # On a shared machine other processes only ever add time: each mode's figure is its best run.
    best = {enable: {key: min(r[key] for r in runs if r["prefix_caching"] is enable)
                     for key in runs[0] if key.endswith("_s") and runs[0][key] is not None}
            for enable in (True, False)}
    on, off = best[True], best[False]
    report = {"workload": {k: v for k, v in vars(args).items() if k != "json"}, "same_tokens": same,
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "threads": torch.get_num_threads()},
              "runs": runs, "best_on": on, "best_off": off,
              "prefill_tokens_on": runs[0]["prefill_tokens"], "prefill_tokens_off": runs[1]["prefill_tokens"]}
    if "ttft_later_turns_mean_s" in on:
        report["ttft_later_turns_speedup"] = off["ttft_later_turns_mean_s"] / on["ttft_later_turns_mean_s"]
    report["ttft_turn1_ratio"] = off["ttft_turn1_mean_s"] / on["ttft_turn1_mean_s"]
    report["prefill_tokens_ratio"] = runs[1]["prefill_tokens"] / runs[0]["prefill_tokens"]
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
