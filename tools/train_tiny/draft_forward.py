"""The DSpark draft head's training forward, made of DeepInfer's own draft modules.

`DSparkDraft.propose` drafts from window rings that the target's forward filled one position at a
time; training wants many anchors at once, with gradients. `draft_forward` gives each anchor a ring
of its own (a "state slot" per anchor) filled with the keys of its `sliding_window` preceding
positions, computed exactly as `DSparkDraft.write_context` computes them, then runs the head's own
`DraftStage` modules over [anchor, noise × (k − 1)] and the head's collapse, norm, shared LM head,
Markov correction and confidence projection as `propose` does, teacher-forcing the Markov walk with
the given previous tokens. `test_draft_forward.py` checks that a head gives the same logits and
confidences through both paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer.kernels import kernels_for
from deepinfer.model import DSparkDraft


@dataclass(frozen=True, slots=True)
class DraftOutput:
    """Per anchor and block position j (the guess for position anchor + j + 1)."""

    logits: Tensor              # [num_anchors, k, vocab] float32, Markov-corrected
    confidence_logits: Tensor   # [num_anchors, k] float32, before the sigmoid


def context_keys(draft: DSparkDraft, features: Tensor) -> list[Tensor]:
    """Every stage's window keys of every position: features [num_seqs, seq_len, hidden · num_targets]
    → per stage [num_seqs, seq_len, head_dim] (sequences start at position 0)."""
    cfg, stage0, ops = draft.cfg, draft.mtp[0], kernels_for(features.device)
    num_seqs, seq_len, _ = features.shape
    flat = features.reshape(num_seqs * seq_len, -1)
    main_x = ops.rms_norm(ops.linear(flat, stage0.main_proj.weight), stage0.main_norm.weight, cfg.rms_norm_eps)
    positions = torch.arange(seq_len, device=features.device).repeat(num_seqs)
    inv_freq = draft.target.main_inv_freq
    return [stage.attn.keys(main_x, positions, ops, inv_freq, False).view(num_seqs, seq_len, -1)
            for stage in draft.mtp]


def draft_forward(draft: DSparkDraft, keys: list[Tensor], seq_index: Tensor, anchor_positions: Tensor,
                  anchor_ids: Tensor, prev_ids: Tensor) -> DraftOutput:
    """Draft one block per anchor, with gradients.

    Args:
        keys: `context_keys` of the sequences the anchors are in.
        seq_index: [num_anchors] int64, the anchor's sequence (row of `keys`).
        anchor_positions: [num_anchors] int64, its position (>= 1: the rings hold positions before it).
        anchor_ids: [num_anchors] int64, the token at that position.
        prev_ids: [num_anchors, k] int64, the Markov walk's input per block position (column 0 is the
            anchor, column j the draft before draft j; `propose` feeds its own greedy drafts).
    """
    cfg, target, ops = draft.cfg, draft.target, kernels_for(anchor_ids.device)
    num_anchors, k, window = anchor_ids.shape[0], draft.block_size, cfg.sliding_window
    ring_len = window + k + 1
    context = anchor_positions[:, None] - window + torch.arange(window, device=anchor_ids.device)[None, :]
    slots = torch.arange(num_anchors, device=anchor_ids.device)
    # Positions before 0 are masked in the attention; clamped to 0 they rewrite position 0's own key.
    context = context.clamp(min=0)
    tokens = torch.full((num_anchors, k), cfg.dspark_noise_token_id, dtype=torch.int64, device=anchor_ids.device)
    tokens[:, 0] = anchor_ids
    tokens = tokens.flatten()
    h = target.embed(tokens).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    for stage, stage_keys in zip(draft.mtp, keys):
        ring = stage_keys.new_zeros(num_anchors, ring_len, stage_keys.shape[-1])
        ring = ring.index_put((slots[:, None], context % ring_len), stage_keys[seq_index[:, None], context])
        h, _ = stage(h, None, tokens, anchor_positions, slots, ring, ops, target.main_inv_freq, False)
    last = draft.mtp[-1]
    x = ops.hc_head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, hc_eps=cfg.hc_eps,
                    norm_eps=cfg.rms_norm_eps)
    base = (ops.rms_norm(x, last.norm.weight, cfg.rms_norm_eps) @ target.head.weight.t()).float()
    markov = last.markov_head
    e = markov.embedding(prev_ids.flatten())
    logits = base + (e @ markov.projection.weight.t()).float()
    confidence = torch.cat((x.float(), e.float()), dim=-1) @ last.confidence_head.proj.weight.float().t()
    return DraftOutput(logits.view(num_anchors, k, -1), confidence.view(num_anchors, k))
