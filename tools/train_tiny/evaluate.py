"""Score a model folder with DeepInfer's own runtime on CPU: the numbers the model card quotes.

    python tools/train_tiny/evaluate.py --model packages/deepinfer-model/src/deepinfer/model/embedded \
        --data out/tiny

Prints JSON: held-out loss over the whole held-out split (tiled 512-token windows, as train.py),
the add-one train-unigram baseline on the same targets, the same two on the shipped
heldout_sample.txt (4 windows, the test's sample) plus that sample's self-fitted unigram entropy,
and the wall time of a 40-token greedy continuation of a 10-token prompt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from model_config import CONTEXT_LEN
from tokenizer import BOS_ID
from tokenizers import Tokenizer

from deepinfer.model import DeepseekV4ForCausalLM, ForwardBatch, ModelCache, load_model

SAMPLE_WINDOWS = 4
BLOCK_SIZE = 16


def prefill_logits(model: DeepseekV4ForCausalLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one fresh sequence (slot 1, blocks 1..n)."""
    cache = ModelCache.allocate(model.cache_spec(BLOCK_SIZE), len(ids) // BLOCK_SIZE + 2, 2)
    table = list(range(1, (len(ids) + BLOCK_SIZE - 1) // BLOCK_SIZE + 1))
    batch = ForwardBatch.build([ids], [0], [table], [1], logits="all")
    with torch.no_grad():
        return model(batch, cache)


def window_nll(model: DeepseekV4ForCausalLM, stream: np.ndarray, num_windows: int) -> tuple[float, np.ndarray]:
    """Mean NLL over `num_windows` tiled windows of `stream`, and the targets scored."""
    total, targets = 0.0, []
    for w in range(num_windows):
        chunk = stream[w * CONTEXT_LEN: w * CONTEXT_LEN + CONTEXT_LEN + 1].astype(np.int64)
        logits = prefill_logits(model, chunk[:-1].tolist())
        total += F.cross_entropy(logits, torch.from_numpy(chunk[1:]), reduction="sum").item()
        targets.append(chunk[1:])
    return total / (num_windows * CONTEXT_LEN), np.concatenate(targets)


def unigram_nll(counts: np.ndarray, targets: np.ndarray) -> float:
    return float(-np.log((counts[targets] + 1.0) / (counts.sum() + counts.size)).mean())


def self_entropy(targets: np.ndarray) -> float:
    """Entropy (nats) of the targets' own token distribution: no unigram model scores them better."""
    _, freq = np.unique(targets, return_counts=True)
    p = freq / freq.sum()
    return float(-(p * np.log(p)).sum())


def greedy_seconds(model: DeepseekV4ForCausalLM, prompt: list[int], num_new: int) -> tuple[float, list[int]]:
    cache = ModelCache.allocate(model.cache_spec(BLOCK_SIZE), 8, 2)
    table = [1, 2, 3, 4]
    start = time.perf_counter()
    out, length, chunk = [], 0, prompt
    with torch.no_grad():
        for _ in range(num_new):
            logits = model(ForwardBatch.build([chunk], [length], [table], [1]), cache)
            length += len(chunk)
            chunk = [int(logits[0].argmax())]
            out.append(chunk[0])
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("out/tiny"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    counts = np.asarray(json.loads((args.data / "unigram.json").read_text()), dtype=np.float64)
    heldout = np.load(args.data / "heldout.npy")
    num_windows = (heldout.size - 1) // CONTEXT_LEN
    loss, targets = window_nll(model, heldout, num_windows)
    text = (args.model / "heldout_sample.txt").read_text(encoding="utf-8")
    sample = np.asarray([BOS_ID] + tokenizer.encode(text, add_special_tokens=False).ids)
    sample_loss, sample_targets = window_nll(model, sample, SAMPLE_WINDOWS)
    prompt = [BOS_ID] + tokenizer.encode("import os\nimport sys\n\n\ndef main(", add_special_tokens=False).ids
    seconds, generated = greedy_seconds(model, prompt[:10], 40)
    print(json.dumps({
        "heldout": {"windows": num_windows, "tokens": int(targets.size), "loss": loss,
                    "unigram_loss": unigram_nll(counts, targets)},
        "sample": {"tokens_in_file": int(sample.size), "windows": SAMPLE_WINDOWS, "loss": sample_loss,
                   "unigram_loss": unigram_nll(counts, sample_targets),
                   "self_unigram_entropy": self_entropy(sample_targets)},
        "greedy_40_tokens_s": round(seconds, 3), "prompt": tokenizer.decode(prompt[:10]),
        "continuation": tokenizer.decode(generated),
    }, indent=1))


if __name__ == "__main__":
    main()
