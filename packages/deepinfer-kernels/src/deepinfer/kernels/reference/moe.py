"""MoE routing (learned top-k and hash) and clamped SwiGLU experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..mxfp4_layout import unpack_mxfp4_from_decode
from .quant import FP8_E4M3_MAX, dequant_fp8_block, dequant_mxfp4

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def router_scores(logits: Tensor, scoring_func: str) -> Tensor:
    """Expert affinities from router logits [num_tokens, num_experts] (float32 out)."""
    logits = logits.float()
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"scoring_func={scoring_func!r} must be one of {SCORING_FUNCS}")


def select_experts(scores: Tensor, bias: Tensor | None, top_k: int) -> Tensor:
    """Top-k experts by `scores + bias` (bias affects selection only); ties → lowest expert id.

    Returns: [num_tokens, top_k] int64 expert ids.
    """
    keys = scores if bias is None else scores + bias.float()
    return torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :top_k]


def routing_weights(scores: Tensor, expert_ids: Tensor, *, normalize: bool, scaling: float) -> Tensor:
    """Gather the chosen experts' scores, optionally renormalise (sum + 1e-20), then × scaling.

    Args:
        scores: [num_tokens, num_experts] float32; expert_ids: [num_tokens, top_k] int64.
    Returns:
        [num_tokens, top_k] float32.
    """
    weights = scores.gather(1, expert_ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling


def route(
    logits: Tensor, bias: Tensor | None, top_k: int, *, scoring_func: str, normalize: bool, scaling: float
) -> tuple[Tensor, Tensor]:
    """Learned routing in one op: `router_scores`, `select_experts`, `routing_weights`.

    Args:
        logits: [num_tokens, num_experts] router logits; bias: [num_experts] float32 or None.
    Returns:
        (expert ids [num_tokens, top_k] int64, weights [num_tokens, top_k] float32).
    """
    scores = router_scores(logits, scoring_func)
    ids = select_experts(scores, bias, top_k)
    return ids, routing_weights(scores, ids, normalize=normalize, scaling=scaling)


def clamped_swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, limit: float) -> Tensor:
    """w2( silu(min(w1 x, limit)) · clamp(w3 x, −limit, limit) ).

    Args:
        x: [num_tokens, hidden]; w1, w3: [inter, hidden]; w2: [hidden, inter].
    Returns:
        [num_tokens, hidden].
    """
    gate = F.linear(x, w1).clamp(max=limit)
    up = F.linear(x, w3).clamp(min=-limit, max=limit)
    return F.linear(F.silu(gate) * up, w2)


def moe_experts(x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """Weighted sum of the routed experts' clamped SwiGLU outputs; only active experts run.

    Args:
        x: [num_tokens, hidden]; expert_ids, weights: [num_tokens, top_k];
        w13: [num_experts, 2 * inter, hidden] (w1 rows then w3 rows); w2: [num_experts, hidden, inter].
    Returns:
        [num_tokens, hidden] in x's dtype.
    """
    return _active_experts(x, expert_ids, weights, lambda e: (w13[e], w2[e]), limit)


def _active_experts(x: Tensor, expert_ids: Tensor, weights: Tensor,
                    expert: Callable[[int], tuple[Tensor, Tensor]], limit: float) -> Tensor:
    """The `moe_experts` computation, with `expert(e)` giving expert e's (w13, w2) matrices."""
    out = torch.zeros_like(x)
    flat_ids = expert_ids.reshape(-1)
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(expert_ids.shape[1])
    flat_weights = weights.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        rows = (flat_ids == e).nonzero(as_tuple=True)[0]
        tokens = token_of[rows]
        w13, w2 = expert(e)
        inter = w2.shape[-1]
        y = clamped_swiglu(x[tokens], w13[:inter], w13[inter:], w2, limit)
        out.index_add_(0, tokens, (y * flat_weights[rows, None].to(y.dtype)).to(out.dtype))
    return out


