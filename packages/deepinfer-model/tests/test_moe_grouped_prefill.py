"""Prefill of a tiny DeepSeek-V4 with the routed experts on the grouped GEMM kernels of prefill
(`triton_ops.moe_grouped`, forced here from one pair: `GROUPED_MIN_PAIRS = 1`), against the reference
kernel set: bf16-style plain, FP8 block-scaled (blocks of 16) and MXFP4 experts.

Runs under Triton's CPU interpreter (TRITON_INTERPRET=1; `./dev.sh test` runs it so), float32, with
the reference set's three expert ops swapped for their CUDA implementations (the whole CUDA set under
the interpreter takes minutes; integration_tests/test_triton_path.py runs it at the small-batch
kernels). The stated tolerance: prefill logits within 1e-4 of the reference path whose expert op is
the grouped kernels' twin — `reference.moe_experts` / `_mxfp4`, and for FP8 `moe_experts_fp8_w8a8`
(activations quantised per 1 × block group, as DeepSeek's FP8 GEMMs and the grouped kernels do).
Against the FP8 reference with bfloat16 activations (`moe_experts_fp8`, what the small-batch kernels
compute) the FP8 path's logits differ by the activations' e4m3 rounding: within 5% of the logits'
largest magnitude here (measured: 0.56%, 3.0e-3 of 0.54).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hf_twin import hf_model, twin

from deepinfer.kernels import kernels_for
from deepinfer.model import DeepseekV4Config, DeepseekV4ForCausalLM, ForwardBatch, ModelCache

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def quantised_model(expert_dtype: str | None) -> DeepseekV4ForCausalLM:
    """The tiny model (every layer type, 4 experts of width 64, top-2), its routed experts in
    `expert_dtype` (FP8 with 16 × 16 blocks)."""
    hf, raw = hf_model(seed=7, moe_intermediate_size=64)
    raw = {**raw, "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    float_model = twin(hf, raw)
    if expert_dtype is None:
        return float_model
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(raw), expert_dtype=expert_dtype)
    model.load_state_dict({k: v for k, v in float_model.state_dict().items() if ".ffn.experts." not in k},
                          strict=False)
    for block, source in zip(model.layers, float_model.layers, strict=True):
        for e in range(source.ffn.experts.w13.shape[0]):
            block.ffn.experts.quantise_(e, source.ffn.experts.w13[e].detach(), source.ffn.experts.w2[e].detach())
    return model.eval()


def prefill_logits(model: DeepseekV4ForCausalLM, ops) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (21, 9)]
    cache = ModelCache.allocate(model.cache_spec(16), num_blocks=12, num_slots=4)
    batch = ForwardBatch.build(seqs, [0, 0], [[3, 1, 5], [2, 4, 6]], [2, 1], logits="last")
    with torch.no_grad():
        return model(batch, cache, ops)


@pytest.mark.parametrize("expert_dtype", [None, "fp8", "fp4"])
def test_prefill_logits_through_the_grouped_expert_kernels(expert_dtype, monkeypatch) -> None:
    pytest.importorskip("triton")
    from deepinfer.kernels.reference.moe import moe_experts_fp8_w8a8
    from deepinfer.kernels.triton_ops import moe, moe_grouped

    launches = []
    grouped = moe_grouped.grouped_experts
    monkeypatch.setattr(moe_grouped, "grouped_experts", lambda *a: launches.append(a[6]) or grouped(*a))
    monkeypatch.setattr(moe, "GROUPED_MIN_PAIRS", 1)
    monkeypatch.setattr(moe, "GROUPED_FP8", True)
    model = quantised_model(expert_dtype)
    reference_set = kernels_for("cpu")
    fast = copy.copy(reference_set)
    fast.moe_experts, fast.moe_experts_fp8 = moe.moe_experts_fused, moe.moe_experts_fp8_fused
    fast.moe_experts_mxfp4 = moe.moe_experts_mxfp4_fused
    twin_set = copy.copy(reference_set)
    twin_set.moe_experts_fp8 = moe_experts_fp8_w8a8
    got = prefill_logits(model, fast)
    code = {None: moe.PLAIN, "fp8": moe.FP8_BLOCK, "fp4": moe.MXFP4}[expert_dtype]
    assert launches == [code] * len(model.layers)                # every layer's experts took the grouped kernels
    torch.testing.assert_close(got, prefill_logits(model, twin_set), atol=1e-4, rtol=0)
    if expert_dtype == "fp8":
        plain = prefill_logits(model, reference_set)
        assert (got - plain).abs().max() <= 0.05 * plain.abs().max()
