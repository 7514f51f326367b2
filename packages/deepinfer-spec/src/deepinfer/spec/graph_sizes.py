"""Decode CUDA-graph sizes, keyed by total query tokens (docs/design.md §7.4).

Sizes are the powers of two below `interval`, then every multiple of `interval`: 1, 2, 4, 8, 16,
24, … for the default interval 8. The runtime length of a step and the key of the graph it replays
come from the same function, `cuda_graph_key` (docs/design.md §7.4: a drafter whose keys and runtime
lengths drift apart replays the wrong graph).
"""

from __future__ import annotations

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


def cuda_graph_sizes(max_total_q: int, interval: int = DEFAULT_GRAPH_INTERVAL) -> tuple[int, ...]:
    """Every graph size up to the one that holds `max_total_q`, ascending."""
    sizes = [cuda_graph_key(1, interval)]
    while sizes[-1] < max_total_q:
        sizes.append(cuda_graph_key(sizes[-1] + 1, interval))
    return tuple(sizes)
