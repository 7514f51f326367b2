"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

The hot path makes no host-device synchronisation: every decision that depends on the batch's
composition (which rows are greedy, seeded, banned, how many candidates the top-k / top-p cut must
rank) is taken on the host when the `SamplingBatch` is built, and carried as index tensors or plain
ints. Temperature, top-k / top-p / min-p and the race run in the kernel registry's `sample_race`
(on CUDA a sort-free Triton kernel for large batches or batches without cuts, else the PyTorch
reference).

Random rows are sampled by an exponential race: token = argmax_i p_i / E_i with E_i ~ Exp(1) drawn
independently per token, which picks token i with probability p_i / sum(p). Each row's noise is one
draw of `vocab_size` values from that row's generator; a seeded request's generator is seeded from
(its seed, the output position) for each draw (`RequestRng.generator_for`), so it gets the same tokens
whatever else is in the batch, at whatever row it sits, and whatever draws were thrown away (tested
on CPU, and on an H200 with torch 2.11). Unseeded rows share the sampler's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer.kernels import kernels_for

from .logit_controls import apply_logit_controls, record_tokens
from .sampling_batch import InvalidSamplingBatch, SamplingBatch
from .sampling_params import MAX_SEED
from .token_bitmask import apply_token_bitmask

# A row whose log-sum-exp exceeds this in magnitude counts as not finite (`SamplerOutput.finite_rows`): its
# logits divided by the smallest temperature, float32(GREEDY_TEMPERATURE) > 9.9e-6, could overflow
# float32 (max 3.4e38). NaN, +inf and an all -inf row give a non-finite log-sum-exp and fail too.
MAX_LOGIT_MAGNITUDE = 1e33


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """The sampled tokens of one step and their logprobs (of the raw, unprocessed distribution)."""

    token_ids: Tensor             # [num_seqs] int64, in [0, vocab_size); meaningless where not finite_rows
    logprobs: Tensor              # [num_seqs] float32, log_softmax(logits)[row, token_ids[row]]
    finite_rows: Tensor           # [num_seqs] bool; False = the row's raw logits hold NaN or +inf, are all
                                  # -inf, or have a log-sum-exp beyond ±MAX_LOGIT_MAGNITUDE
    top_logprobs: Tensor | None   # [num_seqs, k] float32, descending; None when k = 0
    top_ids: Tensor | None        # [num_seqs, k] int64, token ids of top_logprobs
    ranks: Tensor | None = None   # [num_seqs] int64, 1 + tokens with a larger raw logit than the sampled one;
                                  # None when no row asked for logprobs


