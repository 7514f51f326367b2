"""Per-device kernel registry: one name per op, a reference twin always, faster ones by device.

    ops = kernels_for(torch.device("cpu"))
    y = ops.rms_norm(x, w, 1e-6)

A backend registers a lazy factory for (op name, device type); the factory runs on first use,
so heavy imports (TileLang, Triton) only happen when that backend is chosen. Every registered op
must have the same signature as its `deepinfer.kernels.reference` twin.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import reference

OpFactory = Callable[[], Callable[..., Any]]

OP_NAMES: tuple[str, ...] = tuple(reference.__all__)
_FACTORIES: dict[tuple[str, str], OpFactory] = {}


def register(op_name: str, device_type: str, factory: OpFactory) -> None:
    """Register a lazily built implementation of `op_name` for a torch device type ("cuda", ...).

    Raises:
        ValueError: unknown op name, or an implementation already registered for that pair.
    """
    if op_name not in OP_NAMES:
        raise ValueError(f"op_name={op_name!r} is not a reference op; known: {', '.join(OP_NAMES)}")
    key = (op_name, device_type)
    if key in _FACTORIES:
        raise ValueError(f"{op_name!r} already has an implementation for device type {device_type!r}")
    _FACTORIES[key] = factory
    _kernel_set.cache_clear()


class KernelSet:
    """The resolved implementation of every op for one device type (attribute per op name)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.sources: dict[str, str] = {}
        for name in OP_NAMES:
            factory = _FACTORIES.get((name, device_type))
            if factory is None:
                setattr(self, name, getattr(reference, name))
                self.sources[name] = "reference"
            else:
                setattr(self, name, factory())
                self.sources[name] = device_type

    def __getattr__(self, name: str) -> Any:  # only reached for names that were never set
        raise AttributeError(f"no kernel named {name!r}; known: {', '.join(OP_NAMES)}")


def kernels_for(device: torch.device | str) -> KernelSet:
    """The kernel set for `device` (by its type: every CUDA device shares one set)."""
    return _kernel_set(torch.device(device).type)


@functools.cache
def _kernel_set(device_type: str) -> KernelSet:
    return KernelSet(device_type)
