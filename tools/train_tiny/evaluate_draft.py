"""Measure the draft head through the engine: tokens per verify step on held-out standard-library code.

    python tools/train_tiny/evaluate_draft.py --model packages/deepinfer-model/src/deepinfer/model/embedded \
        --data out/tiny

Prompts: from each of the first `--num-prompts` files of the held-out split, the `--prompt-len`
tokens starting in the middle of the file, decoded to text. Both `LLM(model)` and
`LLM(model, num_speculative_tokens=5, varlen_verify=False)` continue them greedily for `--max-tokens` tokens; the
script checks that the outputs are the same and prints JSON with `LLMEngine.stats()` of the
speculative run (`mean_accepted_length`: accepted drafts + the target's own token per verify step)
and both wall times.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tokenizer import BOS_ID, EOS_ID

from deepinfer.engine import LLM, SamplingParams


def heldout_prompts(data: Path, tokenizer, num_prompts: int, prompt_len: int) -> list[str]:
    """The middle `prompt_len` tokens of each of the first `num_prompts` held-out files long enough."""
    stream = np.load(data / "heldout.npy").astype(np.int64)
    starts = np.flatnonzero(stream == BOS_ID)
    ends = np.flatnonzero(stream == EOS_ID)
    prompts = []
    for start, end in zip(starts, ends):
        middle = (start + end) // 2
        if middle + prompt_len < end and len(prompts) < num_prompts:
            prompts.append(tokenizer.decode(stream[middle:middle + prompt_len].tolist()))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("out/tiny"))
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine_args = {"device": "cpu", "kv_cache_memory_mb": 64, "max_num_seqs": args.num_prompts, "max_model_len": 1024}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    results, seconds = [], []
    for speculative in (False, True):
        llm = LLM(model=str(args.model), num_speculative_tokens=5 if speculative else 0, varlen_verify=False,
                  **engine_args)
        prompts = heldout_prompts(args.data, llm.engine.tokenizer, args.num_prompts, args.prompt_len)
        begin = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - begin)
        results.append([list(o.outputs[0].token_ids) for o in outs])
    stats = llm.engine.stats()
    print(json.dumps({
        "prompts": len(prompts), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "speculative_equals_plain": results[0] == results[1],
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "spec_verify_steps": stats.spec_verify_steps, "spec_verify_rows": stats.spec_verify_rows,
        "spec_draft_tokens": stats.spec_draft_tokens, "spec_accepted_tokens": stats.spec_accepted_tokens,
        "plain_s": round(seconds[0], 2), "speculative_s": round(seconds[1], 2),
    }, indent=1))


if __name__ == "__main__":
    main()
