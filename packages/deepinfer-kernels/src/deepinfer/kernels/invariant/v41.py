"""DeepSeek-V4.1 ops whose rows do not depend on the batch: single-pass mHC (the projection through the
tiled `linear`, sums over streams added stream after stream, the sigmoid from `_pointwise`), the Engram
gate, and the attention / index scores over packed rows (decoded as the reference does, then this
package's `sparse_attention` / `indexer_scores`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference.norm import rms_norm
from ..reference.v41_paged import v41_attention_rows, v41_entry_keys
from ._pointwise import sigmoid, sum_along
from .attention import indexer_scores, sparse_attention
from .linear import linear


def hc_mixes(streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, sinkhorn_iters: int, hc_eps: float,
             norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as `reference.hc_mixes`."""
    num_tokens, hc, _ = streams.shape
    mixes = linear(rms_norm(streams.reshape(num_tokens, -1).float(), None, norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    scale = scale.float()
    pre = sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.reshape(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (sum_along(comb, -2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (sum_along(comb, -1, keepdim=True) + hc_eps)
        comb = comb / (sum_along(comb, -2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: Tensor, pre: Tensor) -> Tensor:
    """Same contract as `reference.hc_collapse` (streams added one after another)."""
    return sum_along(pre.float().unsqueeze(-1) * streams.float(), 1).to(streams.dtype)


def hc_expand(block_out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Same contract as `reference.hc_expand` (the residual streams mixed one after another)."""
    mixed = sum_along(comb.float()[..., None] * residual.float()[:, :, None, :], 1)
    return (post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2) + mixed).to(residual.dtype)


def engram_gate(streams: Tensor, key: Tensor, weight: Tensor, eps: float, clamp: float = 1e-6) -> Tensor:
    """Same contract as `reference.engram_gate` (its sigmoid from position-independent primitives)."""
    h, k = streams.float(), key.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
    dot = (h * weight.float() * k).sum(-1) * rstd * h.shape[-1] ** -0.5
    return sigmoid(torch.copysign(dot.abs().clamp_min(clamp).sqrt(), dot))


def v41_attention(
    q: Tensor, positions: Tensor, ring: Tensor, slots: Tensor, window: int, sink: Tensor, scale: float,
    chunk_kv: Tensor | None = None, chunk_start: int = 0, paged: Tensor | None = None,
    block_tables: Tensor | None = None, entry_ids: Tensor | None = None, ratio: int = 1,
) -> Tensor:
    """Same contract as `reference.v41_attention`."""
    rows, valid = v41_attention_rows(q, positions, ring, slots, window, chunk_kv, chunk_start, paged, block_tables,
                                     entry_ids, ratio)
    return sparse_attention(q, rows, valid, sink, scale)


def v41_index_scores(
    q: Tensor, paged_keys: Tensor, block_tables: Tensor, num_entries: int, head_weights: Tensor,
    softmax_scale: float, ratio: int,
) -> Tensor:
    """Same contract as `reference.v41_index_scores`."""
    keys = v41_entry_keys(paged_keys, block_tables, num_entries, ratio, q.shape[-1])
    return indexer_scores(q, keys, head_weights, softmax_scale)
