"""Online step-time estimates for the varlen verify choice (docs/design.md §7.3)."""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict, deque

from .graph_sizes import DEFAULT_GRAPH_INTERVAL, cuda_graph_key
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

    def observe(self, total_q: int, measured_ms: float) -> None:
        """Record one forward step's measured time."""
        size = cuda_graph_key(total_q, self.interval)
        self._steps.append((size, (measured_ms - self.curve.at(size)) / size))

    @property
    def slope_ms_per_token(self) -> float:
        if not self._steps:
            return 0.0
        per_size: dict[int, list[float]] = defaultdict(list)
        for size, residual in self._steps:
            per_size[size].append(residual)
        return statistics.median(statistics.median(r) for r in per_size.values())

    def estimate_ms(self, total_q: int) -> float:
        """Expected forward ms of a step of `total_q` query tokens (it runs the graph of its key)."""
        size = cuda_graph_key(total_q, self.interval)
        return self.curve.at(size) + self.slope_ms_per_token * size


class SamplerRuntimeEstimator:
    """Sampler ms per number of sequences: the median of the last `window` measurements for that
    count; counts never measured are interpolated linearly between the nearest measured ones
    (flat beyond them). Before any measurement: the start-up `prior` curve (measured over dummy rows,
    `deepinfer.engine.varlen_profile`) at that count, or 0 without one."""

    def __init__(self, *, window: int = 9, prior: StepTimeCurve | None = None) -> None:
        self._window = window
        self._times: dict[int, deque[float]] = {}
        self.prior = prior

    def observe(self, num_seqs: int, measured_ms: float) -> None:
        self._times.setdefault(num_seqs, deque(maxlen=self._window)).append(measured_ms)

    def estimate_ms(self, num_seqs: int) -> float:
        if not self._times:
            return 0.0 if self.prior is None else self.prior.at(num_seqs)
        if num_seqs in self._times:
            return statistics.median(self._times[num_seqs])
        counts = sorted(self._times)
        i = bisect.bisect_left(counts, num_seqs)
        if i == 0:
            return statistics.median(self._times[counts[0]])
        if i == len(counts):
            return statistics.median(self._times[counts[-1]])
        a, b = counts[i - 1], counts[i]
        ta, tb = statistics.median(self._times[a]), statistics.median(self._times[b])
        return ta + (tb - ta) * (num_seqs - a) / (b - a)


class DraftRuntimeEstimator(SamplerRuntimeEstimator):
    """The draft walk's ms (`DSparkDraft.propose`) per number of drafting rows, estimated as
    `SamplerRuntimeEstimator` does per number of sequences; no drafting row costs 0 ms."""

    def estimate_ms(self, num_rows: int) -> float:
        return 0.0 if num_rows <= 0 else SamplerRuntimeEstimator.estimate_ms(self, num_rows)
