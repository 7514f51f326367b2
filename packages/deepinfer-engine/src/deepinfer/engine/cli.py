"""The `deepinfer` command: `deepinfer generate` and `deepinfer bench`."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence

from .engine_args import EngineArgs
from .llm import LLM
from .llm_engine import LLMEngine
from .sampling_params import SamplingParams


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    parser.add_argument("--kv-cache-memory-mb", type=float, default=256.0, help="cache budget (CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="on CUDA: weights + cache take this fraction of the GPU")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--expert-dtype", default=None, choices=["fp8", "fp4"],
                        help="keep the routed experts in FP8 (block-scaled) or MXFP4")


def _args(ns: argparse.Namespace) -> dict:
    return dict(model=ns.model, device=ns.device, dtype=ns.dtype, max_model_len=ns.max_model_len,
                max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens, seed=ns.seed,
                block_size=ns.block_size, kv_cache_memory_mb=ns.kv_cache_memory_mb,
                gpu_memory_utilization=ns.gpu_memory_utilization, enforce_eager=ns.enforce_eager,
                expert_dtype=ns.expert_dtype)


def _generate(ns: argparse.Namespace) -> int:
    llm = LLM(**_args(ns))
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens,
                            seed=ns.sample_seed)
    for out in llm.generate(ns.prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        print(f"{out.prompt}{completion.text}")
        print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def run_bench(engine: LLMEngine, num_prompts: int, input_len: int, output_len: int, seed: int) -> dict:
    """Synthetic workload: random-token prompts, fixed output length (EOS ignored).

    Returns throughput (output tokens/s and total tokens/s), mean TTFT and mean TPOT in ms.
    """
    rng = random.Random(seed)
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started, first, done, counts = {}, {}, {}, {}
    t0 = time.perf_counter()
    for _ in range(num_prompts):
        rid = engine.add_request(None, [rng.randrange(vocab) for _ in range(input_len)], params)
        started[rid] = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            counts[out.request_id] = n
            if out.finished:
                done[out.request_id] = now
    elapsed = time.perf_counter() - t0
    out_tokens = sum(counts.values())
    ttft = [first[r] - started[r] for r in first]
    tpot = [(done[r] - first[r]) / (counts[r] - 1) for r in done if counts.get(r, 0) > 1]
    return {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "elapsed_s": round(elapsed, 4), "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((out_tokens + num_prompts * input_len) / elapsed, 2),
        "mean_ttft_ms": round(1000 * sum(ttft) / max(len(ttft), 1), 3),
        "mean_tpot_ms": round(1000 * sum(tpot) / max(len(tpot), 1), 3),
    }


def _bench(ns: argparse.Namespace) -> int:
    engine = LLMEngine(EngineArgs(**_args(ns)))
    result = run_bench(engine, ns.num_prompts, ns.input_len, ns.output_len, ns.seed)
    result.update(device=ns.device, dtype=ns.dtype, model=str(engine.model_dir))
    print(json.dumps(result, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: DeepSeek-V4 inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sample-seed", type=int, default=None)
    _engine_options(gen)
    bench = sub.add_parser("bench", help="throughput, TTFT and TPOT on a synthetic workload")
    bench.add_argument("--num-prompts", type=int, default=16)
    bench.add_argument("--input-len", type=int, default=64)
    bench.add_argument("--output-len", type=int, default=32)
    _engine_options(bench)
    ns = parser.parse_args(argv)
    try:
        return _generate(ns) if ns.command == "generate" else _bench(ns)
    except (ValueError, OSError) as err:
        print(f"deepinfer: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
