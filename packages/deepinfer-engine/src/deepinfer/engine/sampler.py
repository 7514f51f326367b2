"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Device-agnostic torch (CPU and CUDA). The hot path makes no host-device synchronisation: every
decision that depends on the batch's composition (which rows are greedy, seeded, banned) is taken on
the host when the `SamplingBatch` is built, and carried as index tensors.

Random rows are sampled by an exponential race: token = argmax_i p_i / E_i with E_i ~ Exp(1) drawn
independently per token, which picks token i with probability p_i / sum(p). Each row's noise is one
draw of `vocab_size` values from that row's generator, so a seeded request (its own `RequestRng`,
advanced only by its own draws) gets the same tokens whatever else is in the batch and at whatever
row it sits (tested on CPU, and on an H200 with torch 2.11). Unseeded rows share the sampler's
generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling_batch import InvalidSamplingBatch, SamplingBatch
from .sampling_params import MAX_SEED
from .token_bitmask import apply_token_bitmask

# When every random row has top_k <= this, top-k/top-p use one topk(max top_k) instead of a sort.
_TOPK_INSTEAD_OF_SORT = 1024


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """The sampled tokens of one step and their logprobs (of the raw, unprocessed distribution)."""

    token_ids: Tensor             # [num_seqs] int64
    logprobs: Tensor              # [num_seqs] float32, log_softmax(logits)[row, token_ids[row]]
    top_logprobs: Tensor | None   # [num_seqs, k] float32, descending; None when k = 0
    top_ids: Tensor | None        # [num_seqs, k] int64, token ids of top_logprobs


