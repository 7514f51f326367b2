"""Verification of drafted tokens against one target forward over [anchor, drafts].

Greedy rows accept a draft while it equals the target's argmax; sampled rows run rejection
sampling (accept draft x with probability min(1, p(x)/q(x)); on the first rejection emit a token
drawn from norm(max(0, p − q)); after a fully accepted run the bonus token from p), which leaves
the output distributed exactly as the target's. Every draw is keyed by (seed, output position), so
a seeded request's tokens do not depend on its batch. Batched tensor ops only: nothing here reads a
device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .keyed_noise import STREAM_ACCEPT, STREAM_SAMPLE, keyed_uniform, sample_from_probs


@dataclass(frozen=True, slots=True)
class VerifyInput:
    """One verify step of num_seqs rows, each with up to k drafts (k = draft_ids.shape[1]).

    Row i verified num_drafts[i] drafts: its target logits rows 0 … num_drafts[i] are valid (row j
    is the target's distribution for the token after the j-th input, the anchor being input 0);
    later rows are padding and never read.
    """

    target_logits: Tensor     # [num_seqs, k + 1, vocab] float32, raw (logprobs are taken from these)
    draft_ids: Tensor         # [num_seqs, k] int64 drafted tokens
    num_drafts: Tensor        # [num_seqs] int64 in [0, k], drafts verified per row
    temperature: Tensor       # [num_seqs] float32; 0 = greedy
    draft_probs: Tensor | None = None   # [num_seqs, k, vocab] float32 q the drafts were drawn from (rows with T > 0)
    seeds: Tensor | None = None         # [num_seqs] int64 per-request seeds (needed when some T > 0)
    output_positions: Tensor | None = None   # [num_seqs] int64 output position of each row's first draft
    processed_logits: Tensor | None = None   # [num_seqs, k + 1, vocab] target logits after top-k/p masks (-inf);
    #                                        None = target_logits. p = softmax(processed / T).


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What a verify step emits per row: the accepted drafts, then one target token."""

    output_ids: Tensor        # [num_seqs, k + 1] int64; row i: num_accepted[i] drafts + 1 token, then -1
    num_accepted: Tensor      # [num_seqs] int64 drafts accepted (0 … num_drafts)
    logprobs: Tensor          # [num_seqs, k + 1] float32 log_softmax(target_logits) of output_ids; 0 past the end

    @property
    def num_output(self) -> Tensor:
        """[num_seqs] int64 tokens emitted per row (accepted + 1)."""
        return self.num_accepted + 1


def verify(inp: VerifyInput) -> VerifyResult:
    """Accept or reject each row's drafts and emit the next target token.

    Without `draft_probs` every row is verified greedily (exact match), whatever its temperature.

    Raises:
        ValueError: shapes disagree, or draft_probs is given without seeds / output_positions
            (checked from shapes and None-ness only: no device read).
    """
    logits, drafts = inp.target_logits, inp.draft_ids
    num_seqs, k1, vocab = logits.shape
    k = k1 - 1
    if drafts.shape != (num_seqs, k) or inp.num_drafts.shape != (num_seqs,) or inp.temperature.shape != (num_seqs,):
        raise ValueError(f"target_logits {tuple(logits.shape)}, draft_ids {tuple(drafts.shape)}, num_drafts "
                         f"{tuple(inp.num_drafts.shape)} and temperature {tuple(inp.temperature.shape)} disagree")
    device = logits.device
    processed = inp.processed_logits if inp.processed_logits is not None else logits
    steps = torch.arange(k1, device=device)
    greedy = inp.temperature <= 0
    best = processed.argmax(dim=-1)                                          # [n, k + 1]
    accept = drafts == best[:, :k]
    draft_probs = inp.draft_probs
    sampled = draft_probs is not None
    if draft_probs is not None:
        if inp.seeds is None or inp.output_positions is None or draft_probs.shape != (num_seqs, k, vocab):
            raise ValueError("sampled verification needs draft_probs [num_seqs, k, vocab], seeds and output_positions")
        temp = torch.where(greedy, torch.ones_like(inp.temperature), inp.temperature).float()
        p = torch.softmax(processed.float() / temp[:, None, None], dim=-1)     # [n, k + 1, V]
        q = draft_probs.float()
        px = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
        qx = q.gather(-1, drafts[..., None]).squeeze(-1)
        positions = inp.output_positions[:, None] + steps[None, :]             # [n, k + 1]
        u = keyed_uniform(inp.seeds, positions[:, :k], STREAM_ACCEPT)
        accept = torch.where(greedy[:, None], accept, u * qx < px)
    accept = accept & (steps[None, :k] < inp.num_drafts[:, None])
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)                   # [n]
    final = best.gather(-1, num_accepted[:, None]).squeeze(-1)
    if sampled:
        rows = torch.arange(num_seqs, device=device)
        p_a = p[rows, num_accepted]                                            # [n, V]
        q_a = q[rows, num_accepted.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_a)
        rejected = num_accepted < inp.num_drafts
        residual = torch.where(rejected[:, None], (p_a - q_a).clamp(min=0), p_a)
        # p == q leaves no residual mass; then a rejection had probability 0 and p itself is exact.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)
        u_final = keyed_uniform(inp.seeds, positions.gather(-1, num_accepted[:, None]), STREAM_SAMPLE).squeeze(-1)
        final = torch.where(greedy, final, sample_from_probs(residual, u_final))
    out = torch.cat((drafts, torch.zeros_like(drafts[:, :1])), dim=1)
    out = out.scatter(1, num_accepted[:, None], final[:, None])
    valid = steps[None, :] <= num_accepted[:, None]
    out = torch.where(valid, out, torch.full_like(out, -1))
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, out.clamp(min=0)[..., None]).squeeze(-1)
    return VerifyResult(out, num_accepted, torch.where(valid, logprobs, torch.zeros_like(logprobs)))


def greedy_verify(target_logits: Tensor, draft_ids: Tensor, num_drafts: Tensor) -> VerifyResult:
    """`verify` for an all-greedy batch: accept drafts while they equal the target's argmax.

    Args:
        target_logits: [num_seqs, k + 1, vocab] float32; draft_ids: [num_seqs, k] int64;
        num_drafts: [num_seqs] int64 drafts verified per row.
    """
    zeros = torch.zeros(draft_ids.shape[0], dtype=torch.float32, device=draft_ids.device)
    return verify(VerifyInput(target_logits, draft_ids, num_drafts, zeros))


def gather_verify_logits(flat_logits: Tensor, query_lens: Tensor, max_query_len: int) -> Tensor:
    """The verify forward's logits, packed one row per query token, as `VerifyInput.target_logits`.

    Args:
        flat_logits: [total_q, vocab] rows of sequence i at cu[i] … cu[i + 1] − 1 (cu = cumsum of query_lens).
        query_lens: [num_seqs] int64 on the device, 1 + drafts verified per sequence.
        max_query_len: k + 1 (host int).
    Returns:
        [num_seqs, max_query_len, vocab]; rows past a sequence's query length repeat its last row
        (never read by `verify`).
    """
    starts = torch.cumsum(query_lens, 0) - query_lens
    steps = torch.arange(max_query_len, device=flat_logits.device)
    rows = starts[:, None] + torch.minimum(steps[None, :], (query_lens - 1)[:, None])
    return flat_logits[rows]
