"""Self-distillation data for the DSpark draft head: the frozen embedded model's own greedy text.

    python tools/train_tiny/draft_data.py --model packages/deepinfer-model/src/deepinfer/model/embedded \
        --data out/tiny

Each sequence is a `--prompt-len`-token window of the train split (seeded random start) followed by
the target's greedy continuation of `--gen-len` − 1 tokens (the last greedy token is never fed),
generated with DeepInfer's own runtime (batched prefill, then batched decode steps). While it
generates, the target's forward hands the draft's input features (hc-mean of the outputs of
`dspark_target_layer_ids`, concatenated) to a recorder attached in the draft head's place, so the
features are exactly those the engine writes into the draft rings. Writes `--out` (default `draft_data.pt` in `--data`):

- `token_ids` [num_seqs, seq_len] int64: prompt + continuation;
- `greedy_ids` [num_seqs, seq_len] int64: the target's argmax after each position (in the
  continuation, the next token itself);
- `features` [num_seqs, seq_len, hidden · num_targets] float32;
- `seq_lens` [num_seqs] int64: a continuation that produced `<|eos|>` ends there;
- `prompt_len` int64 scalar: where the continuations begin.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from tokenizer import EOS_ID
from torch import Tensor

from deepinfer.kernels import KernelSet
from deepinfer.model import DeepseekV4ForCausalLM, ForwardBatch, ModelCache, load_model

BLOCK_SIZE = 16


class FeatureRecorder:
    """Attached with `DeepseekV4ForCausalLM.attach_draft` in a draft head's place: keeps the features
    the target's forward passes to `write_context`, one tensor per forward."""

    def __init__(self) -> None:
        self.features: list[Tensor] = []

    def write_context(self, features: Tensor, batch: ForwardBatch, cache: ModelCache, ops: KernelSet) -> None:
        self.features.append(features.float().clone())


def generate(model: DeepseekV4ForCausalLM, prompts: list[list[int]], gen_len: int) -> dict[str, Tensor]:
    """Greedy continuations of equally long prompts, with the target features of every position."""
    num_seqs, prompt_len = len(prompts), len(prompts[0])
    blocks = -(-(prompt_len + gen_len) // BLOCK_SIZE)
    cache = ModelCache.allocate(model.cache_spec(BLOCK_SIZE), num_seqs * blocks + 1, num_seqs + 1)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(num_seqs)]
    slots = list(range(1, num_seqs + 1))
    recorder = FeatureRecorder()
    model.attach_draft(recorder)
    try:
        with torch.no_grad():
            logits = model(ForwardBatch.build(prompts, [0] * num_seqs, tables, slots, logits="all"), cache)
            greedy = [logits.argmax(-1).view(num_seqs, prompt_len)]
            for step in range(gen_len - 1):
                feed = greedy[-1][:, -1:]
                batch = ForwardBatch.build(feed.tolist(), [prompt_len + step] * num_seqs, tables, slots)
                greedy.append(model(batch, cache).argmax(-1).view(num_seqs, 1))
    finally:
        model.attach_draft(None)
    greedy_ids = torch.cat(greedy, dim=1)
    token_ids = torch.cat((torch.tensor(prompts), greedy_ids[:, prompt_len - 1:-1]), dim=1)
    first = recorder.features[0].view(num_seqs, prompt_len, -1)
    rest = [f.view(num_seqs, 1, -1) for f in recorder.features[1:]]
    features = torch.cat([first, *rest], dim=1)
    seq_lens = torch.full((num_seqs,), token_ids.shape[1], dtype=torch.int64)
    for i, row in enumerate(token_ids[:, prompt_len:].tolist()):
        if EOS_ID in row:
            seq_lens[i] = prompt_len + row.index(EOS_ID) + 1
    return {"token_ids": token_ids, "greedy_ids": greedy_ids, "features": features, "seq_lens": seq_lens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("out/tiny"))
    parser.add_argument("--out", type=Path, help="default: DATA/draft_data.pt")
    parser.add_argument("--num-seqs", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--gen-len", type=int, default=224)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32, device="cpu")
    train = np.load(args.data / "train.npy").astype(np.int64)
    starts = np.random.default_rng(args.seed).integers(0, train.size - args.prompt_len, size=args.num_seqs)
    parts: list[dict[str, Tensor]] = []
    begin = time.perf_counter()
    for first in range(0, args.num_seqs, args.batch):
        prompts = [train[s:s + args.prompt_len].tolist() for s in starts[first:first + args.batch]]
        parts.append(generate(model, prompts, args.gen_len))
        print(f"{first + len(prompts)}/{args.num_seqs} sequences, {time.perf_counter() - begin:.0f} s", flush=True)
    data = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    data["prompt_len"] = torch.tensor(args.prompt_len)
    torch.save(data, args.out or args.data / "draft_data.pt")


if __name__ == "__main__":
    main()
