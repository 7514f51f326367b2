"""Tiny V4.1 models and a step runner for the tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


def place_like_the_loader(model: DeepseekV41ForCausalLM, dtype: torch.dtype) -> DeepseekV41ForCausalLM:
    """The model in `dtype` the way `build_model_v41` places a loaded one: the tensors of
    `keeps_fp32_v41` (mHC, sinks, router biases) and the RoPE frequencies stay float32."""
    from deepinfer.model.model_v41 import keeps_fp32_v41

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and not keeps_fp32_v41(name):
                p.data = p.data.to(dtype)
    return model


@contextlib.contextmanager
def bf16_dots_under_the_interpreter() -> Iterator[None]:
    """Let `tl.dot` take bfloat16 operands under Triton's CPU interpreter.

    The interpreter keeps bfloat16 values as their uint16 bit patterns and its `create_dot` hands
    those to numpy as integers (Triton 3.6), so a bfloat16 product there is meaningless; inside this
    context the operands are widened to float32 first (exact: a bf16 × bf16 product fits float32, as
    on the GPU's tensor cores, which accumulate in float32). Everything else the kernels do in
    bfloat16 (loads, stores, casts) the interpreter already handles."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain_dot = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        values = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(values, tl.float32)

    def create_dot(self, a, b, d, *args):
        return plain_dot(self, widen(a), widen(b), d, *args)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = plain_dot
