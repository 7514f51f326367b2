"""Startup profile of the decode step time per graph size, and its JSON cache (docs/design.md §7.2)."""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NUM_REPLAYS = 5


@dataclass(frozen=True, slots=True)
class StepTimeCurve:
    """Measured forward time per graph size (total query tokens), ascending sizes."""

    sizes: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.ms):
            raise ValueError(f"sizes ({len(self.sizes)}) and ms ({len(self.ms)}) must be non-empty and equal length")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"sizes {self.sizes} must be strictly ascending")

    def at(self, size: int) -> float:
        """ms of a step of `size` tokens: linear between measured sizes, flat beyond the ends."""
        i = bisect.bisect_left(self.sizes, size)
        if i < len(self.sizes) and self.sizes[i] == size:
            return self.ms[i]
        if i == 0:
            return self.ms[0]
        if i == len(self.sizes):
            return self.ms[-1]
        a, b = self.sizes[i - 1], self.sizes[i]
        return self.ms[i - 1] + (self.ms[i] - self.ms[i - 1]) * (size - a) / (b - a)


def trimmed_mean(samples: Iterable[float]) -> float:
    """Mean after dropping one minimum and one maximum (plain mean of fewer than 3 samples)."""
    values = sorted(samples)
    if not values:
        raise ValueError("no samples")
    if len(values) >= 3:
        values = values[1:-1]
    return statistics.fmean(values)


def profile_step_times(run_step: Callable[[int], float], sizes: Iterable[int], *,
                       replays: int = NUM_REPLAYS) -> StepTimeCurve:
    """Time each graph size: `replays` replays, drop the min and the max, average the rest.

    Args:
        run_step: replays the graph of one size once and returns its time in ms (the engine times
            it with device events and, with EP, returns the mean over the EP group).
        sizes: graph sizes to measure (e.g. `cuda_graph_sizes(max_total_q)`).
    """
    ordered = sorted(set(sizes))
    return StepTimeCurve(tuple(ordered), tuple(trimmed_mean(run_step(s) for _ in range(replays)) for s in ordered))


def profile_key(model: Mapping[str, Any], parallel: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of the model's and the parallel config's fields (e.g. the
    config.json values, dtype, kernels; dp/ep sizes, device name)."""
    blob = json.dumps({"model": model, "parallel": parallel}, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


class ProfileCache:
    """Step-time curves in one JSON file, `{key: {"sizes": [...], "ms": [...]}}`.

    Writes are atomic (a temporary file in the same folder, renamed over the cache), so a reader sees
    the old or the new file, never a partial one. Concurrent writers cannot corrupt it, but the last
    rename wins: an entry another process stored in between is lost (and measured again next time).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, Any]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.path}: not JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{self.path}: expected a JSON object of profiles")
        return data

    def load(self, key: str) -> StepTimeCurve | None:
        """The curve stored under `key`, or None (no file, or no such entry).

        Raises:
            OSError: the file exists but cannot be read.
            ValueError: the file is not a JSON object, or the entry of `key` is not a valid curve; the
                message names the file.
        """
        entry = self._read().get(key)
        if entry is None:
            return None
        try:
            return StepTimeCurve(tuple(int(s) for s in entry["sizes"]), tuple(float(m) for m in entry["ms"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{self.path}: the entry {key[:12]}... is not a step-time curve ({err!r})") from None

    def store(self, key: str, curve: StepTimeCurve) -> None:
        """Add or replace `key`, keeping the file's other entries (a file that is not a JSON object of
        profiles is replaced whole).

        Raises:
            OSError: the folder or the file cannot be read or written.
        """
        try:
            data = self._read()
        except ValueError:
            data = {}
        data[key] = {"sizes": list(curve.sizes), "ms": list(curve.ms)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(data, out, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)        # mkstemp's 0600 would hide a shared cache from other users
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def load_or_profile(self, key: str, run_step: Callable[[int], float], sizes: Iterable[int]) -> StepTimeCurve:
        """The cached curve for `key`, else profile it now and cache it.

        Raises:
            OSError / ValueError: as `load` (an unreadable or corrupt file) and `store`; the engine
                (deepinfer.engine.speculative.varlen_profile) measures again and warns instead.
        """
        curve = self.load(key)
        if curve is None:
            curve = profile_step_times(run_step, sizes)
            self.store(key, curve)
        return curve
