"""TileLang kernels against their reference twins (CUDA with TileLang installed, e.g. the H200 with
the device bundle; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _tilelang():
    pytest.importorskip("tilelang")


def _inputs(rows: int, k_in: int, n_out: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k_in, generator=gen).to("cuda", dtype)
    w = (torch.randn(n_out + 4, k_in, generator=gen) * k_in**-0.5).to("cuda", dtype)[2:n_out + 2]  # a row block
    return x, w


@pytest.mark.parametrize(("k_in", "n_out"), [(4096, 4160), (1024, 40960), (8192, 4096), (2048, 4096), (4096, 256),
                                             (1024, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tilelang_gemv_matches_reference(k_in, n_out, dtype) -> None:
    from deepinfer.kernels.tilelang_ops import linear_tilelang
    from deepinfer.kernels.tilelang_ops.gemv import supported

    x, w = _inputs(1, k_in, n_out, dtype, k_in + n_out)
    assert supported(x, w)
    torch.full((1 << 24,), float("nan"), device="cuda")     # poison what the output may reuse
    got = linear_tilelang(x, w)
    assert got.shape == (1, n_out) and got.dtype == dtype and not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), reference.linear(x, w).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("rows", "k_in", "n_out", "dtype"), [
    (1, 300, 64, torch.bfloat16), (2, 4096, 4096, torch.bfloat16), (1, 1024, 7, torch.bfloat16),
    (1, 1024, 64, torch.float32)])
def test_other_shapes_take_the_triton_gemv(rows, k_in, n_out, dtype) -> None:
    from deepinfer.kernels.tilelang_ops import linear_tilelang
    from deepinfer.kernels.tilelang_ops.gemv import supported

    x, w = _inputs(rows, k_in, n_out, dtype, rows * k_in)
    assert not supported(x, w)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(linear_tilelang(x, w).float(), reference.linear(x, w).float(), atol=tol, rtol=tol)


def test_tilelang_gemv_replays_in_a_cuda_graph() -> None:
    from deepinfer.kernels.tilelang_ops import linear_tilelang

    x, w = _inputs(1, 4096, 4160, torch.bfloat16, 7)
    linear_tilelang(x, w)                                     # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear_tilelang(x, w)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y.float(), reference.linear(x, w).float(), atol=2e-2, rtol=2e-2)


def test_registry_routes_projections_and_shared_expert_through_tilelang() -> None:
    """On CUDA with TileLang, `linear` is the TileLang GEMV and the shared expert uses it for its
    stacked gate + up projection and its down projection (V4-Flash shapes, one token)."""
    from deepinfer.kernels import kernels_for
    from deepinfer.kernels.tilelang_ops import linear_tilelang

    ops = kernels_for("cuda")
    assert ops.linear is linear_tilelang and ops.clamped_swiglu.keywords["linear"] is linear_tilelang
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, 4096, generator=gen).to("cuda", torch.bfloat16)
    w13 = (torch.randn(4096, 4096, generator=gen) * 4096**-0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(4096, 2048, generator=gen) * 2048**-0.5).to("cuda", torch.bfloat16)
    w1, w3 = w13[:2048], w13[2048:]
    got = ops.clamped_swiglu(x, w1, w3, w2, 10.0)
    torch.testing.assert_close(got.float(), reference.clamped_swiglu(x, w1, w3, w2, 10.0).float(), atol=3e-2,
                               rtol=3e-2)
