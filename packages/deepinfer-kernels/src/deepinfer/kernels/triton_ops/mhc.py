"""mHC in two launches per site: the mixing weights + collapse, and the expansion (DeepSeek-V4.1's
single-pass mHC: the weights alone, `hc_mixes_fused`, the collapse by a given pre, and the same
expansion).

`hc_pre_fused`: the projection GEMM runs on the raw streams (the RMS normalisation has no weight, so
it is a per-token scale applied after the GEMM) — for ≤ 4 tokens as split-K partials of the GEMV,
which the next kernel adds up; then programs per (token, channel chunk) compute
that scale, sigmoid pre/post, the Sinkhorn-normalised comb matrix, and their chunk of the collapsed
stream — instead of ~90 small ops. `hc_post_fused`: one program per (token, channel block)
expands the block output and adds the comb-mixed residual. `hc_pre_invariant` (batch-invariant): the
projection as 8 split-K partials of the fixed-tile GEMM (`gemm.py`) at every token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import invariant, reference
from ._launch import on_triton
from .gemm import gemm_partials_invariant
from .gemv import MAX_ROWS, gemv_partials

_SPLITS = 8     # K ranges of the mHC projection (hc·dim long) for ≤ MAX_ROWS tokens


@triton.jit
def _mix(mix_ptr, offsets, split_stride, SPLITS: tl.constexpr):
    """Sum of the SPLITS partial projections at `offsets`."""
    total = tl.load(mix_ptr + offsets)
    for s in tl.static_range(1, SPLITS):
        total += tl.load(mix_ptr + s * split_stride + offsets)
    return total


@triton.jit
def _hc_pre_kernel(streams_ptr, mix_ptr, base_ptr, scale_ptr, collapsed_ptr, pre_ptr, post_ptr, comb_ptr, dim, iters,
                   hc_eps, norm_eps, split_stride, HC: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SQ: tl.constexpr, COLLAPSE: tl.constexpr):
    """Program (token t, chunk) recomputes the token's weights (cheap, from L2) and, with COLLAPSE,
    collapses channels chunk·BLOCK_D … with them (V4's `hc_pre`); chunk 0 stores post and comb, and
    without COLLAPSE pre (V4.1's `hc_mixes`, one chunk per token). The projection comes as SPLITS
    split-K partials (split_stride apart), added here in order."""
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    h = tl.arange(0, HC)
    row = streams_ptr + t * HC * dim
    squares = tl.zeros([HC, BLOCK_SQ], tl.float32)
    for d0 in range(0, dim, BLOCK_SQ):
        d = d0 + tl.arange(0, BLOCK_SQ)
        x = tl.load(row + h[:, None] * dim + d[None, :], mask=(d < dim)[None, :], other=0.0).to(tl.float32)
        squares += x * x
    inv_rms = tl.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / (HC * dim) + norm_eps)
    width = (2 + HC) * HC
    mix = mix_ptr + t * width
    pre = tl.sigmoid(_mix(mix, h, split_stride, SPLITS) * inv_rms * tl.load(scale_ptr) + tl.load(base_ptr + h)) + hc_eps
    post = 2.0 * tl.sigmoid(_mix(mix, HC + h, split_stride, SPLITS) * inv_rms * tl.load(scale_ptr + 1)
                            + tl.load(base_ptr + HC + h))
    tl.store(post_ptr + t * HC + h, post, mask=(h < HC) & (chunk == 0))
    c = tl.arange(0, HC * HC)
    logits = (_mix(mix, 2 * HC + c, split_stride, SPLITS) * inv_rms * tl.load(scale_ptr + 2)
              + tl.load(base_ptr + 2 * HC + c))
    logits = tl.reshape(logits, (HC, HC))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps                # softmax over k, + eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)         # columns (sum over j)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)     # rows
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)     # columns
    tl.store(comb_ptr + t * HC * HC + c, tl.reshape(comb, (HC * HC,)), mask=(c < HC * HC) & (chunk == 0))
    if COLLAPSE:
        d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
        x = tl.load(row + h[:, None] * dim + d[None, :], mask=(d < dim)[None, :], other=0.0).to(tl.float32)
        out = tl.sum(pre[:, None] * x, axis=0)
        tl.store(collapsed_ptr + t * dim + d, out.to(collapsed_ptr.dtype.element_ty), mask=d < dim)
    else:
        tl.store(pre_ptr + t * HC + h, pre, mask=(h < HC) & (chunk == 0))


def hc_pre_fused(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as `deepinfer.kernels.reference.hc_pre` (hc a power of two, else the reference)."""
    return _site_op(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, collapse=True, fixed_tiles=False,
                    twin=reference.hc_pre)


def hc_pre_invariant(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as `reference.hc_pre`, batch-invariant: the projection as `_SPLITS` float32 split-K
    partials of `gemm_partials_invariant` at any token count (tiles independent of it), added in order
    by the kernel. Where the kernels do not apply: the PyTorch twin `invariant.hc_pre`."""
    return _site_op(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, collapse=True, fixed_tiles=True,
                    twin=invariant.hc_pre)


def hc_mixes_fused(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as `reference.hc_mixes` (DeepSeek-V4.1's single-pass mHC weights): the projection
    as `hc_pre_fused` runs it, then one program per token (hc a power of two, else the reference)."""
    return _site_op(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, collapse=False, fixed_tiles=False,
                    twin=reference.hc_mixes)


def hc_mixes_invariant(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as `reference.hc_mixes`, batch-invariant as `hc_pre_invariant` (else the PyTorch
    twin `invariant.hc_mixes`)."""
    return _site_op(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, collapse=False, fixed_tiles=True,
                    twin=invariant.hc_mixes)


def _site_op(streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, sinkhorn_iters: int, hc_eps: float,
             norm_eps: float, *, collapse: bool, fixed_tiles: bool, twin) -> tuple[Tensor, Tensor, Tensor]:
    """One mHC site's weights (and, with `collapse`, the collapsed streams) through `_hc_pre_kernel`: the
    projection by `_projection`, or with `fixed_tiles` as split-K partials of the batch-invariant GEMM;
    `twin` where the kernel does not apply (no Triton device, hc not a power of two, no tokens)."""
    num_tokens, hc, _ = streams.shape
    if not on_triton(streams) or hc & (hc - 1) or num_tokens == 0:
        return twin(streams, fn, scale, base, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps)
    src = streams.contiguous()
    if fixed_tiles:
        mixes = gemm_partials_invariant(src.view(num_tokens, -1).float(), fn.float(), _SPLITS)
    else:
        mixes = _projection(src, fn)
    return _site(src, mixes, base, scale, sinkhorn_iters, hc_eps, norm_eps, collapse=collapse)


def _projection(src: Tensor, fn: Tensor) -> Tensor:
    """The raw streams [t, hc, dim] projected by fn [(2 + hc)·hc, hc·dim]: [splits, t, (2 + hc)·hc]
    float32 partials (split-K GEMV for ≤ MAX_ROWS tokens: 24 outputs are too few programs), else one."""
    flat, fn = src.view(src.shape[0], -1), fn.float().contiguous()
    if src.shape[0] <= MAX_ROWS:
        return gemv_partials(flat, fn, _SPLITS)
    return (flat.float() @ fn.t()).contiguous()[None]


def _site(src: Tensor, mixes: Tensor, base: Tensor, scale: Tensor, sinkhorn_iters: int, hc_eps: float,
          norm_eps: float, *, collapse: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Launch `_hc_pre_kernel` on contiguous streams [t, hc, dim] and their projection's partials
    [splits, t, (2 + hc)·hc] float32: (collapsed, post, comb) with `collapse`, else (pre, post, comb)."""
    num_tokens, hc, dim = src.shape
    post = torch.empty(num_tokens, hc, dtype=torch.float32, device=src.device)
    comb = torch.empty(num_tokens, hc, hc, dtype=torch.float32, device=src.device)
    block_d = min(triton.next_power_of_2(dim), 512)
    if collapse:
        first = torch.empty(num_tokens, dim, dtype=src.dtype, device=src.device)
        chunks = triton.cdiv(dim, block_d)
    else:
        first = torch.empty(num_tokens, hc, dtype=torch.float32, device=src.device)
        chunks = 1
    _hc_pre_kernel[(num_tokens, chunks)](
        src, mixes, base.float().contiguous(), scale.float().contiguous(), first, first, post, comb, dim,
        sinkhorn_iters, hc_eps, norm_eps, mixes.stride(0), HC=hc, SPLITS=mixes.shape[0], BLOCK_D=block_d,
        BLOCK_SQ=min(triton.next_power_of_2(dim), 8192 // hc), COLLAPSE=collapse,
        num_warps=2,   # H200: 5.6 µs vs 8.2 with 8 warps
    )
    return first, post, comb


@triton.jit
def _hc_collapse_kernel(streams_ptr, pre_ptr, out_ptr, dim, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    h = tl.arange(0, HC)
    x = tl.load(streams_ptr + t * HC * dim + h[:, None] * dim + d[None, :], mask=(d < dim)[None, :],
                other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + t * HC + h).to(tl.float32)
    out = tl.sum(pre[:, None] * x, axis=0)
    tl.store(out_ptr + t * dim + d, out.to(out_ptr.dtype.element_ty), mask=d < dim)


def hc_collapse_fused(streams: Tensor, pre: Tensor) -> Tensor:
    """Same contract as `reference.hc_collapse` (float32 products, one rounding): one program per
    (token, channel block), so each row is independent of the batch (hc a power of two, else the
    reference)."""
    num_tokens, hc, dim = streams.shape
    if not on_triton(streams) or hc & (hc - 1) or num_tokens == 0:
        return reference.hc_collapse(streams, pre)
    out = torch.empty(num_tokens, dim, dtype=streams.dtype, device=streams.device)
    block_d = min(triton.next_power_of_2(dim), 512)
    _hc_collapse_kernel[(num_tokens, triton.cdiv(dim, block_d))](
        streams.contiguous(), pre.float().contiguous(), out, dim, HC=hc, BLOCK_D=block_d, num_warps=4)
    return out


@triton.jit
def _hc_post_kernel(x_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, dim, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < dim
    h = tl.arange(0, HC)
    x = tl.load(x_ptr + t * dim + d, mask=dm, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + t * HC * dim + h[:, None] * dim + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + t * HC * HC + h[:, None] * HC + h[None, :])               # [j, k]
    post = tl.load(post_ptr + t * HC + h)
    out = post[:, None] * x[None, :] + tl.sum(comb[:, :, None] * res[:, None, :], axis=0)
    tl.store(out_ptr + t * HC * dim + h[:, None] * dim + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=dm[None, :])


def hc_post_fused(block_out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Same contract as `deepinfer.kernels.reference.hc_post` (float32 arithmetic, one rounding)."""
    num_tokens, hc, dim = residual.shape
    if not on_triton(residual) or hc & (hc - 1) or num_tokens == 0:
        return reference.hc_post(block_out, residual, post, comb)
    res = residual.contiguous()
    out = torch.empty_like(res)
    block_d = min(triton.next_power_of_2(dim), 512)
    _hc_post_kernel[(num_tokens, triton.cdiv(dim, block_d))](
        block_out.contiguous(), res, post.float().contiguous(), comb.float().contiguous(), out, dim,
        HC=hc, BLOCK_D=block_d, num_warps=4,
    )
    return out


def hc_expand_fused(block_out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Same contract as `reference.hc_expand` (DeepSeek-V4.1's expansion is V4's `hc_post`)."""
    return hc_post_fused(block_out, residual, post, comb)
