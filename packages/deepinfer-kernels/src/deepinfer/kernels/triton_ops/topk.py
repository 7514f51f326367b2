"""Top-k with lowest-index tie-breaking in one launch: twin of `reference.topk_lowest_index`.

One program per row sorts (score, index) pairs packed into one int64 key — the score's float32 bits
mapped to an order-preserving signed integer in the high half, `BLOCK − 1 − index` in the low half —
so a plain descending bitonic sort orders by score, then by lowest index. Rows longer than
`MAX_KEYS` run the reference (a sort in memory).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ._launch import on_triton

MAX_KEYS = 8192


@triton.jit
def _topk_kernel(scores_ptr, visible_ptr, out_ptr, num_keys, width, scores_stride,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    visible = tl.load(visible_ptr + row)
    live = (i < num_keys) & (i < visible)
    x = tl.load(scores_ptr + row * scores_stride + i, mask=live, other=0.0)
    x = tl.where(x == 0.0, 0.0, x)                               # −0.0 ties with 0.0, as in a sort
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)                   # signed order == float order
    key = (ordered.to(tl.int64) << 32) | (BLOCK - 1 - i).to(tl.int64)
    key = tl.where(live, key, -9223372036854775807 - 1)
    top = tl.sort(key, descending=True)
    index = (BLOCK - 1) - (top & 0xFFFFFFFF)
    j = tl.arange(0, BLOCK)
    keep = j < tl.minimum(visible, width)
    tl.store(out_ptr + row * width + j, tl.where(keep, index, -1), mask=j < width)


def topk_lowest_index_fused(scores: Tensor, num_visible: Tensor, k: int) -> Tensor:
    """Same contract as `reference.topk_lowest_index` (rows of at most MAX_KEYS keys)."""
    num_rows, num_keys = scores.shape
    width = min(k, num_keys)
    if not on_triton(scores) or num_keys > MAX_KEYS or scores.stride(-1) != 1 or width == 0 or num_rows == 0:
        return reference.topk_lowest_index(scores, num_visible, k)
    out = torch.empty(num_rows, width, dtype=torch.int64, device=scores.device)
    block = triton.next_power_of_2(num_keys)
    _topk_kernel[(num_rows,)](scores.float(), num_visible.contiguous(), out, num_keys, width, scores.stride(0),
                              BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out
