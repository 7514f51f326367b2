"""Counter-based random numbers keyed by (seed, output position, stream, index).

The engine's `RequestRng.generator_for(position)` seeds a host generator per request and position;
speculative verification needs the same property — a seeded request's draws depend only on its seed
and the output position, never on the batch around it — for whole batches at once on the device and
without a host synchronisation. So the noise here is a pure function: SplitMix64 over int64 tensors
(wrapping multiplication), mixing the seed, the position, a stream id (what the draw is for) and an
index (e.g. a vocabulary entry), then 24 bits → a float32 uniform in (0, 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

# What a draw is used for: two uses at the same position must not share a number.
STREAM_ACCEPT = 1     # the acceptance test of a draft token
STREAM_SAMPLE = 2     # the token the target emits (bonus, or the correction after a rejection)
STREAM_DRAFT = 3      # the draft model's own sampling

_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seed_to_int64(seed: int) -> int:
    """A request seed in [0, 2**64 − 1] as the int64 with the same bits (what `keyed_uniform` takes).

    Raises:
        ValueError: the seed is outside [0, 2**64 − 1].
    """
    if not 0 <= seed <= _MASK64:
        raise ValueError(f"seed={seed} must be in [0, 2**64 - 1]")
    return _signed(seed)


def splitmix64(x: Tensor) -> Tensor:
    """SplitMix64's output function on int64 tensors (bijective on 64-bit patterns)."""
    x = (x ^ _shr(x, 30)) * _signed(_MUL1)
    x = (x ^ _shr(x, 27)) * _signed(_MUL2)
    return x ^ _shr(x, 31)


def keyed_uniform(seeds: Tensor, positions: Tensor, stream: int, num_draws: int | None = None) -> Tensor:
    """Uniform (0, 1) numbers that depend only on (seed, position, stream, draw index).

    Args:
        seeds: [num_seqs] int64 per-request seeds (`seed_to_int64` of a 64-bit seed).
        positions: [num_seqs, m] int64 output positions (0 = the first generated token).
        stream: one of the STREAM_* ids.
        num_draws: None for one number per (seed, position); else that many per position.
    Returns:
        float32 [num_seqs, m] (num_draws None) or [num_seqs, m, num_draws], on positions' device.
    """
    base = splitmix64(seeds.to(torch.int64)[:, None] + (positions.to(torch.int64) + 1) * _signed(_GOLDEN))
    base = splitmix64(base + _signed((stream * _MUL2) & _MASK64))
    if num_draws is not None:
        idx = torch.arange(num_draws, dtype=torch.int64, device=positions.device)
        base = splitmix64(base[..., None] + (idx + 1) * _signed(_GOLDEN))
    bits = _shr(base, 40).to(torch.float32)            # top 24 bits
    return (bits + 0.5) * (1.0 / (1 << 24))


def sample_from_probs(probs: Tensor, uniform: Tensor) -> Tensor:
    """Inverse-CDF sampling: for each row of probs [..., vocab] (non-negative, any positive total),
    the token whose cumulative mass first exceeds uniform [...] × total. int64 [...]."""
    cdf = probs.float().cumsum(dim=-1)
    target = (uniform * cdf[..., -1]).unsqueeze(-1)
    token = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    return token.clamp(max=probs.shape[-1] - 1)