def moe_experts_fp8(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
    limit: float, block: int,
) -> Tensor:
    """`moe_experts` with FP8 block-scaled expert weights (each active expert dequantised, then the
    same computation in x's dtype).

    Args:
        x, expert_ids, weights, limit: as `moe_experts`.
        w13: [num_experts, 2 * inter, hidden] float8_e4m3fn; w13_scale: [num_experts, 2 * inter / block,
            hidden / block] float32; w2: [num_experts, hidden, inter] float8_e4m3fn; w2_scale: [num_experts,
            hidden / block, inter / block] float32; block: the scale block edge (128 for V4).
    Returns:
        [num_tokens, hidden] in x's dtype.
    """
    return _active_experts(x, expert_ids, weights, fp8_expert(w13, w13_scale, w2, w2_scale, block, x.dtype), limit)


def moe_experts_mxfp4(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
    limit: float, *, packed: bool = False,
) -> Tensor:
    """`moe_experts` with MXFP4 expert weights (each active expert dequantised, then the same
    computation in x's dtype).

    Args:
        x, expert_ids, weights, limit: as `moe_experts`.
        w13: [num_experts, 2 * inter, hidden / 2] uint8, two e2m1 codes per byte (low nibble first);
            w13_scale: [num_experts, 2 * inter, hidden / 32] uint8-coded e8m0; w2: [num_experts, hidden,
            inter / 2] uint8; w2_scale: [num_experts, hidden, inter / 32] uint8-coded e8m0.
        packed: w13 and w2 hold their codes in the layout of `mxfp4_layout.repack_mxfp4_for_decode`
            (same shapes; the scales as stored), not the checkpoint's.
    Returns:
        [num_tokens, hidden] in x's dtype.
    """
    expert = mxfp4_expert(w13, w13_scale, w2, w2_scale, x.dtype, packed=packed)
    return _active_experts(x, expert_ids, weights, expert, limit)


def fp8_expert(w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor, block: int,
               dtype: torch.dtype) -> Callable[[int], tuple[Tensor, Tensor]]:
    """e -> expert e's (w13, w2) dequantised from FP8 block-scaled storage to `dtype` (shapes as
    `moe_experts_fp8`); shared with the batch-invariant twin."""
    return lambda e: (dequant_fp8_block(w13[e], w13_scale[e], block).to(dtype),
                      dequant_fp8_block(w2[e], w2_scale[e], block).to(dtype))


def mxfp4_expert(w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor, dtype: torch.dtype, *,
                 packed: bool = False) -> Callable[[int], tuple[Tensor, Tensor]]:
    """e -> expert e's (w13, w2) dequantised from MXFP4 storage to `dtype` (shapes and `packed` as
    `moe_experts_mxfp4`); shared with the batch-invariant twin."""
    codes = unpack_mxfp4_from_decode if packed else _as_stored
    return lambda e: (dequant_mxfp4(codes(w13[e]), w13_scale[e]).to(dtype),
                      dequant_mxfp4(codes(w2[e]), w2_scale[e]).to(dtype))


def _as_stored(codes: Tensor) -> Tensor:
    return codes


