"""The tiny DeepSeek-V4.1 model run with the V4.1 Triton kernels (attention and index scores over the
packed rows, the cache-row quantisation) against the reference kernel set: prefill, a chunk, batched
decode steps.

- Under Triton's CPU interpreter (TRITON_INTERPRET=1, `./dev.sh test` runs it so), float32 on CPU
  tensors: the reference set with only the V4.1 ops swapped for their kernels (the whole CUDA set under
  the interpreter takes minutes).
- On a CUDA device (gpu-marked): the whole CUDA set (every Triton kernel) against the reference set,
  both on the GPU, in float32 and bfloat16.

Tolerances (logits of order 1): the kernels sum in another order, and a last-bit difference can move a
value across an FP8 / FP4 rounding boundary of a later layer's cache row. Logits are compared to 1e-4
(float32, V4.1 kernels only; 1.7e-6 measured), 1e-2 (float32, every kernel: TF32-free, but more sums
reordered) and 6e-2 (bfloat16).
"""

from __future__ import annotations

import os

import pytest
import torch
from v41_helpers import tiny_model

from deepinfer.kernels import KernelSet, kernels_for
from deepinfer.model import ForwardBatch, ModelCache

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
V41_KERNELS = ("v41_attention", "v41_index_scores", "quant_mxfp8_rows", "quant_fp4_rows", "fake_quant_mxfp8",
               "fake_quant_fp4_rows")


def run(model, ops, seqs, cuts, device, block_size=8) -> list[torch.Tensor]:
    """Logits of every token per sequence, fed in steps of `cuts` tokens (all sequences each step);
    steps of one token per sequence run the batched decode path."""
    spec = model.cache_spec(block_size, 2)
    tables = [list(range(1 + 5 * i, 6 + 5 * i)) for i in range(len(seqs))]
    cache = ModelCache.allocate(spec, 1 + 5 * len(seqs), len(seqs) + 1, device=device)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    start = 0
    for cut in cuts:
        batch = ForwardBatch.build([s[start:start + cut] for s in seqs], [start] * len(seqs), tables,
                                   list(range(1, len(seqs) + 1)), logits="all", device=device)
        assert batch.uniform_decode == (cut == 1)
        with torch.no_grad():
            logits = model(batch, cache, ops)
        for i in range(len(seqs)):
            out[i].append(logits[batch.cu_seqlens[i]:batch.cu_seqlens[i + 1]].float().cpu())
        start += cut
    return [torch.cat(o) for o in out]


def _compare(device: str, dtype: torch.dtype, ops: KernelSet, atol: float, cuts: list[int], num_seqs: int) -> None:
    model = tiny_model(seed=3).to(device, dtype)
    model.reset_rope()
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, 96, (sum(cuts),), generator=gen).tolist() for _ in range(num_seqs)]
    got = run(model, ops, seqs, cuts, device)
    want = run(model, kernels_for("cpu"), seqs, cuts, device)
    for g, w in zip(got, want):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, w, atol=atol, rtol=0)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_cuda_kernel_set_matches_the_reference_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    from deepinfer.kernels import triton_ops

    ops = KernelSet("cpu")                                    # a fresh set: the cached one stays the reference
    for name in V41_KERNELS:
        setattr(ops, name, getattr(triton_ops, f"{name}_fused"))
    _compare("cpu", torch.float32, ops, 1e-4, [10, 5, 1], 1)     # prefill, a chunk, a decode step


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_kernel_set_matches_the_reference_on_the_gpu(dtype) -> None:
    """The reference set on CUDA tensors (the twins) against the Triton set, both on the GPU."""
    ops = KernelSet("cuda")
    assert all(ops.sources[name] == "cuda" for name in V41_KERNELS)
    _compare("cuda", dtype, ops, 1e-2 if dtype == torch.float32 else 6e-2, [17, 9, 1, 1, 1, 1], 3)
