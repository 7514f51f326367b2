"""Compressor: gated softmax pooling of every `ratio` tokens into one compressed row.

Per token t: k_t = wkv·x_t, g_t = wgate·x_t + ape[t mod ratio] (float32). A plain (HCA)
window w pools tokens w·r … w·r+r−1. An overlapping (CSA) window pools 2r slots: the first
half-channels of window w−1's tokens and the second half-channels of window w's. The pooled row is
RMS-normalised and rotated (compress RoPE) at position w·r.

The raw (k, g) rows of windows that have not completed (and, for CSA, the previous window) live in a
per-sequence ring of the state slot, indexed by position mod ring length, so a chunk may end anywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.kernels import KernelSet

from .common import RMSNorm, linear


class Compressor(nn.Module):
    """Parameters: `wkv.weight`, `wgate.weight` [mult·width, hidden], `ape` [ratio, mult·width]
    float32, `norm.weight` [width]; mult = 2 when overlapping, else 1."""

    def __init__(self, hidden: int, width: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        mult = 2 if overlap else 1
        self.width, self.ratio, self.overlap = width, ratio, overlap
        self.wkv = linear(hidden, mult * width)
        self.wgate = linear(hidden, mult * width)
        self.ape = nn.Parameter(torch.zeros(ratio, mult * width, dtype=torch.float32))
        self.norm = RMSNorm(width, eps)

    @property
    def ring_len(self) -> int:
        """Raw rows a sequence must keep: the open window (and the previous one when overlapping)."""
        return (2 if self.overlap else 1) * self.ratio

    def pool_inputs(self, kv: Tensor, gate: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The projections `wkv(x)`, `wgate(x)` [num_tokens, mult·width] (model dtype, as transformers
        computes them) → (k, g) float32, the gate with its position bias: the pooling runs in float32."""
        return kv.float(), gate.float() + self.ape[positions % self.ratio]

    def compress(
        self,
        kv: Tensor,
        gate: Tensor,
        positions: Tensor,
        start: int,
        ring_k: Tensor,
        ring_g: Tensor,
        slot: Tensor,
        ops: KernelSet,
        inv_freq: Tensor,
        eps: float,
    ) -> tuple[Tensor, Tensor]:
        """Emit the windows that complete inside one sequence's chunk and update its ring: a fixed
        number of whole-chunk operations, whatever the chunk's length.

        Args:
            kv, gate: [q, mult·width] this chunk's projections (`pool_inputs`'s inputs), at `positions`
                start … start+q−1.
            ring_k, ring_g: [num_slots, ring, mult·width] float32, every sequence's ring (updated in place).
            slot: [1] int64, the sequence's state slot (a one-element index: nothing is read back to the host).
        Returns:
            (entry ids [n] int64, rows [n, width] float32) of the n completed windows.
        """
        k, g = self.pool_inputs(kv, gate, positions)
        r, q = self.ratio, k.shape[0]
        end = start + q
        ring = ring_k.shape[1]
        first, stop = start // r, end // r                   # windows completing in [start, end)
        entries = torch.arange(first, stop, dtype=torch.int64, device=k.device)
        rows = k.new_zeros((0, self.width))
        if stop > first:
            # Positions lo … stop·r − 1: those before the chunk (fewer than `ring`) from the ring, then the chunk's.
            lo = (first - 1) * r if self.overlap else first * r
            earlier = torch.arange(lo, start, device=k.device).clamp(min=0) % ring
            kk = torch.cat((ring_k[slot, earlier], k[:stop * r - start]))
            gg = torch.cat((ring_g[slot, earlier], g[:stop * r - start]))
            if lo < 0:                                        # the window before the first one: weight 0
                kk[:-lo] = 0.0
                gg[:-lo] = float("-inf")
            n = stop - first
            if self.overlap:
                w = self.width
                kk, gg = kk.view(n + 1, r, 2 * w), gg.view(n + 1, r, 2 * w)
                slot_k = torch.cat((kk[:-1, :, :w], kk[1:, :, w:]), dim=1)
                slot_g = torch.cat((gg[:-1, :, :w], gg[1:, :, w:]), dim=1)
            else:
                slot_k, slot_g = kk.view(n, r, -1), gg.view(n, r, -1)
            pooled = ops.rms_norm(ops.compress_pool(slot_k, slot_g), self.norm.weight, eps)
            rows = ops.apply_rope(pooled, entries * r, inv_freq)
        keep = max(start, end - ring)
        write = torch.arange(keep, end, device=k.device) % ring
        ring_k[slot, write] = k[keep - start:]
        ring_g[slot, write] = g[keep - start:]
        return entries, rows
