"""Small building blocks shared by the layers."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet


class RMSNorm(nn.Module):
    """Weighted RMSNorm holding its weight in float32 (parameter `weight`, [dim])."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps


def add_hc_site_params(block: nn.Module, mix: int, stream_dim: int) -> None:
    """Give a layer block the mHC parameters of its two sites ("attn", "ffn"), official names:
    `hc_{site}_fn` [mix, stream_dim] (uninitialised: loaded), `hc_{site}_base` [mix] (zeros) and
    `hc_{site}_scale` [3] (ones)."""
    for site in ("attn", "ffn"):
        block.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, stream_dim)))
        block.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
        block.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))


def linear(dim_in: int, dim_out: int) -> nn.Linear:
    """A bias-free projection (weights stored [out, in])."""
    return nn.Linear(dim_in, dim_out, bias=False)


def matmul_t(x: Tensor, weight: Tensor, ops: KernelSet) -> Tensor:
    """x @ weightᵀ for the model's GEMMs that are not layer projections (the LM head, the indexer's
    Hadamard rotation): torch's matmul, or the kernel set's `linear` when the set is batch-invariant
    (a BLAS GEMM picks its kernel by the number of rows, so a row's result would depend on its batch)."""
    return ops.linear(x, weight) if ops.batch_invariant else x @ weight.t()


def stacked_weight(owner: nn.Module, name: str, projections: Sequence[nn.Linear]) -> Tensor:
    """One [Σ out, in] weight whose row blocks are the weights of `projections` (all reading the same
    input), so that a single GEMM / GEMV computes them all; split its output with
    `[p.out_features for p in projections]`.

    The first call concatenates the weights and makes each projection's weight a view of its block
    (no second copy); later calls return the cached tensor while those views are intact, and rebuild
    it after a weight was replaced (e.g. by `load_state_dict(assign=True)`). Cached as the plain
    attribute `name` of `owner` (not a parameter or buffer: checkpoints keep the official names).
    """
    cached = owner.__dict__.get(name)
    if cached is not None:
        offset = 0
        for p in projections:
            w = p.weight
            if w.data_ptr() != cached[offset:].data_ptr() or w.shape[0] != p.out_features:
                break
            offset += p.out_features
        else:
            return cached
    with torch.no_grad():
        weight = torch.cat([p.weight for p in projections])
    offset = 0
    for p in projections:
        p.weight = nn.Parameter(weight[offset:offset + p.out_features], requires_grad=p.weight.requires_grad)
        offset += p.out_features
    owner.__dict__[name] = weight
    return weight


@functools.cache
def hadamard(dim: int, device: torch.device | str = "cpu") -> Tensor:
    """Orthonormal Sylvester–Hadamard matrix [dim, dim] (dim a power of two), float32 (cached)."""
    if dim & (dim - 1):
        raise ValueError(f"hadamard dim={dim} must be a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(dim)).to(device)
