"""Balance metric: the load each GPU receives under a placement, and max / mean over GPUs.

A token routed to a replicated expert is assumed to go to each of its replicas equally often, so a
slot holding expert e carries load[e] / logcnt[e]. The forward of an MoE layer waits for its busiest
GPU, so max / mean GPU load is the slowdown over a perfect split (1.0 = perfect).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._inputs import load_array
from ._placement import ExpertPlacement, slot_gpu_loads


def _ratio(gpu: np.ndarray) -> np.ndarray:
    mean = gpu.mean(axis=-1)
    peak = gpu.max(axis=-1)
    return np.divide(peak, mean, out=np.ones_like(mean), where=mean > 0)


def _checked_loads(placement: ExpertPlacement, loads: Any) -> np.ndarray:
    array = load_array(loads, "loads", ndim=2)
    expected = (placement.num_layers, placement.num_logical_experts)
    if array.shape != expected:
        raise ValueError(
            f"loads must have shape {list(expected)} (layers, logical experts), got {list(array.shape)}"
        )
    return array


def gpu_loads(placement: ExpertPlacement, loads: Any) -> np.ndarray:
    """Load each GPU receives under `placement`.

    Args:
        placement: the expert placement.
        loads: [num_layers, num_logical_experts] finite loads >= 0 (numpy, torch or sequence).
    Returns:
        [num_layers, num_gpus] float64.
    Raises:
        ValueError: `loads` of the wrong shape or with NaN / infinite / negative entries.
    """
    array = _checked_loads(placement, loads)
    return slot_gpu_loads(
        placement.physical_to_logical, placement.logical_replica_counts, array, placement.num_gpus
    )


def balance_ratio(placement: ExpertPlacement, loads: Any) -> np.ndarray:
    """Per-layer max / mean GPU load under `placement`: [num_layers] float64, >= 1.0.

    A layer with zero total load counts as perfectly balanced (1.0).

    Raises:
        ValueError: as `gpu_loads`.
    """
    return _ratio(gpu_loads(placement, loads))


def overall_balance(placement: ExpertPlacement, loads: Any) -> float:
    """Sum over layers of the busiest GPU's load / sum over layers of the mean GPU load.

    The layers run one after another, so this is the whole model's slowdown over perfect balance
    (1.0 = perfect; 1.0 as well when every load is zero).

    Raises:
        ValueError: as `gpu_loads`.
    """
    gpu = gpu_loads(placement, loads)
    total_mean = float(gpu.mean(axis=1).sum())
    return float(gpu.max(axis=1).sum()) / total_mean if total_mean > 0 else 1.0
