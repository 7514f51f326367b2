"""mHC mixing weights in one kernel: sigmoid pre/post and the Sinkhorn-normalised comb matrix.

The reference `hc_pre` spends ~4 small kernels per Sinkhorn iteration (20 iterations, 2 sites per
layer); here one program handles BLOCK_T tokens' (2 + hc)·hc mixes end to end in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference


@triton.jit
def _hc_mix_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, num_tokens, iters, hc_eps,
                   HC: tl.constexpr, BLOCK_T: tl.constexpr):
    WIDTH: tl.constexpr = (2 + HC) * HC
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < num_tokens
    h = tl.arange(0, HC)
    c = tl.arange(0, HC * HC)
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    pre_w = tl.load(mix_ptr + rows[:, None] * WIDTH + h[None, :], mask=live[:, None], other=0.0)
    post_w = tl.load(mix_ptr + rows[:, None] * WIDTH + HC + h[None, :], mask=live[:, None], other=0.0)
    pre = tl.sigmoid(pre_w * s_pre + tl.load(base_ptr + h)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(post_w * s_post + tl.load(base_ptr + HC + h)[None, :])
    tl.store(pre_ptr + rows[:, None] * HC + h[None, :], pre, mask=live[:, None])
    tl.store(post_ptr + rows[:, None] * HC + h[None, :], post, mask=live[:, None])
    comb_w = tl.load(mix_ptr + rows[:, None] * WIDTH + 2 * HC + c[None, :], mask=live[:, None], other=0.0)
    logits = tl.reshape(comb_w * s_comb + tl.load(base_ptr + 2 * HC + c)[None, :], (BLOCK_T, HC, HC))
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps                 # softmax over k, + eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)          # columns (sum over j)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)      # rows
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)      # columns
    tl.store(comb_ptr + rows[:, None] * (HC * HC) + c[None, :], tl.reshape(comb, (BLOCK_T, HC * HC)),
             mask=live[:, None])


def hc_pre_fused(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as `deepinfer.kernels.reference.hc_pre` (CUDA tensors; hc a power of two,
    else the reference runs)."""
    num_tokens, hc, _ = streams.shape
    if not streams.is_cuda or hc & (hc - 1) or num_tokens == 0:
        return reference.hc_pre(streams, fn, scale, base, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps,
                                norm_eps=norm_eps)
    mixes = (reference.rms_norm(streams.reshape(num_tokens, -1).float(), None, norm_eps) @ fn.float().t()).contiguous()
    pre = torch.empty(num_tokens, hc, dtype=torch.float32, device=streams.device)
    post = torch.empty_like(pre)
    comb = torch.empty(num_tokens, hc, hc, dtype=torch.float32, device=streams.device)
    block_t = 32
    _hc_mix_kernel[(triton.cdiv(num_tokens, block_t),)](
        mixes, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, num_tokens,
        sinkhorn_iters, hc_eps, HC=hc, BLOCK_T=block_t,
    )
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb
