"""V4.1 attention of a decode step, for all sequences at once (one query token each).

The same result as the per-sequence path of `csa2.Attention`, with static shapes and no host reads
of positions: the compressed entries a sequence may use are the first `max_context_len // ratio` of
its source (masked by visibility), a group that does not close this step writes into the reserved
block 0, and the published top-k and candidates are [num_seqs, …] tensors. So a decode step can be
captured in a CUDA graph keyed by the number of sequences. Attention and index scores read the packed
rows in place through the kernel set (`v41_attention`, `v41_index_scores`: Triton kernels on CUDA).

Multi-token decode (`ForwardBatch.multi_decode`, `max_query_len` = q > 1: the verify rows of
speculative decoding) runs through the same code with one virtual sequence per token, the tokens of
a row sharing its state slot and block table at consecutive positions s … s + q_row − 1, in any order
in the batch. It is exact because, for every state, all of a step's writes land before any read that
depends on them, and no write reaches a row that a token still reads (`check_rings` refuses shorter
rings than below before the forward writes anything: `cache_spec(max_backtracking >= q − 1)`):

- window rings: every token's row is stored (one scatter) before the attention reads the ring; the
  token at p reads p − window + 1 … p, and a later token of its row writes p' <= p + q − 1, whose
  ring row p' − ring_len lies before that window as long as the ring has window + q − 1 rows;
- ratio-2 compressor rings: every token's (kv, gate) is stored before any group is pooled, so the
  group a token closes at p pools p − 1 from an earlier token of the step or from the committed
  state; the step writes s … s + q − 1 and pools from s − 1 on: ratio + q − 1 rows;
- paged kv / index_k streams: a token that closes a group stores its entry (p // ratio) in its KV
  source layer, before any later index source or consumer layer reads the stream; a token that
  closes nothing writes into the reserved block 0. An entry closed by a later token of the row is
  beyond what an earlier token may see ((p + 1) // ratio entries): masked like any future entry;
- published top-k and candidates: [num_tokens, …] tensors, one row per virtual sequence, handed
  from the index sources to the layers after them inside the forward: nothing shared between tokens;
- the Engram history ring (`engram.EngramHasher`): the token at p hashes the ids at p − max_ngram
  + 1 … p. Those before its row's first position s in the step (each slot's least position, by a
  scatter-min: no host read) are read before the step writes its ids, those from s on (earlier
  tokens of the same step) after; max_ngram − 1 + q − 1 rows (see below; they hold the step's own
  q ids too, as max_ngram >= 2);
- DSpark capture rings (`mtp.{i}.window`, with a draft attached): written for every token after the
  last layer, read only by the next draft forward, over committed positions: window + q − 1 rows
  (the draft head asks for more);
- CED prefill truncation does not apply: each virtual sequence has one row.

Rejected drafts need nothing: a row's next step starts after its accepted run, at s >= the previous
start + 1, so the rows that rejected tokens wrote hold positions s … s + q − 2. This step rewrites
them before any token reads them (ring rows, compressor rows, history ids, closed entries), or
nothing reads them (entries not yet visible, positions past every window); and the spare rows keep
them off the committed rows the step reads: from s − window + 1 (window), s − 1 (compressor) and
s − max_ngram + 1 (history) up to s + q − 2 are no more positions than the ring has rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet
from deepinfer.kernels.reference.paged import entry_location

from ..batch import ForwardBatch
from ..cache import ModelCache
from ..config_v41 import DeepseekV41Config
from .engram import HISTORY
from .v41_codecs import Codecs


@dataclass
class Published:
    """What index sources hand to the layers after them during one forward: per sequence (`picks`,
    `candidates`), or for a whole decode batch at once (`batched_*`, see `attention` below)."""

    picks: list[Tensor | None] = field(default_factory=list)        # [q, k] entry ids, −1 none
    candidates: list[Tensor | None] = field(default_factory=list)   # [q, entries] bool
    batched_picks: Tensor | None = None                              # [num_seqs, k]
    batched_candidates: Tensor | None = None                         # [num_seqs, entries]


class DecodeLayer(Protocol):
    """What the batched decode reads of a `csa2.Attention` layer (typed here so that `csa2`, which
    calls this module, is not imported back)."""

    cfg: DeepseekV41Config
    layer: int
    ratio: int
    source: int
    attn_sink: Tensor
    wq_a: nn.Linear
    compressor: nn.Module | None
    indexer: nn.Module | None


def check_rings(cfg: DeepseekV41Config, cache: ModelCache, max_query_len: int) -> None:
    """Refuse a multi-token decode of `max_query_len` tokens per row whose state rings are too short
    (module docstring): each needs its own span (window, compress ratio, Engram look-back) plus
    max_query_len − 1 spare rows.

    Raises:
        ValueError: naming the first ring that is too short and the `cache_spec` field that sizes it.
    """
    spare = max_query_len - 1
    for name, rows in cache.state.items():
        if name == HISTORY:
            span = cfg.engram_max_ngram_size - 1
        elif name.endswith(".window"):                     # layers.{i}.window and the draft's mtp.{i}.window
            span = cfg.sliding_window
        elif ".compressor." in name:
            span = cfg.compress_ratios[int(name.split(".")[1])]
        else:
            continue
        if rows.shape[1] < span + spare:
            raise ValueError(f"{name}: a ring of {rows.shape[1]} rows cannot hold {max_query_len} query tokens per "
                             f"row (needs {span} + {spare}: cache_spec(max_backtracking >= {spare}))")


def _window(attn: DecodeLayer, kv: Tensor, batch: ForwardBatch, cache: ModelCache, codecs: Codecs) -> Tensor:
    """Store this token's row in its ring (before attending: the kernels read the window from the ring,
    and the row read back is the row the model attends to); returns every slot's ring."""
    rings = cache.state[f"layers.{attn.layer}.window"]
    rings[batch.state_slots, batch.positions % rings.shape[1]] = codecs.window.encode(kv)
    return rings


def _compress(attn: DecodeLayer, comp: tuple[Tensor, Tensor | None], batch: ForwardBatch, cache: ModelCache,
              ops: KernelSet, inv_freq: Tensor, codecs: Codecs) -> None:
    """Advance the KV source's compressor by one token per sequence; closed groups land in its streams."""
    cfg, r, pos, slots = attn.cfg, attn.ratio, batch.positions, batch.state_slots
    assert attn.compressor is not None, "called on KV sources only"
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


def _select(attn: DecodeLayer, index_q: Tensor, index_w: Tensor, batch: ForwardBatch, cache: ModelCache,
            ops: KernelSet, published: Published) -> None:
    """Every sequence's top-k over the first max_context_len // ratio index keys of its key source."""
    cfg, pos = attn.cfg, batch.positions
    src = cfg.key_source_of(attn.layer)
    assert src is not None and attn.indexer is not None, "called on index sources only"
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


def attention(attn: DecodeLayer, q: Tensor, kv: Tensor, index_q: Tensor | None, index_w: Tensor | None,
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
