"""Projections whose every output row is the same whatever the number of rows and the row's place.

A BLAS GEMM chooses its kernel, blocking and threading by the shape: with MKL on CPU, a row's
x @ Wᵀ changes in its last bits when the batch grows from 1 to 2 rows, and again from about 9 (it
depends on K and N). Here the rows are padded to whole tiles of ROW_TILE and each tile is one GEMM
of the fixed shape [ROW_TILE, in] × [in, out] into a buffer aligned like any other tile, so every row
sees the same kernel with the same reduction order along K. (One batched GEMM over the tiles is not
enough: torch's bmm splits its work by the number of tiles once it runs on several threads.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ROW_TILE = 32   # rows per GEMM; tiles of 32 rows start on 64-byte boundaries for 2- and 4-byte dtypes

Linear = Callable[[Tensor, Tensor], Tensor]


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `reference.linear`: x [..., in] @ weight [out, in]ᵀ → [..., out] in x's dtype."""
    k_in, n_out = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, k_in)
    num_rows = rows.shape[0]
    num_tiles = -(-num_rows // ROW_TILE)
    padded = rows.new_zeros(num_tiles * ROW_TILE, k_in)
    padded[:num_rows] = rows
    out = rows.new_empty(num_tiles * ROW_TILE, n_out)
    weight_t = weight.t()
    for tile in range(num_tiles):
        span = slice(tile * ROW_TILE, (tile + 1) * ROW_TILE)
        torch.mm(padded[span], weight_t, out=out[span])
    return out[:num_rows].view(*x.shape[:-1], n_out)


def grouped_linear(x: Tensor, weight: Tensor, *, linear: Linear = linear) -> Tensor:
    """Same contract as `reference.grouped_linear` (x [tokens, groups, in_per_group], weight
    [groups · out_per_group, in_per_group] → [tokens, groups, out_per_group]): one `linear` per group."""
    groups = x.shape[1]
    w = weight.view(groups, -1, x.shape[-1]).to(x.dtype)
    return torch.stack([linear(x[:, g], w[g]) for g in range(groups)], dim=1)
