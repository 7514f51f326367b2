"""Triton kernels against their reference twins (GPU only; skipped without CUDA or triton)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("num_tokens", "hc", "iters"), [(1, 4, 20), (7, 2, 3), (33, 4, 1), (300, 4, 20), (65, 8, 5)])
def test_fused_hc_pre_matches_reference(num_tokens, hc, iters) -> None:
    pytest.importorskip("triton")
    from deepinfer.kernels.triton_ops import hc_pre_fused

    gen = torch.Generator().manual_seed(num_tokens + hc)
    dim = 64
    streams = torch.randn(num_tokens, hc, dim, generator=gen).cuda().bfloat16()
    fn = (torch.randn((2 + hc) * hc, hc * dim, generator=gen) * 0.2).cuda()
    scale = (1 + torch.randn(3, generator=gen) * 0.3).cuda()
    base = torch.randn((2 + hc) * hc, generator=gen).cuda()
    kwargs = dict(sinkhorn_iters=iters, hc_eps=1e-6, norm_eps=1e-6)
    got = hc_pre_fused(streams, fn, scale, base, **kwargs)
    want = reference.hc_pre(streams, fn, scale, base, **kwargs)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and not torch.isnan(g).any()
        torch.testing.assert_close(g.float(), w.float(), atol=2e-3, rtol=2e-3)
