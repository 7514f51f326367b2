"""Per-step cost of structured output: filling and applying token bitmasks (run on purpose, CPU).

    PYTHONPATH=packages/deepinfer-engine/src python benchmarks/engine_structured.py \
        --batch-size 64 --vocab-sizes 32000 129280 --iters 20

The vocabulary is synthetic (xgrammar RAW type): every printable ASCII character, then random
strings of 2-8 characters drawn from JSON-ish characters, so a JSON schema can always be spelled.
Every row of the batch is constrained by the same JSON schema, each at a different position (a
seeded random walk of 0-45 tokens through the grammar). Milliseconds, median of --iters after 2
warm-ups:

- fill: `fill_token_bitmask` for the whole batch (xgrammar fills each row on the host, then the
  dead-end check), the host part that runs while the forward is in flight;
- apply (reference): `apply_token_bitmask`, the pure-PyTorch unpack + masked_fill on the logits;
- apply (xgrammar CPU kernel): xgrammar's in-place kernel on the same logits, for comparison;
- sampler +mask / -mask: a whole `Sampler` call with and without the batch's bitmask.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import random
import statistics
import time

import torch
import xgrammar

from deepinfer.engine.sampling.grammar_backend import GrammarState
from deepinfer.engine.sampling.sampler import Sampler
from deepinfer.engine.sampling.sampling_batch import build_sampling_batch
from deepinfer.engine.sampling.sampling_params import SamplingParams
from deepinfer.engine.sampling.token_bitmask import apply_token_bitmask, fill_token_bitmask, unpack_token_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "role", "active", "tags", "address"],
}
CHARSET = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "{}[]:,.-_@'


def synthetic_vocab(vocab_size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = ["<eos>"] + [chr(c) for c in range(0x20, 0x7F)]
    seen = set(vocab)
    while len(vocab) < vocab_size:
        token = "".join(rng.choice(CHARSET) for _ in range(rng.randint(2, 8)))
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    return vocab


def walked_states(compiled: object, batch_size: int, vocab_size: int, seed: int) -> list[GrammarState]:
    rng = random.Random(seed)
    states = []
    for _ in range(batch_size):
        state = GrammarState(xgrammar.GrammarMatcher(compiled))
        mask = torch.empty(1, (vocab_size + 31) // 32, dtype=torch.int32)
        for _ in range(rng.randint(0, 45)):
            state.fill_bitmask(mask, 0, expected_num_tokens=state.num_accepted)
            allowed = [t for t in unpack_token_bitmask(mask, vocab_size)[0].nonzero().flatten().tolist() if t]
            if not allowed:
                break
            assert state.accept_tokens([rng.choice(allowed)]) == 1
        states.append(state)
    return states


def median_ms(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def run(vocab_size: int, batch_size: int, iters: int) -> dict[str, float]:
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo(synthetic_vocab(vocab_size, seed=0), xgrammar.VocabType.RAW, stop_token_ids=[0])
    info_ms = (time.perf_counter() - start) * 1e3
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(SCHEMA, any_whitespace=False)
    compile_ms = (time.perf_counter() - start) * 1e3
    states = walked_states(compiled, batch_size, vocab_size, seed=1)
    num_out = [s.num_accepted for s in states]
    banned = [()] * batch_size
    step = fill_token_bitmask(states, num_out, banned, vocab_size)
    assert step is not None and not step.dead_rows
    logits = torch.randn(batch_size, vocab_size, generator=torch.Generator().manual_seed(2))
    rows = torch.arange(batch_size)
    in_place = logits.clone()
    params = {"greedy": SamplingParams(temperature=0), "temperature 0.8": SamplingParams(temperature=0.8)}
    result = {
        "tokenizer info ms": info_ms, "schema compile ms": compile_ms,
        "fill": median_ms(lambda: fill_token_bitmask(states, num_out, banned, vocab_size), iters),
        "apply (reference)": median_ms(lambda: apply_token_bitmask(logits, step.bitmask, rows), iters),
        "apply (xgrammar CPU kernel)": median_ms(
            lambda: xgrammar.apply_token_bitmask_inplace(in_place, step.bitmask, vocab_size=vocab_size), iters),
    }
    sampler = Sampler(seed=0)
    for name, p in params.items():
        common = {"rngs": [None] * batch_size, "num_output_tokens": num_out, "eos_token_ids": [0],
                  "vocab_size": vocab_size}
        plain = build_sampling_batch([p] * batch_size, **common)
        masked = build_sampling_batch([p] * batch_size, **common, token_bitmask=step.bitmask,
                                      bitmask_rows=list(range(batch_size)))
        result[f"sampler {name} -mask"] = median_ms(lambda b=plain: sampler(logits, b), iters)
        result[f"sampler {name} +mask"] = median_ms(lambda b=masked: sampler(logits, b), iters)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 129280])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    results = {v: run(v, args.batch_size, args.iters) for v in args.vocab_sizes}
    print(f"batch {args.batch_size}, torch {torch.__version__}, xgrammar {importlib.metadata.version('xgrammar')}, "
          f"{torch.get_num_threads()} torch threads")
    print("| ms | " + " | ".join(f"vocab {v}" for v in args.vocab_sizes) + " |")
    print("|---|" + "---:|" * len(args.vocab_sizes))
    for key in results[args.vocab_sizes[0]]:
        print(f"| {key} | " + " | ".join(f"{results[v][key]:.2f}" for v in args.vocab_sizes) + " |")


if __name__ == "__main__":
    main()
