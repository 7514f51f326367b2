"""Input conversion and validation shared by every public entry point.

Loads arrive as numpy arrays, torch tensors (on any device, any dtype) or nested sequences; torch is
never imported here: a tensor is recognised by its `detach`/`cpu` methods and converted through
numpy.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def positive_int(value: Any, name: str) -> int:
    """`value` as a Python int >= 1; ValueError naming `name` otherwise (bools are rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return int(value)


def non_negative_int(value: Any, name: str) -> int:
    """`value` as a Python int >= 0; ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer >= 0")
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return int(value)


def _to_numpy(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        # torch.Tensor (duck-typed): `.double()` also covers bfloat16, which numpy cannot hold.
        if value.is_complex():
            raise ValueError(f"{name} must hold real loads, got dtype {value.dtype}")
        value = value.detach().cpu().double().numpy()
    try:
        array = np.asarray(value)
    except ValueError as exc:  # ragged nested sequences
        raise ValueError(f"{name} must be a rectangular array of loads: {exc}") from None
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold real numbers (int or float), got dtype {array.dtype}")
    return array


def load_array(value: Any, name: str, ndim: int) -> np.ndarray:
    """`value` as a fresh float64 array of `ndim` dims, every extent >= 1, all loads finite and >= 0.

    Raises:
        ValueError: naming `name` for a wrong dtype, ndim or empty extent, or a NaN, infinite or
            negative load (with the index of the first bad entry).
    """
    array = _to_numpy(value, name)
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(array.shape)}")
    if 0 in array.shape:
        raise ValueError(f"{name} must not be empty, got shape {tuple(array.shape)}")
    array = np.array(array, dtype=np.float64)
    finite = np.isfinite(array)
    if not finite.all():
        where = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(f"{name}{list(where)}={array[where]} must be finite (no NaN or inf)")
    if (array < 0).any():
        where = tuple(int(i) for i in np.argwhere(array < 0)[0])
        raise ValueError(f"{name}{list(where)}={array[where]} must be >= 0")
    return array


def check_layout(
    num_logical_experts: int, num_physical_experts: int, num_gpus: int, num_nodes: int, replicas_name: str
) -> None:
    """Divisibility rules every placement obeys (slots split evenly over GPUs, GPUs over nodes).

    Raises:
        ValueError: naming the field that breaks a rule.
    """
    if num_physical_experts < num_logical_experts:
        raise ValueError(
            f"{replicas_name}={num_physical_experts} must be >= the number of logical experts "
            f"({num_logical_experts}): every expert needs at least one slot"
        )
    if num_physical_experts % num_gpus != 0:
        raise ValueError(f"{replicas_name}={num_physical_experts} must be a multiple of num_gpus={num_gpus}")
    if num_gpus % num_nodes != 0:
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
