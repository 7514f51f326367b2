"""How the drafter picks its tokens, so that verification knows the distribution q they came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .keyed_noise import STREAM_DRAFT, keyed_uniform, sample_from_probs


@dataclass(frozen=True, slots=True)
class DraftSampler:
    """Samples one draft position for every row: argmax for greedy rows (temperature 0), else a
    draw from softmax(logits / T) keyed by (seed, output position), independent of the batch.

    Pass it as the `sample` callable of `DSparkDraft.propose`; afterwards `draft_probs` turns the
    proposal's Markov-corrected logits into the q that `verify` needs.
    """

    temperature: Tensor        # [num_seqs] float32; 0 = greedy
    seeds: Tensor              # [num_seqs] int64
    output_positions: Tensor   # [num_seqs] int64 output position of the first draft

    def __call__(self, step: int, logits: Tensor) -> Tensor:
        """logits [num_seqs, vocab] of draft position `step` → token ids [num_seqs] int64."""
        probs = self.probs(logits)
        u = keyed_uniform(self.seeds, (self.output_positions + step)[:, None], STREAM_DRAFT)[:, 0]
        sampled = sample_from_probs(probs, u)
        return torch.where(self.temperature <= 0, logits.argmax(dim=-1), sampled)

    def probs(self, logits: Tensor) -> Tensor:
        """softmax(logits / T) per row (T = 1 for greedy rows, whose q is never read)."""
        temp = torch.where(self.temperature <= 0, torch.ones_like(self.temperature), self.temperature).float()
        shape = (-1,) + (1,) * (logits.dim() - 1)
        return torch.softmax(logits.float() / temp.view(shape), dim=-1)

    def draft_probs(self, draft_logits: Tensor) -> Tensor:
        """[num_seqs, k, vocab] Markov-corrected draft logits → q [num_seqs, k, vocab] float32."""
        return self.probs(draft_logits)