class Sampler:
    """Picks one token per logits row.

    Greedy rows take the argmax (ties -> lowest token id). Random rows: divide by temperature,
    softmax, keep top-k (ties at the k-th place -> lowest ids kept), then top-p on the renormalised
    top-k distribution (the smallest prefix whose probability is >= top_p; always >= 1 token), then
    min-p (drop p < min_p * p_max), and sample the rest. EOS / stop ids of rows below min_tokens are
    masked first, for greedy rows too, and so are tokens a row's grammar bitmask disallows.

    Args:
        seed: seeds the generator shared by unseeded rows (one per device); None = torch's default
            generator of that device.
        force_top_k: if set (>= 1), random rows only ever consider their `force_top_k` most likely
            tokens (one topk instead of a full sort of the vocabulary; top-p then works on the
            renormalised candidates). Logprobs are unaffected. Without it, a topk of the largest
            top_k is also used whenever every random row sets a top_k <= 1024.
    """

    def __init__(self, *, seed: int | None = None, force_top_k: int | None = None) -> None:
        if force_top_k is not None and force_top_k < 1:
            raise InvalidSamplingBatch(f"force_top_k={force_top_k} must be None or >= 1")
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise InvalidSamplingBatch(f"seed={seed} must be None or in [0, 2**64 - 1]")
        self._seed = seed
        self._force_top_k = force_top_k
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [num_seqs, vocab_size] float32, the model's raw next-token logits.
            batch: the rows' parameters (`build_sampling_batch`), on the same device.

        Returns:
            SamplerOutput; its logprobs are log_softmax of the unprocessed `logits` (before
            temperature, top-k/p, min-p, min_tokens and grammar masking), for the sampled token and, when
            some row asked for logprobs, the batch's `num_top_logprobs` most likely tokens.
        """
        if logits.dtype != torch.float32 or logits.shape != (batch.num_seqs, batch.vocab_size):
            raise InvalidSamplingBatch(
                f"logits must be float32 [num_seqs={batch.num_seqs}, vocab_size={batch.vocab_size}], "
                f"got {logits.dtype} {list(logits.shape)}"
            )
        # log_softmax(logits) = logits - logsumexp(logits), taken only where needed.
        log_normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)   # [num_seqs, 1]
        masked = logits
        if batch.banned_rows.shape[0]:
            minus_inf = logits.new_full((), -torch.inf)
            masked = logits.index_put((batch.banned_rows, batch.banned_token_ids), minus_inf)
        if batch.token_bitmask is not None:
            masked = apply_token_bitmask(masked, batch.token_bitmask, batch.bitmask_rows)
        num_greedy = batch.greedy_rows.shape[0]
        if num_greedy == batch.num_seqs:
            token_ids = masked.argmax(dim=-1)
        elif num_greedy == 0:
            token_ids = self._sample(masked, batch)
        else:
            token_ids = torch.empty(batch.num_seqs, dtype=torch.int64, device=logits.device)
            greedy = masked.index_select(0, batch.greedy_rows).argmax(dim=-1)
            token_ids.index_copy_(0, batch.greedy_rows, greedy)
            sampled = self._sample(masked.index_select(0, batch.random_rows), batch)
            token_ids.index_copy_(0, batch.random_rows, sampled)
        logprobs = (logits.gather(1, token_ids[:, None]) - log_normaliser).squeeze(1)
        num_top = min(batch.num_top_logprobs, batch.vocab_size)
        if num_top == 0:
            return SamplerOutput(token_ids, logprobs, None, None)
        top_logits, top_ids = logits.topk(num_top, dim=-1)
        return SamplerOutput(token_ids, logprobs, top_logits - log_normaliser, top_ids)

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """[num_random, vocab] float32 (masked, unscaled) -> [num_random] int64 sampled ids."""
        probs = torch.softmax(logits / batch.temperature[:, None], dim=-1)
        if batch.use_top_k or batch.use_top_p or self._force_top_k is not None:
            probs = self._filter_sorted(probs, batch)
        elif batch.use_min_p:
            floor = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = self._exponential_noise(probs.shape, batch, probs.device)
        return (probs / noise).argmax(dim=-1)

    def _filter_sorted(self, probs: Tensor, batch: SamplingBatch) -> Tensor:
        num_candidates = batch.max_top_k if batch.max_top_k <= _TOPK_INSTEAD_OF_SORT else batch.vocab_size
        if self._force_top_k is not None:
            num_candidates = min(num_candidates, self._force_top_k)
        if num_candidates < batch.vocab_size:
            cand_p, cand_ids = _topk_lowest_id_first(probs, num_candidates)
        else:
            cand_p, cand_ids = probs.sort(dim=-1, descending=True, stable=True)
        positions = torch.arange(cand_p.shape[1], device=probs.device)
        keep = positions[None, :] < batch.top_k[:, None]
        if batch.use_top_p:
            kept_p = cand_p * keep
            cumulative = kept_p.cumsum(dim=-1)
            before = cumulative - kept_p   # probability of the more likely kept tokens; 0 at place 0
            keep &= before < batch.top_p[:, None] * cumulative[:, -1:]
        if batch.use_min_p:
            keep &= cand_p >= batch.min_p[:, None] * cand_p[:, :1]
        return torch.zeros_like(probs).scatter_(1, cand_ids, cand_p * keep)

    def _exponential_noise(self, shape: torch.Size, batch: SamplingBatch, device: torch.device) -> Tensor:
        num_rows, vocab_size = shape
        noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        num_unseeded = batch.unseeded_positions.shape[0]
        if num_unseeded == num_rows:
            noise.exponential_(generator=self._shared_generator(device))
        elif num_unseeded:
            shared = torch.empty(num_unseeded, vocab_size, dtype=torch.float32, device=device)
            shared.exponential_(generator=self._shared_generator(device))
            noise.index_copy_(0, batch.unseeded_positions, shared)
        for position, rng in enumerate(batch.rngs):
            if rng is not None:
                if rng.generator.device.type != device.type:
                    raise InvalidSamplingBatch(
                        f"RequestRng(seed={rng.seed}) lives on {rng.generator.device}, logits on {device}"
                    )
                noise[position].exponential_(generator=rng.generator)
                rng.num_draws += 1
        # Exp(1) can round to 0; p / 0 would win the race (or give NaN for p = 0).
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator


def _topk_lowest_id_first(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """[rows, vocab] float32 >= 0 -> the k largest (values, ids), each [rows, k], descending; equal
    values rank by ascending id. torch.topk alone breaks ties arbitrarily, so rank unique int64 keys
    (the bit pattern of a non-negative float orders like its value) instead."""
    low_mask = 2**32 - 1
    keys = probs.view(torch.int32).to(torch.int64)
    keys.bitwise_left_shift_(32).add_(torch.arange(low_mask, low_mask - probs.shape[1], -1, device=probs.device))
    top_ids = low_mask - (keys.topk(k, dim=-1).values & low_mask)
    return probs.gather(1, top_ids), top_ids


def logprob_dicts(output: SamplerOutput, batch: SamplingBatch) -> list[dict[int, float] | None]:
    """Per row, None if the row asked for no logprobs, else {token id: logprob} holding the sampled
    token and the row's SamplingParams.logprobs most likely alternatives. Copies to the host (syncs).
    """
    token_ids = output.token_ids.tolist()
    logprobs = output.logprobs.tolist()
    top_ids = output.top_ids.tolist() if output.top_ids is not None else None
    top_logprobs = output.top_logprobs.tolist() if output.top_logprobs is not None else None
    result: list[dict[int, float] | None] = []
    for row, wanted in enumerate(batch.num_logprobs):
        if wanted is None:
            result.append(None)
            continue
        entry = {token_ids[row]: logprobs[row]}
        if wanted and top_ids is not None and top_logprobs is not None:
            for token_id, logprob in zip(top_ids[row][:wanted], top_logprobs[row][:wanted]):
                entry.setdefault(token_id, logprob)
        result.append(entry)
    return result
