"""The lightning indexer's scores of a prefill chunk in one launch: twin of `reference.indexer_scores`
(keys shared by every query).

One program per (block of keys, block of queries) keeps its [queries, keys] scores in registers and
adds one head after another: a tensor-core product of the head's query rows with the keys, ReLU,
times the head's weight. Nothing but the scores is written — no [queries, heads, keys] float32
products, no float32 copies of the queries or keys. Key blocks are the grid's fastest axis, so the
programs reading one query block run side by side and share its rows in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ._launch import on_triton, precision


@triton.jit
def _index_scores_kernel(
    q_ptr, keys_ptr, w_ptr, out_ptr, q_query, q_head, keys_row, w_query, out_query, num_queries, num_heads, dim,
    num_keys, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    nm = n < num_keys
    im = i < num_queries
    d = tl.arange(0, BLOCK_D)
    dm = d < dim
    keys = tl.load(keys_ptr + n.to(tl.int64)[:, None] * keys_row + d[None, :], mask=nm[:, None] & dm[None, :],
                   other=0.0)
    keys_t = tl.trans(keys.to(q_ptr.dtype.element_ty))
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    q_rows = q_ptr + i[:, None] * q_query + d[None, :]
    for h in range(num_heads):
        q = tl.load(q_rows + h * q_head, mask=im[:, None] & dm[None, :], other=0.0)
        w = tl.load(w_ptr + i * w_query + h, mask=im, other=0.0).to(tl.float32)
        dots = tl.dot(q, keys_t, input_precision=PRECISION)
        total += tl.maximum(dots, 0.0) * scale * w[:, None]
    tl.store(out_ptr + i[:, None] * out_query + n[None, :], total, mask=im[:, None] & nm[None, :])


def index_tiles(element_size: int, dim: int) -> dict[str, int]:
    """Tiles of `_index_scores_kernel`: two-byte types 64 queries × 128 keys (each program reads its
    64 query rows once per head: the wider the key block, the fewer times the queries are read);
    float32 small and unpipelined (the interpreter, shared memory)."""
    block_d = max(triton.next_power_of_2(dim), 16)
    if element_size > 2:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_D=block_d, num_warps=4, num_stages=1)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_D=block_d, num_warps=8, num_stages=3)


def indexer_scores_fused(q: Tensor, keys: Tensor, head_weights: Tensor, softmax_scale: float) -> Tensor:
    """Same contract as `reference.indexer_scores`; keys per query (3-D) run the reference."""
    if not on_triton(q) or keys.dim() != 2 or q.stride(-1) != 1 or keys.stride(-1) != 1:
        return reference.indexer_scores(q, keys, head_weights, softmax_scale)
    num_queries, num_heads, dim = q.shape
    num_keys = keys.shape[0]
    out = torch.empty(num_queries, num_keys, dtype=torch.float32, device=q.device)
    if num_queries == 0 or num_keys == 0:
        return out
    weights = head_weights.float().contiguous()
    tiles = index_tiles(q.element_size(), dim)
    _index_scores_kernel[(triton.cdiv(num_keys, tiles["BLOCK_N"]), triton.cdiv(num_queries, tiles["BLOCK_M"]))](
        q, keys, weights, out, q.stride(0), q.stride(1), keys.stride(0), weights.stride(0), out.stride(0),
        num_queries, num_heads, dim, num_keys, softmax_scale, PRECISION=precision(q), **tiles,
    )
    return out
