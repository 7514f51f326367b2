"""Engram n-gram hashing (DeepSeek-V4.1, reference/deepseek-v4-spec.md §2.9.6).

Each position hashes the compressed ids of itself and the `max_ngram − 1` tokens before it: for an
engram layer with multipliers m_0 … m_{N−1}, r = c_0·m_0, then for s = 1 … N−1 r ^= c_s·m_s and each
of the layer's heads h takes `r mod P[s−1][h] + off[s−1][h]`. The primes P are searched upwards from
`engram_vocab_size − 1`, globally distinct over every (layer, n-gram size, head); `off` is the running
sum of one layer's primes (its table is the concatenation of the prime-sized ranges).
"""

from __future__ import annotations

import torch
from torch import Tensor


def is_prime(n: int) -> bool:
    """Deterministic primality of a non-negative int (trial division by 6k ± 1)."""
    if n < 2:
        return False
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


def engram_primes(num_layers: int, max_ngram_size: int, num_heads: int, vocab_size: int) -> list[list[list[int]]]:
    """Bucket sizes [layer][n-gram size − 2][head]: for each (layer, size) in order, the next
    `num_heads` primes above `vocab_size − 1` not taken by an earlier (layer, size)."""
    seen: set[int] = set()
    out = []
    for _ in range(num_layers):
        per_size = []
        for _ in range(max_ngram_size - 1):
            current, sizes = vocab_size - 1, []
            for _ in range(num_heads):
                current += 1
                while current in seen or not is_prime(current):
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_size.append(sizes)
        out.append(per_size)
    return out


def engram_offsets(primes: list[list[list[int]]]) -> list[list[int]]:
    """Row offset of each (n-gram size, head) range inside its layer's table, [layer][size·heads]."""
    out = []
    for layer in primes:
        row, total = [], 0
        for p in (p for per_size in layer for p in per_size):
            row.append(total)
            total += p
        out.append(row)
    return out


def engram_hash(tokens: Tensor, multipliers: Tensor, primes: Tensor, offsets: Tensor) -> Tensor:
    """Hash ids of every position for every engram layer.

    Args:
        tokens: [num_tokens, max_ngram] int64 compressed ids c_0 (the token itself) … c_{N−1}, the
            pad id already put where the look-back stops.
        multipliers: [num_layers, max_ngram] int64 (odd, small enough that c·m fits in int64).
        primes: [num_layers, max_ngram − 1, heads] int64; offsets: [num_layers, (max_ngram − 1)·heads].
    Returns:
        [num_tokens, num_layers, (max_ngram − 1)·heads] int64 table rows.
    """
    products = tokens.unsqueeze(1) * multipliers.unsqueeze(0)          # [t, L, N]
    rolling = products[..., 0]
    ids = []
    for s in range(1, tokens.shape[1]):
        rolling = torch.bitwise_xor(rolling, products[..., s])
        ids.append(torch.remainder(rolling.unsqueeze(-1), primes[:, s - 1].unsqueeze(0)))
    return torch.cat(ids, dim=-1) + offsets.unsqueeze(0)


def engram_gate(streams: Tensor, key: Tensor, weight: Tensor, eps: float, clamp: float = 1e-6) -> Tensor:
    """Per-stream gate of an engram lookup.

    dot_j = Σ_d streams_j · weight_j · key_j · rsqrt(mean streams_j² + eps) · rsqrt(mean key_j² + eps) / sqrt(dim);
    gate_j = sigmoid(sign(dot_j) · sqrt(max(|dot_j|, clamp))).

    Args:
        streams: [num_tokens, hc, dim]; key: [num_tokens, hc, dim]; weight: [hc, dim] (q_weight · k_weight).
    Returns:
        [num_tokens, hc] float32.
    """
    h, k = streams.float(), key.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
    dot = (h * weight.float() * k).sum(-1) * rstd * h.shape[-1] ** -0.5
    return torch.sigmoid(torch.copysign(dot.abs().clamp_min(clamp).sqrt(), dot))
