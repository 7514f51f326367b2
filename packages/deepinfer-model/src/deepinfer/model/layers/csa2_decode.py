"""V4.1 attention of a decode step, for all sequences at once (one query token each).

The same result as the per-sequence path of `csa2.Attention`, with static shapes and no host reads
of positions: the compressed entries a sequence may use are the first `max_context_len // ratio` of
its source (masked by visibility), a group that does not close this step writes into the reserved
block 0, and the published top-k and candidates are [num_seqs, …] tensors. So a decode step can be
captured in a CUDA graph keyed by the number of sequences. Attention and index scores read the packed
rows in place through the kernel set (`v41_attention`, `v41_index_scores`: Triton kernels on CUDA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from deepinfer.kernels import KernelSet
from deepinfer.kernels.reference.paged import entry_location

from ..batch import ForwardBatch
from ..cache import ModelCache

if TYPE_CHECKING:
    from .csa2 import Attention, Codecs, Published


def _window(attn: Attention, kv: Tensor, batch: ForwardBatch, cache: ModelCache, codecs: Codecs) -> Tensor:
    """Store this token's row in its ring (before attending: the kernels read the window from the ring,
    and the row read back is the row the model attends to); returns every slot's ring."""
    rings = cache.state[f"layers.{attn.layer}.window"]
    rings[batch.state_slots, batch.positions % rings.shape[1]] = codecs.window.encode(kv)
    return rings


def _compress(attn: Attention, comp: tuple[Tensor, Tensor | None], batch: ForwardBatch, cache: ModelCache,
              ops: KernelSet, inv_freq: Tensor, codecs: Codecs) -> None:
    """Advance the KV source's compressor by one token per sequence; closed groups land in its streams."""
    cfg, r, pos, slots = attn.cfg, attn.ratio, batch.positions, batch.state_slots
    kv, gate = comp
    if gate is None:
        latents, closes = kv, torch.ones_like(pos, dtype=torch.bool)
    else:
        acc_k = cache.state[f"layers.{attn.layer}.compressor.kv"]
        acc_g = cache.state[f"layers.{attn.layer}.compressor.gate"]
        ring_len = acc_k.shape[1]
        acc_k[slots, pos % ring_len] = kv
        acc_g[slots, pos % ring_len] = gate
        group = (pos - pos % r)[:, None] + torch.arange(r, device=pos.device)[None, :]       # [n, r]
        kk, gg = acc_k[slots[:, None], group % ring_len], acc_g[slots[:, None], group % ring_len]
        pooled = (kk * gg.softmax(dim=1)).sum(dim=1)
        latents = ops.rms_norm(pooled.to(attn.wq_a.weight.dtype), attn.compressor.norm.weight, cfg.rms_norm_eps)
        closes = (pos + 1) % r == 0
    ids = torch.div(pos, r, rounding_mode="floor")
    blocks, rows, _ = entry_location(batch.block_tables, ids[:, None], r, cache.spec.block_size)
    blocks, rows = torch.where(closes[:, None], blocks, 0)[:, 0], rows[:, 0]     # open groups: dummy block 0
    if attn.indexer is not None:
        ix = attn.indexer
        keys = ops.rms_norm(ops.linear(latents, ix.wk.weight), ix.k_norm.weight, cfg.rms_norm_eps)
        cache.paged[f"layers.{attn.layer}.index_k"][blocks, rows] = codecs.index.encode(
            ops.apply_rope(keys, ids * r, inv_freq))
    cache.paged[f"layers.{attn.layer}.kv"][blocks, rows] = codecs.kv.encode(ops.apply_rope(latents, ids * r, inv_freq))


def _select(attn: Attention, index_q: Tensor, index_w: Tensor, batch: ForwardBatch, cache: ModelCache,
            ops: KernelSet, published: Published) -> None:
    """Every sequence's top-k over the first max_context_len // ratio index keys of its key source."""
    cfg, pos = attn.cfg, batch.positions
    src = cfg.key_source_of(attn.layer)
    r_src = cfg.compress_ratios[src]
    num_keys = batch.max_context_len // r_src
    if num_keys == 0:
        return
    ids = torch.arange(num_keys, device=pos.device)
    scores = ops.v41_index_scores(index_q, cache.paged[f"layers.{src}.index_k"], batch.block_tables, num_keys, index_w,
                                  attn.indexer.head_dim**-0.5, r_src)
    visible = torch.minimum(torch.div(pos + 1, attn.ratio, rounding_mode="floor"),
                            torch.div(pos + 1, r_src, rounding_mode="floor"))
    scores = scores.masked_fill(ids[None, :] >= visible[:, None], float("-inf"))
    candidate = cfg.candidate_source_layer_id
    if attn.layer == candidate:
        published.batched_candidates = ops.candidate_blocks(scores, visible, cfg.candidate_topk_blocks,
                                                            cfg.candidate_block_size)
    elif 0 <= candidate < attn.layer and published.batched_candidates is not None:
        allowed = published.batched_candidates
        width = min(allowed.shape[1], num_keys)
        outside = torch.ones_like(scores, dtype=torch.bool)
        outside[:, :width] = ~allowed[:, :width]
        scores = scores.masked_fill(outside, float("-inf"))
    published.batched_picks = ops.topk_finite(scores, cfg.index_topk)


def attention(attn: Attention, q: Tensor, kv: Tensor, index_q: Tensor | None, index_w: Tensor | None,
              comp: tuple[Tensor, Tensor | None] | None, batch: ForwardBatch, cache: ModelCache, ops: KernelSet,
              inv_freq: Tensor, codecs: Codecs, published: Published) -> Tensor:
    """[num_seqs, heads, head_dim]: the layer's attention for one query token per sequence, read from the
    packed rings and compressed rows by `ops.v41_attention`."""
    cfg = attn.cfg
    rings = _window(attn, kv, batch, cache, codecs)
    paged = entry_ids = None
    r = 1
    if attn.ratio:
        if comp is not None:
            _compress(attn, comp, batch, cache, ops, inv_freq, codecs)
        if index_q is not None and cfg.key_source_of(attn.layer) is not None:
            _select(attn, index_q, index_w, batch, cache, ops, published)
        picks = published.batched_picks
        if picks is not None:
            r = cfg.compress_ratios[attn.source]
            num_entries = torch.div(batch.positions + 1, r, rounding_mode="floor")
            entry_ids = torch.where((picks >= 0) & (picks < num_entries[:, None]), picks, -1)
            paged = cache.paged[f"layers.{attn.source}.kv"]
    return ops.v41_attention(q, batch.positions, rings, batch.state_slots, cfg.sliding_window, attn.attn_sink,
                             cfg.head_dim**-0.5, None, 0, paged, batch.block_tables if paged is not None else None,
                             entry_ids, r)
