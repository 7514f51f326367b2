"""Decode CUDA-graph sizes, keyed by total query tokens (docs/design.md §7.4).

Sizes are the powers of two below `interval`, then every multiple of `interval`: 1, 2, 4, 8, 16,
24, … for the default interval 8. The runtime length of a step and the key of the graph it replays
come from the same function, `cuda_graph_key` (docs/design.md §7.4: a drafter whose keys and runtime
lengths drift apart replays the wrong graph).
"""

from __future__ import annotations

import numpy as np

DEFAULT_GRAPH_INTERVAL = 8   # DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL


def cuda_graph_key(total_q: int, interval: int = DEFAULT_GRAPH_INTERVAL) -> int:
    """The graph size a step of `total_q` query tokens runs in: the smallest size >= total_q.

    Raises:
        ValueError: total_q < 1 or interval < 1.
    """
    if total_q < 1 or interval < 1:
        raise ValueError(f"total_q={total_q} and interval={interval} must be >= 1")
    size = 1
    while size < interval and size < total_q:
        size *= 2
    if size >= total_q:
        return size
    return -(-total_q // interval) * interval


def cuda_graph_keys(total_qs: np.ndarray, interval: int = DEFAULT_GRAPH_INTERVAL) -> np.ndarray:
    """`cuda_graph_key` of each of [n] totals (all >= 1) at once -> [n] int64: the smallest power of two
    >= total_q up to interval; past it, the power of two the doubling stopped at if it holds total_q,
    else the next multiple of interval.

    Raises:
        ValueError: a total < 1 or interval < 1.
    """
    totals = np.asarray(total_qs, dtype=np.int64)
    if interval < 1 or (totals.size and totals.min() < 1):
        raise ValueError(f"totals and interval={interval} must be >= 1")
    power = np.left_shift(1, np.ceil(np.log2(totals)).astype(np.int64))     # smallest power of two >= total
    last_power = 1 << (interval - 1).bit_length()                            # where the doubling stops
    multiple = -(-totals // interval) * interval
    return np.where(totals <= interval, power, np.where(totals <= last_power, last_power, multiple))


def cuda_graph_sizes(max_total_q: int, interval: int = DEFAULT_GRAPH_INTERVAL) -> tuple[int, ...]:
    """Every graph size up to the one that holds `max_total_q`, ascending."""
    sizes = [cuda_graph_key(1, interval)]
    while sizes[-1] < max_total_q:
        sizes.append(cuda_graph_key(sizes[-1] + 1, interval))
    return tuple(sizes)