def quant_fp8_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Activations → FP8 e4m3 with one float32 scale per 1 × `group` group of a row: the scale is the
    group's absolute maximum / 448 (1 for an all-zero group), each value divided by it, kept within
    ±448 and rounded to nearest.

    Args:
        x: [rows, cols] float, cols divisible by group.
    Returns:
        (codes [rows, cols] float8_e4m3fn, scales [rows, cols / group] float32).

    The scale is a true (correctly rounded) division, as the kernel's `tl.div_rn`: dividing a CUDA
    tensor by a Python number, torch multiplies by the number's float32 reciprocal instead (its
    CPU-scalar shortcut; "may lose one bit"), so on the GPU `amax / 448` was off by one ulp for some
    groups and the kernel's scales were not the twin's bit for bit. The divisor is a tensor here.
    """
    rows, cols = x.shape
    groups = x.float().reshape(rows, cols // group, group)
    amax = groups.abs().amax(-1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_E4M3_MAX), torch.ones_like(amax))
    codes = (groups / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(rows, cols), scale


def _fp8_groups_dequant(x: Tensor, group: int) -> Tensor:
    """x rounded through `quant_fp8_groups` and back (float32)."""
    codes, scale = quant_fp8_groups(x, group)
    rows, cols = x.shape
    return (codes.float().reshape(rows, cols // group, group) * scale[..., None]).reshape(rows, cols)


def moe_experts_fp8_w8a8(
    x: Tensor, expert_ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
    limit: float, block: int,
) -> Tensor:
    """`moe_experts_fp8` as DeepSeek's FP8 GEMMs compute it: the activations are quantised too, per
    1 × block group (`quant_fp8_groups`: each token's x before w13, each SwiGLU output row before
    w2), the products in float32; each pair's weighted output rounded to x's dtype, a token's top-k
    rows added in float32 in slot order. The twin of the grouped FP8 kernels
    (`triton_ops.moe_grouped`), which the CUDA `moe_experts_fp8` uses for large batches; its two
    stages are `swiglu_fp8_w8a8` and `down_fp8_w8a8`.

    Args and returns: as `moe_experts_fp8`.
    """
    num_tokens, top_k = expert_ids.shape
    act = swiglu_fp8_w8a8(x, expert_ids, w13, w13_scale, limit, block)
    pairs = down_fp8_w8a8(_fp8_groups_dequant(act, block), expert_ids, weights, w2, w2_scale, block, x.dtype)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for k in range(top_k):
        out += pairs.view(num_tokens, top_k, -1)[:, k].float()
    return out.to(x.dtype)


def swiglu_fp8_w8a8(x: Tensor, expert_ids: Tensor, w13: Tensor, w13_scale: Tensor, limit: float,
                    block: int) -> Tensor:
    """The first stage of `moe_experts_fp8_w8a8`: x quantised per 1 × block group, times each
    pair's expert's w13ᵀ in float32, the clamped SwiGLU; before its own quantisation.

    Args:
        x, expert_ids, w13, w13_scale, limit, block: as `moe_experts_fp8`.
    Returns:
        [num_tokens · top_k, inter] float32, row = pair id (token · top_k + slot).
    """
    top_k, inter = expert_ids.shape[1], w13.shape[1] // 2
    xq = _fp8_groups_dequant(x, block)
    flat_ids = expert_ids.reshape(-1)
    act = torch.zeros(flat_ids.numel(), inter, dtype=torch.float32, device=x.device)
    for e in torch.unique(flat_ids).tolist():
        rows = (flat_ids == e).nonzero(as_tuple=True)[0]
        h = xq[rows // top_k] @ dequant_fp8_block(w13[e], w13_scale[e], block).T
        gate, up = h[:, :inter].clamp(max=limit), h[:, inter:].clamp(min=-limit, max=limit)
        act[rows] = gate * torch.sigmoid(gate) * up
    return act


def down_fp8_w8a8(act: Tensor, expert_ids: Tensor, weights: Tensor, w2: Tensor, w2_scale: Tensor, block: int,
                  dtype: torch.dtype) -> Tensor:
    """The second stage of `moe_experts_fp8_w8a8`: each pair's activation row times its expert's
    w2ᵀ in float32, times its routing weight, rounded to `dtype`.

    Args:
        act: [num_tokens · top_k, inter] float32 (in the twin: the SwiGLU output rounded through
            `quant_fp8_groups`), row = pair id; expert_ids, weights, w2, w2_scale, block: as
            `moe_experts_fp8`.
    Returns:
        [num_tokens · top_k, hidden] in `dtype`, row = pair id.
    """
    flat_ids, flat_weights = expert_ids.reshape(-1), weights.reshape(-1).float()
    pairs = torch.zeros(flat_ids.numel(), w2.shape[1], dtype=dtype, device=act.device)
    for e in torch.unique(flat_ids).tolist():
        rows = (flat_ids == e).nonzero(as_tuple=True)[0]
        w2e = dequant_fp8_block(w2[e], w2_scale[e], block)
        pairs[rows] = ((act[rows] @ w2e.T) * flat_weights[rows, None]).to(dtype)
    return pairs
