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


NORM_CASES = [((1, 64), True, torch.bfloat16), ((37, 4, 512), False, torch.bfloat16),
              ((5, 16384), False, torch.float32), ((9, 1024), True, torch.float32)]


@pytest.mark.parametrize(("shape", "weighted", "dtype"), NORM_CASES)
def test_fused_rms_norm_matches_reference(shape, weighted, dtype) -> None:
    pytest.importorskip("triton")
    from deepinfer.kernels.triton_ops import rms_norm_fused

    gen = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=gen) * 3).cuda().to(dtype)
    w = (1 + torch.randn(shape[-1], generator=gen) * 0.1).cuda() if weighted else None
    got = rms_norm_fused(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), reference.rms_norm(x, w, 1e-6).float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize(("shape", "rope_dim", "inverse"), [((3, 512), 64, False), ((6, 8, 512), 64, True),
                                                            ((11, 4, 128), 64, False), ((2, 16), 16, True)])
def test_fused_rope_matches_reference(shape, rope_dim, inverse) -> None:
    pytest.importorskip("triton")
    from deepinfer.kernels.triton_ops import apply_rope_fused

    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen).cuda().bfloat16()
    pos = torch.randint(0, 100000, (shape[0],), generator=gen).cuda()
    inv = reference.rope_inv_freq(rope_dim, 160000.0, reference.YarnScaling(16.0, 65536)).cuda()
    got = apply_rope_fused(x, pos, inv, inverse=inverse)
    want = reference.apply_rope(x, pos, inv, inverse=inverse)
    assert torch.equal(got[..., :-rope_dim], x[..., :-rope_dim])
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
