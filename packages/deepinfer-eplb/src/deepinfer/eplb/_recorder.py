"""Sliding-window record of per-expert loads."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._inputs import load_array, positive_int


class LoadRecorder:
    """Sums per-expert loads over the last `window_steps` recorded steps.

    Keeps a ring buffer [window_steps, num_layers, num_logical_experts] float32 (so memory is
    4 * window * layers * experts bytes: 62 MB for 1000 steps x 61 layers x 256 experts) and a
    float64 running sum; the sum is recomputed from the buffer once per window so rounding cannot
    drift. Integer token counts below 2**24 per step are stored exactly.
    """

    def __init__(self, num_layers: int, num_logical_experts: int, window_steps: int) -> None:
        self._num_layers = positive_int(num_layers, "num_layers")
        self._num_logical = positive_int(num_logical_experts, "num_logical_experts")
        self._window = positive_int(window_steps, "window_steps")
        self._buffer = np.zeros((self._window, self._num_layers, self._num_logical), dtype=np.float32)
        self._sum = np.zeros((self._num_layers, self._num_logical), dtype=np.float64)
        self._num_steps = 0

    @property
    def window_steps(self) -> int:
        return self._window

    @property
    def num_steps(self) -> int:
        """Steps recorded since construction or the last `reset`."""
        return self._num_steps

    @property
    def num_window_steps(self) -> int:
        """Steps currently inside the window: min(num_steps, window_steps)."""
        return min(self._num_steps, self._window)

    def record(self, loads: Any) -> None:
        """Add one step's loads.

        Args:
            loads: [num_layers, num_logical_experts] finite loads >= 0 (numpy, torch or sequence),
                e.g. tokens routed to each expert this step.
        Raises:
            ValueError: `loads` of the wrong shape or with NaN / infinite / negative entries.
        """
        array = load_array(loads, "loads", ndim=2)
        if array.shape != (self._num_layers, self._num_logical):
            raise ValueError(
                f"loads must have shape [{self._num_layers}, {self._num_logical}] "
                f"(layers, logical experts), got {list(array.shape)}"
            )
        position = self._num_steps % self._window
        self._sum -= self._buffer[position]
        self._buffer[position] = array
        self._num_steps += 1
        if self._num_steps % self._window == 0:
            self._sum = self._buffer.sum(axis=0, dtype=np.float64)
        else:
            self._sum += self._buffer[position]

    def window_loads(self) -> np.ndarray:
        """Summed loads of the last min(num_steps, window_steps) steps: [num_layers, num_logical_experts]
        float64, a fresh array (zeros before the first step)."""
        return np.maximum(self._sum, 0.0)

    def reset(self) -> None:
        """Forget every recorded step (e.g. after the set of experts changed)."""
        self._buffer.fill(0.0)
        self._sum.fill(0.0)
        self._num_steps = 0
