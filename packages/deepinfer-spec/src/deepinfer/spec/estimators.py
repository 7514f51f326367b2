"""Online step-time estimates for the varlen verify choice (docs/design.md §7.3).

Every estimate takes arrays too (`estimate_ms_many`): the varlen policy scores every candidate total of
a step at once, so its cost per step is a few numpy calls, not one Python call per draft. Medians are
computed once per new measurement, not per estimate.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque

import numpy as np

from .graph_sizes import DEFAULT_GRAPH_INTERVAL, cuda_graph_key, cuda_graph_keys
from .profile import StepTimeCurve


class ForwardRuntimeEstimator:
    """Forward ms of a step of total_q query tokens: the profiled curve at its graph size, plus an
    online ms-per-token slope fitted to what steps really took.

    The slope is the median over graph sizes of the median of (measured − curve) / size over the last
    `window` observed steps ("median of medians"): robust to outliers and to sizes seen rarely.
    """

    def __init__(self, curve: StepTimeCurve, *, interval: int = DEFAULT_GRAPH_INTERVAL, window: int = 5000) -> None:
        self.curve, self.interval = curve, interval
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._slope: float | None = 0.0           # None: recompute at the next read

    def observe(self, total_q: int, measured_ms: float) -> None:
        """Record one forward step's measured time."""
        size = cuda_graph_key(total_q, self.interval)
        self._steps.append((size, (measured_ms - self.curve.at(size)) / size))
        self._slope = None

    @property
    def slope_ms_per_token(self) -> float:
        if self._slope is None:
            per_size: dict[int, list[float]] = defaultdict(list)
            for size, residual in self._steps:
                per_size[size].append(residual)
            self._slope = statistics.median(statistics.median(r) for r in per_size.values())
        return self._slope

    def estimate_ms(self, total_q: int) -> float:
        """Expected forward ms of a step of `total_q` query tokens (it runs the graph of its key)."""
        size = cuda_graph_key(total_q, self.interval)
        return self.curve.at(size) + self.slope_ms_per_token * size

    def estimate_ms_many(self, total_qs: np.ndarray) -> np.ndarray:
        """`estimate_ms` of each of [n] int totals (>= 1) -> [n] float64."""
        keys = cuda_graph_keys(total_qs, self.interval)
        sizes, index = np.unique(keys, return_inverse=True)
        slope = self.slope_ms_per_token
        return np.array([self.curve.at(int(s)) + slope * int(s) for s in sizes])[index.reshape(-1)]


class SamplerRuntimeEstimator:
    """Sampler ms per number of sequences: the median of the last `window` measurements for that
    count; counts never measured are interpolated linearly between the nearest measured ones
    (flat beyond them). Before any measurement: the start-up `prior` curve (measured over dummy rows,
    `deepinfer.engine.speculative.varlen_profile`) at that count, or 0 without one."""

    def __init__(self, *, window: int = 9, prior: StepTimeCurve | None = None) -> None:
        self._window = window
        self._times: dict[int, deque[float]] = {}
        self._medians: tuple[np.ndarray, np.ndarray] | None = None    # (counts, ms); None: recompute
        self.prior = prior

    def observe(self, num_seqs: int, measured_ms: float) -> None:
        self._times.setdefault(num_seqs, deque(maxlen=self._window)).append(measured_ms)
        self._medians = None

    def estimate_ms(self, num_seqs: int) -> float:
        return float(self.estimate_ms_many(np.array([num_seqs]))[0])

    def estimate_ms_many(self, counts: np.ndarray) -> np.ndarray:
        """`estimate_ms` of each of [n] counts -> [n] float64."""
        counts = np.asarray(counts, dtype=np.float64)
        if not self._times:
            if self.prior is None:
                return np.zeros(counts.shape)
            return np.interp(counts, self.prior.sizes, self.prior.ms)        # flat beyond the ends
        if self._medians is None:
            measured = sorted(self._times)
            self._medians = (np.array(measured, dtype=np.float64),
                             np.array([statistics.median(self._times[c]) for c in measured]))
        return np.interp(counts, *self._medians)


class DraftRuntimeEstimator(SamplerRuntimeEstimator):
    """The draft walk's ms (`DSparkDraft.propose`) per number of drafting rows, estimated as
    `SamplerRuntimeEstimator` does per number of sequences; no drafting row costs 0 ms."""

    def estimate_ms_many(self, counts: np.ndarray) -> np.ndarray:
        counts = np.asarray(counts)
        return np.where(counts > 0, SamplerRuntimeEstimator.estimate_ms_many(self, counts), 0.0)
