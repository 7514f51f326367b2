"""Device-agnostic fast paths against their reference twins (CPU here; the same tests run on CUDA)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import kernels_for, reference
from deepinfer.kernels.torch_ops import moe_experts_grouped

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts"), [(1, 1, 4), (7, 2, 4), (33, 6, 16), (5, 3, 64)])
def test_grouped_moe_matches_reference(device, num_tokens, top_k, num_experts) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    hidden, inter = 32, 48
    dtype = torch.bfloat16 if device == "cuda" else torch.float32      # CUDA grouped GEMM: bf16
    x = (torch.randn(num_tokens, hidden, generator=gen) * 4).to(device)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(device)
    wts = torch.rand(num_tokens, top_k, generator=gen).to(device)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.3).to(device)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.3).to(device)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    out = moe_experts_grouped(x, ids, wts, w13, w2, 10.0).float()
    ref = reference.moe_experts(x.float(), ids, wts, w13.float(), w2.float(), 10.0)
    # bf16 rounds the hidden activations between the two GEMMs: compare against the output's scale
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_registry_uses_grouped_moe_in_bf16() -> None:
    ops = kernels_for("cuda")
    assert ops.sources["moe_experts"] == "cuda"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen).cuda().bfloat16()
    ids = torch.stack([torch.randperm(32, generator=gen)[:6] for _ in range(64)]).cuda()
    wts = torch.rand(64, 6, generator=gen).cuda()
    w13 = (torch.randn(32, 512, 256, generator=gen) * 0.05).cuda().bfloat16()
    w2 = (torch.randn(32, 256, 256, generator=gen) * 0.05).cuda().bfloat16()
    ref = reference.moe_experts(x.float(), ids, wts, w13.float(), w2.float(), 10.0)
    torch.testing.assert_close(ops.moe_experts(x, ids, wts, w13, w2, 10.0).float(), ref, atol=3e-2, rtol=3e-2)
