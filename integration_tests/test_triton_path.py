"""The CUDA kernel set — every Triton kernel the GPU decode path uses — driving the model on CPU under
Triton's interpreter, against transformers: packed prefill, then batched decode steps, over a cache
laid out by deepinfer-cache's planner (state regions strided by slot, as the engine has them).

Runs when TRITON_INTERPRET=1 (`./dev.sh test` runs it so); the same kernels on the H200 are covered
by packages/deepinfer-kernels/tests/test_triton_ops.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_twin import hf_model
from hf_twin import hf_logits, twin

from deepinfer.cache import PagedStream, StateRegion, plan_paged_layout, plan_state_layout
from deepinfer.kernels import KernelSet
from deepinfer.model import ForwardBatch, ModelCache

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
FUSED = ("apply_rope", "clamped_swiglu", "compress_decode", "hc_post", "hc_pre", "indexer_scores", "linear",
         "moe_experts", "moe_experts_fp8", "moe_experts_mxfp4", "norm_rope", "paged_decode_attention",
         "paged_indexer_scores", "prefill_attention", "rms_norm", "route", "sparse_attention", "topk_lowest_index")


def planned_cache(model, block_size: int, num_blocks: int, num_slots: int) -> ModelCache:
    spec = model.cache_spec(block_size)
    state = plan_state_layout([StateRegion(r.name, r.num_bytes, r.stored) for r in spec.states], num_slots)
    paged = plan_paged_layout([PagedStream(s.name, s.bytes_per_row, s.tokens_per_row) for s in spec.streams],
                              block_size, num_blocks=num_blocks)
    return ModelCache.from_buffers(
        spec, torch.zeros(paged.total_bytes, dtype=torch.uint8), {n: p.offset for n, p in paged.streams.items()},
        paged.num_blocks, torch.zeros(state.total_bytes, dtype=torch.uint8),
        {n: r.offset for n, r in state.regions.items()}, num_slots, state.slot_bytes)


def test_cuda_kernel_set_matches_transformers_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    hf, raw = hf_model(seed=5)
    ours = twin(hf, raw)
    ops = KernelSet("cuda")
    assert all(ops.sources[name] == "cuda" for name in FUSED)
    cache = planned_cache(ours, block_size=16, num_blocks=12, num_slots=4)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (21, 14)]
    tables, slots = [[3, 1, 5], [2, 4, 6]], [2, 1]
    with torch.no_grad():
        logits = ours(ForwardBatch.build(seqs, [0, 0], tables, slots, logits="last"), cache, ops)
        for _ in range(3):      # positions 21-23 and 14-16: close ratio-4 and ratio-8 windows, cross a block
            for i, seq in enumerate(seqs):
                torch.testing.assert_close(logits[i], hf_logits(hf, seq)[-1], atol=1e-4, rtol=0)
            nxt = [int(row.argmax()) for row in logits]
            positions = [len(s) for s in seqs]
            for seq, t in zip(seqs, nxt):
                seq.append(t)
            batch = ForwardBatch.build([[t] for t in nxt], positions, tables, slots, logits="last")
            assert batch.uniform_decode
            logits = ours(batch, cache, ops)


@pytest.mark.parametrize(("expert_dtype", "repack"), [("fp8", False), ("fp4", False), ("fp4", True)],
                         ids=["fp8", "fp4", "fp4-repacked"])
def test_quantised_experts_through_the_cuda_kernel_set_match_the_reference_ops(expert_dtype, repack) -> None:
    """A model whose routed experts are FP8 (blocks of 16) or MXFP4 (as stored, or re-packed for the
    `packed` decoder as the loader does on CUDA with `MXFP4_REPACK`): the CUDA kernel set under the
    interpreter against the reference ops, through packed prefill and batched decode steps."""
    pytest.importorskip("triton")
    from deepinfer.kernels import kernels_for
    from deepinfer.model import DeepseekV4Config, DeepseekV4ForCausalLM

    hf, raw = hf_model(seed=7, moe_intermediate_size=64)
    raw = {**raw, "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    float_model = twin(hf, raw)
    ours = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(raw), expert_dtype=expert_dtype)
    state = {k: v for k, v in float_model.state_dict().items() if ".ffn.experts." not in k}
    ours.load_state_dict(state, strict=False)
    for block, source in zip(ours.layers, float_model.layers, strict=True):
        for e in range(source.ffn.experts.w13.shape[0]):
            block.ffn.experts.quantise_(e, source.ffn.experts.w13[e].detach(), source.ffn.experts.w2[e].detach())
        if repack:
            block.ffn.experts.repack_for_decode_()
    ours.eval()
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (13, 6)]
    tables, slots = [[3, 1, 5], [2, 4, 6]], [2, 1]
    caches = {name: planned_cache(ours, block_size=16, num_blocks=12, num_slots=4) for name in ("cuda", "ref")}
    kernel_sets = {"cuda": KernelSet("cuda"), "ref": kernels_for("cpu")}
    batch = ForwardBatch.build(seqs, [0, 0], tables, slots, logits="last")
    with torch.no_grad():
        for step in range(2):   # the packed prefill, then one batched decode step
            logits = {n: ours(batch, caches[n], kernel_sets[n]) for n in caches}
            torch.testing.assert_close(logits["cuda"], logits["ref"], atol=1e-4, rtol=0, msg=f"step {step}")
            nxt = [int(row.argmax()) for row in logits["ref"]]
            positions = [len(s) for s in seqs]
            for seq, t in zip(seqs, nxt, strict=True):
                seq.append(t)
            batch = ForwardBatch.build([[t] for t in nxt], positions, tables, slots, logits="last")
