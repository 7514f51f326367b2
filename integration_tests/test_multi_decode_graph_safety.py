"""The model's multi-token decode path (`ForwardBatch.multi_decode`, the verify forward of speculative
decoding) is CUDA-graph safe, checked on CPU:

- no host read: the forward runs under the engine's `forbid_cuda_sync` emulation, which raises on
  every tensor call that would read device memory on the host (the routed experts' CPU twin, which
  lists its active experts on the host, is exempt: on CUDA the Triton expert kernels run with a fixed
  grid and are already captured in the one-token decode graphs); DeepSeek-V4.1's path too;
- the CUDA kernel set under Triton's interpreter (TRITON_INTERPRET=1) gives the per-sequence path's
  logits with each row's tokens fed in reverse order, so the fused compressor kernel's programs run
  later positions first: the rows of earlier tokens are in the compressor rings before any program
  pools a window only because the path writes them beforehand (`batched_decode._prewrite`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer.engine.device.sync_guard import forbid_cuda_sync
from deepinfer.kernels import KernelSet
from deepinfer.model import DeepseekV4Config, DeepseekV4ForCausalLM, ForwardBatch, ModelCache
from deepinfer.model.layers import batched_decode

RAW = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 16,
    "qk_rope_head_dim": 4, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "sliding_window": 8,
    "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 3, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_intermediate_size": 16, "num_hash_layers": 1, "hc_mult": 2, "hc_sinkhorn_iters": 3,
    "max_position_embeddings": 256,
}
Q = 6                                   # most query tokens per row
TABLES = [[3, 1, 5, 7], [2, 4, 6, 8]]
SLOTS = [2, 1]


def _setup(prompt_lens: tuple[int, ...]) -> tuple[DeepseekV4ForCausalLM, ModelCache, list[list[int]]]:
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(RAW))
    model.init_weights(0, std=0.1)
    model.eval()
    cache = ModelCache.allocate(model.cache_spec(16, Q), num_blocks=9, num_slots=3)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 64, (n,), generator=gen).tolist() for n in prompt_lens]
    with torch.no_grad():
        model(ForwardBatch.build(prompts, [0] * len(prompts), TABLES, SLOTS), cache)
    return model, cache, prompts


def _flat(chunks: list[list[int]], starts: list[int], reverse: bool) -> tuple[np.ndarray, ...]:
    """(token ids, positions, rows) of the rows' tokens, each row's in position order or reversed."""
    order = [list(range(len(c)))[::-1] if reverse else list(range(len(c))) for c in chunks]
    tokens = np.array([c[j] for c, o in zip(chunks, order) for j in o])
    positions = np.array([s + j for s, o in zip(starts, order) for j in o])
    rows = np.array([i for i, o in enumerate(order) for _ in o])
    return tokens, positions, rows


def test_the_multi_token_forward_reads_nothing_on_the_host() -> None:
    model, cache, prompts = _setup((10, 21))
    _guarded_multi_token_step(model, cache, TABLES, max_context_len=64)


def _guarded_multi_token_step(model, cache, tables: list[list[int]], *, max_context_len: int) -> None:
    """Rows of 2 and 5 tokens at 10 and 21 through `ForwardBatch.multi_decode` under the sync guard
    (the experts' host-side grouping exempted, as a CUDA graph runs it on the device); finite logits."""
    ops = KernelSet("cpu")
    experts = ops.moe_experts

    def experts_unguarded(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return experts(*args, **kwargs)

    ops.moe_experts = experts_unguarded
    tokens, positions, rows = (torch.from_numpy(a) for a in _flat([[5, 6], [7, 8, 9, 10, 11]], [10, 21], False))
    with torch.no_grad(), forbid_cuda_sync(torch.device("cpu")):
        batch = ForwardBatch.multi_decode(tokens, positions, rows, torch.tensor(tables, dtype=torch.int32),
                                          torch.tensor(SLOTS), max_query_len=Q, max_context_len=max_context_len)
        logits = model(batch, cache, ops)
    assert logits.shape == (7, model.cfg.vocab_size) and torch.isfinite(logits).all()


def test_the_v41_multi_token_forward_reads_nothing_on_the_host() -> None:
    """DeepSeek-V4.1's multi-token decode (`layers.csa2_decode`: ring checks, the Engram hasher's
    scatter-min, the two-level indexer) with a DSpark draft attached, under the same guard."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "packages" / "deepinfer-model" / "tests"))
    from v41_helpers import tiny_model

    from deepinfer.model import DSparkDraft

    model = tiny_model(seed=1, dspark_block_size=Q - 1, dspark_noise_token_id=95, dspark_markov_rank=8,
                       dspark_n_routed_experts=3, dspark_num_experts_per_tok=2)
    draft = DSparkDraft(model, 1)
    draft.init_weights(2, std=0.1)
    model.attach_draft(draft.eval())
    cache = ModelCache.allocate(model.cache_spec(8, Q), num_blocks=9, num_slots=3)
    tables = [[3, 1, 5, 7], [2, 4, 6, 8]]
    with torch.no_grad():
        model(ForwardBatch.build([list(range(4, 14)), list(range(20, 41))], [0, 0], tables, SLOTS), cache)
    _guarded_multi_token_step(model, cache, tables, max_context_len=32)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_the_cuda_kernel_set_runs_rows_in_any_order(monkeypatch) -> None:
    pytest.importorskip("triton")
    ops = KernelSet("cuda")
    assert ops.sources["compress_decode"] == "cuda" and ops.sources["paged_decode_attention"] == "cuda"
    chunks, starts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]], [13, 22]     # close ratio-4 and ratio-8 windows
    model, want_cache, _ = _setup(tuple(starts))
    with torch.no_grad():
        want = model(ForwardBatch.build(chunks, starts, TABLES, SLOTS, logits="all"), want_cache)
    tokens, positions, rows = _flat(chunks, starts, reverse=True)
    batch = ForwardBatch.multi_decode(tokens, positions, rows, np.array(TABLES), np.array(SLOTS), max_query_len=Q)
    back = torch.from_numpy(np.argsort(np.concatenate([[0, 1, 2, 3, 4, 5][::-1], [8, 7, 6]]), kind="stable"))
    for prewrite in (True, False):
        if not prewrite:
            monkeypatch.setattr(batched_decode, "_prewrite", lambda *args: None)
        _, cache, _ = _setup(tuple(starts))
        with torch.no_grad():
            got = model(batch, cache, ops)[back]
        if prewrite:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        else:       # the check is live: without the pre-write, windows pool stale ring rows
            assert (got - want).abs().max() > 1e-3
