"""Time the incremental detokenizer and stop-string checker per output token (run on purpose).

    PYTHONPATH=packages/deepinfer-engine/src python benchmarks/engine_detokenizer.py --num-tokens 4000

A byte-level BPE tokenizer (vocab up to 4000) is trained on the fly on stdlib source plus multi-byte text,
a long text is encoded, and its ids are streamed one at a time through `IncrementalDetokenizer`
(+ `StopStringChecker` with 3 stop strings that never match), against the naive alternative of
decoding all ids so far at every step. Reports microseconds per token (median of 3 runs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from deepinfer.engine.text.detokenizer import IncrementalDetokenizer, StopStringChecker
from deepinfer.engine.text.tokenizer import Tokenizer

WORDS = "héllo wörld café 中文 測試 日本語 🎉 🚀 👍🏽 def return import class print(x)".split()


def train_tokenizer(lines: list[str]) -> Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(lines, trainer)
    return Tokenizer(backend)


def run_stream(tokenizer: Tokenizer, ids: list[int], with_stop: bool) -> float:
    detok = IncrementalDetokenizer(tokenizer)
    checker = StopStringChecker(["<|never|>", "\n\n\n\n\n", "STOP HERE"])
    start = time.perf_counter()
    for token_id in ids:
        delta = detok.add([token_id])
        if with_stop:
            checker.add(delta)
    return (time.perf_counter() - start) / len(ids) * 1e6


def run_naive(tokenizer: Tokenizer, ids: list[int]) -> float:
    start = time.perf_counter()
    for n in range(1, len(ids) + 1):
        tokenizer.decode(ids[:n])
    return (time.perf_counter() - start) / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=4000)
    args = parser.parse_args()
    source = Path(json.__file__).parent.joinpath("decoder.py").read_text(encoding="utf-8").splitlines()
    rng = random.Random(0)
    generated = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(2000)]
    tokenizer = train_tokenizer(source + generated)
    text = "\n".join(generated[i % len(generated)] + " " + source[i % len(source)] for i in range(4000))
    ids = tokenizer.encode(text)[:args.num_tokens]
    results = {
        "IncrementalDetokenizer": [run_stream(tokenizer, ids, False) for _ in range(3)],
        "IncrementalDetokenizer + StopStringChecker": [run_stream(tokenizer, ids, True) for _ in range(3)],
        "naive decode(all ids) per token": [run_naive(tokenizer, ids) for _ in range(3)],
    }
    print(f"tokens={len(ids)} vocab={tokenizer.vocab_size}")
    print("| method | us per token |")
    print("|---|---:|")
    for name, samples in results.items():
        print(f"| {name} | {statistics.median(samples):.2f} |")


if __name__ == "__main__":
    main()