class Sampler:
    """Picks one token per logits row.

    Greedy rows take the argmax (ties -> lowest token id). Random rows: divide by temperature,
    softmax, keep top-k (ties at the k-th place -> lowest ids kept), then top-p on the renormalised
    top-k distribution (the smallest prefix whose probability is >= top_p; always >= 1 token), then
    min-p (drop p < min_p * p_max), and sample the rest. EOS / stop ids of rows below min_tokens are
    masked first, for greedy rows too, and so are tokens a row's grammar bitmask disallows. Before
    all that, `batch.controls` (penalties, logit_bias, allowed_token_ids, bad_words) change the logits
    the tokens are picked from (`logit_controls`), and the sampled tokens go into their history.

    Rows whose raw logits are not finite (NaN, +inf, every entry -inf, or so large that a temperature
    could overflow them) are flagged in `SamplerOutput.finite_rows` and their token must be dropped.
    The flag comes from the log-sum-exp the logprobs need anyway: no extra pass over the logits and
    no host synchronisation.

    Args:
        seed: seeds the generator shared by unseeded rows (one per device); None = torch's default
            generator of that device.
        force_top_k: if set (>= 1), random rows only ever consider their `force_top_k` most likely
            tokens (each row's top_k is capped at it; top-p then works on the renormalised
            candidates). Logprobs are unaffected.
        batch_invariant: sample through the batch-invariant kernel set (`EngineArgs.batch_invariant`):
            on CUDA the same kernel at every batch size, so a row's token never depends on the batch.
    """

    def __init__(self, *, seed: int | None = None, force_top_k: int | None = None,
                 batch_invariant: bool = False) -> None:
        if force_top_k is not None and force_top_k < 1:
            raise InvalidSamplingBatch(f"force_top_k={force_top_k} must be None or >= 1")
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise InvalidSamplingBatch(f"seed={seed} must be None or in [0, 2**64 - 1]")
        self._seed = seed
        self._force_top_k = force_top_k
        self._batch_invariant = batch_invariant
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [num_seqs, vocab_size] float32, the model's raw next-token logits.
            batch: the rows' parameters (`build_sampling_batch`), on the same device.

        Returns:
            SamplerOutput; its logprobs are log_softmax of the unprocessed `logits` (before
            temperature, top-k/p, min-p, min_tokens and grammar masking), for the sampled token and, when
            some row asked for logprobs, the batch's `num_top_logprobs` most likely tokens. Rows with
            finite_rows False get some token id in range and meaningless logprobs.
        """
        if logits.dtype != torch.float32 or logits.shape != (batch.num_seqs, batch.vocab_size):
            raise InvalidSamplingBatch(
                f"logits must be float32 [num_seqs={batch.num_seqs}, vocab_size={batch.vocab_size}], "
                f"got {logits.dtype} {list(logits.shape)}"
            )
        # log_softmax(logits) = logits - logsumexp(logits), taken only where needed.
        log_normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)   # [num_seqs, 1]
        finite_rows = log_normaliser.squeeze(1).abs() <= MAX_LOGIT_MAGNITUDE   # False for NaN / ±inf too
        masked = logits if batch.controls is None else apply_logit_controls(logits, batch.controls)
        if batch.banned_rows.shape[0]:
            minus_inf = logits.new_full((), -torch.inf)
            masked = masked.index_put((batch.banned_rows, batch.banned_token_ids), minus_inf)
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
        if batch.controls is not None:
            record_tokens(batch.controls, token_ids)
        sampled_logits = logits.gather(1, token_ids[:, None])
        logprobs = (sampled_logits - log_normaliser).squeeze(1)
        ranks = None
        if batch.wants_logprobs:
            ranks = (logits > sampled_logits).sum(dim=-1) + 1
        num_top = min(batch.num_top_logprobs, batch.vocab_size)
        if num_top == 0:
            return SamplerOutput(token_ids, logprobs, finite_rows, None, None, ranks)
        top_logits, top_ids = logits.topk(num_top, dim=-1)
        return SamplerOutput(token_ids, logprobs, finite_rows, top_logits - log_normaliser, top_ids, ranks)

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """[num_random, vocab] float32 (masked, unscaled) -> [num_random] int64 sampled ids."""
        top_k = batch.top_k if self._force_top_k is None else batch.top_k.clamp_max(self._force_top_k)
        noise = self._exponential_noise(logits.shape, batch, logits.device)
        kernels = kernels_for(logits.device, batch_invariant=self._batch_invariant)
        return kernels.sample_race(logits, batch.temperature, top_k, batch.top_p, batch.min_p, noise,
                                   self._num_candidates(batch))

    def _num_candidates(self, batch: SamplingBatch) -> int:
        """The `sample_race` hint, from the batch's host-side summary: 0 when no row cuts by top-k or
        top-p, else the largest top_k (the vocabulary when a row cuts by top-p alone), capped by
        force_top_k."""
        cap = batch.vocab_size if self._force_top_k is None else min(self._force_top_k, batch.vocab_size)
        if not (batch.use_top_k or batch.use_top_p or cap < batch.vocab_size):
            return 0
        return min(batch.max_top_k, cap)

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
        for position, (rng, draw_position) in enumerate(zip(batch.rngs, batch.draw_positions)):
            if rng is not None:
                if rng.generator.device.type != device.type:
                    raise InvalidSamplingBatch(
                        f"RequestRng(seed={rng.seed}) lives on {rng.generator.device}, logits on {device}"
                    )
                noise[position].exponential_(generator=rng.generator_for(draw_position))
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


def logprobs_of(logits: Tensor, token_ids: list[int], num_top: int) -> tuple[list[dict[int, float]], list[int]]:
    """Per row of `logits` ([num_rows, vocab], any float dtype; reads them back: not for a ZOS launch):
    {token id: logprob} of the row's given token plus its num_top most likely alternatives, and the
    token's rank (1 + tokens with a larger logit). Used for prompt logprobs."""
    rows = logits.float()
    targets = torch.tensor(token_ids, dtype=torch.int64, device=rows.device)
    normaliser = rows.logsumexp(dim=-1, keepdim=True)
    chosen = rows.gather(1, targets[:, None])
    ranks = ((rows > chosen).sum(dim=-1) + 1).tolist()
    entries = [{token: logprob} for token, logprob in zip(token_ids, (chosen - normaliser)[:, 0].tolist())]
    num_top = min(num_top, rows.shape[1])
    if num_top:
        top_logits, top_ids = rows.topk(num_top, dim=-1)
        for entry, ids, values in zip(entries, top_ids.tolist(), (top_logits - normaliser).tolist()):
            for token, logprob in zip(ids, values):
                entry.setdefault(token, logprob)
    return entries, ranks


def logprob_dicts(output: SamplerOutput, batch: SamplingBatch,
                  token_ids: list[int] | None = None) -> list[dict[int, float] | None]:
    """Per row, None if the row asked for no logprobs, else {token id: logprob} holding the sampled
    token and the row's SamplingParams.logprobs most likely alternatives. Copies to the host (syncs)
    only when some row asked; `token_ids` = output.token_ids already on the host, if the caller has it.
    """
    if not batch.wants_logprobs:
        return [None] * batch.num_seqs
    token_ids = output.token_ids.tolist() if token_ids is None else token_ids
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
