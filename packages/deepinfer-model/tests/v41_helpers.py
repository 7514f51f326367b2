"""Tiny V4.1 models and a step runner for the tests."""

from __future__ import annotations

import torch
from v41_configs import tiny_text

from deepinfer.model import DeepseekV41Config, DeepseekV41ForCausalLM, ForwardBatch, ModelCache


def tiny_model(seed: int = 0, **overrides) -> DeepseekV41ForCausalLM:
    """A seeded tiny V4.1 model whose inert-by-default parameters (sinks, mHC bases, router biases,
    Engram q/k weights) are perturbed so that bugs in those paths show; identity token map."""
    cfg = DeepseekV41Config.from_dict(tiny_text(**overrides))
    model = DeepseekV41ForCausalLM(cfg, token_map=torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size)
    model.init_weights(seed, std=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("attn_sink", "bias", "bias_vl") or name.endswith("_base"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif leaf in ("q_weight", "k_weight") or name.endswith("_scale") or "norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.2)
            elif ".engram.embed." in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    return model.eval()


def run_chunks(model: DeepseekV41ForCausalLM, seqs: list[list[int]], cuts: list[list[int]], *,
               block_size: int = 8, backtracking: int = 2, device: str = "cpu") -> list[torch.Tensor]:
    """Feed each sequence in chunks of the given lengths (all sequences in each step, one batch);
    returns the logits of every token, per sequence."""
    spec = model.cache_spec(block_size, backtracking)
    num_blocks = 1 + sum(-(-len(s) // block_size) for s in seqs)
    cache = ModelCache.allocate(spec, num_blocks, len(seqs) + 1, device=device)
    tables, nxt = [], 1
    for s in seqs:
        n = -(-len(s) // block_size)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    starts = [0] * len(seqs)
    for step in range(max(len(c) for c in cuts)):
        active = [i for i, c in enumerate(cuts) if step < len(c)]
        batch = ForwardBatch.build([seqs[i][starts[i]:starts[i] + cuts[i][step]] for i in active],
                                   [starts[i] for i in active], [tables[i] for i in active],
                                   [i + 1 for i in active], logits="all", device=device)
        with torch.no_grad():
            logits = model(batch, cache)
        for k, i in enumerate(active):
            out[i].append(logits[batch.cu_seqlens[k]:batch.cu_seqlens[k + 1]])
            starts[i] += cuts[i][step]
    return [torch.cat(o) for o in out]
