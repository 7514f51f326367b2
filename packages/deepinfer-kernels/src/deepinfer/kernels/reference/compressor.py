"""Gated softmax pooling of compression windows (the V4 compressor's arithmetic)."""

from __future__ import annotations

from torch import Tensor


def compress_pool(kv: Tensor, gate: Tensor) -> Tensor:
    """Pool each window's slots with a per-channel softmax over the slot axis.

    The caller lays the slots out: for a plain (HCA) window the `ratio` tokens of the window;
    for an overlapping (CSA) window `2 * ratio` slots — the first-half channels of the previous
    window's tokens, then the second-half channels of this window's tokens. A slot that does not
    exist (the window before the first one) carries gate −inf and kv 0, so it gets weight 0.

    Args:
        kv: [num_windows, num_slots, width] projected values (float32 in the model).
        gate: [num_windows, num_slots, width] gate logits with the position bias already added.
    Returns:
        [num_windows, width] in kv's dtype (softmax computed in float32).
    """
    weights = gate.float().softmax(dim=1).to(kv.dtype)
    return (kv * weights).sum(dim=1)
