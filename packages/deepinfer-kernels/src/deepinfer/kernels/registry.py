"""Per-device kernel registry: one name per op, a reference twin always, faster ones by device.

    ops = kernels_for(torch.device("cpu"))
    y = ops.rms_norm(x, w, 1e-6)

A backend registers a lazy factory for (op name, device type); the factory runs on first use,
so heavy imports (TileLang, Triton) only happen when that backend is chosen. Every registered op
must have the same signature as its `deepinfer.kernels.reference` twin.

The batch-invariant set (`kernels_for(device, batch_invariant=True)`, docs/design.md §12) resolves each op
to a kernel registered with `batch_invariant=True` for the device, else its PyTorch twin in
`deepinfer.kernels.invariant`, else (ops in `invariant.AS_REFERENCE`) the ordinary resolution.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import invariant, reference

OpFactory = Callable[[], Callable[..., Any]]

OP_NAMES: tuple[str, ...] = tuple(reference.__all__)
_FACTORIES: dict[tuple[str, str, bool], OpFactory] = {}


def register(op_name: str, device_type: str, factory: OpFactory, *, batch_invariant: bool = False) -> None:
    """Register a lazily built implementation of `op_name` for a torch device type ("cuda", ...);
    with `batch_invariant`, the one the batch-invariant set uses (its every output row must not
    depend on the other rows of the call, nor on their number).

    Raises:
        ValueError: unknown op name, or an implementation already registered for that pair and mode.
    """
    if op_name not in OP_NAMES:
        raise ValueError(f"op_name={op_name!r} is not a reference op; known: {', '.join(OP_NAMES)}")
    key = (op_name, device_type, batch_invariant)
    if key in _FACTORIES:
        mode = "batch-invariant " if batch_invariant else ""
        raise ValueError(f"{op_name!r} already has a {mode}implementation for device type {device_type!r}")
    _FACTORIES[key] = factory
    _kernel_set.cache_clear()


class KernelSet:
    """The resolved implementation of every op for one device type (attribute per op name).

    Attributes:
        device_type: the torch device type.
        batch_invariant: every op's output rows are bitwise independent of the batch they run in.
        sources: op name → where its implementation comes from: "reference", the device type (a
            registered kernel), "<device type>-invariant" (a registered batch-invariant kernel) or
            "invariant" (the PyTorch twin of `deepinfer.kernels.invariant`).
    """

    def __init__(self, device_type: str, batch_invariant: bool = False) -> None:
        self.device_type = device_type
        self.batch_invariant = batch_invariant
        self.sources: dict[str, str] = {}
        for name in OP_NAMES:
            impl, self.sources[name] = _resolve(name, device_type, batch_invariant)
            setattr(self, name, impl)

    def __getattr__(self, name: str) -> Any:  # only reached for names that were never set
        raise AttributeError(f"no kernel named {name!r}; known: {', '.join(OP_NAMES)}")


def _resolve(name: str, device_type: str, batch_invariant: bool) -> tuple[Callable[..., Any], str]:
    if batch_invariant:
        factory = _FACTORIES.get((name, device_type, True))
        if factory is not None:
            return factory(), f"{device_type}-invariant"
        if name not in invariant.AS_REFERENCE:
            return getattr(invariant, name), "invariant"
    factory = _FACTORIES.get((name, device_type, False))
    if factory is None:
        return getattr(reference, name), "reference"
    return factory(), device_type


def kernels_for(device: torch.device | str, *, batch_invariant: bool = False) -> KernelSet:
    """The kernel set for `device` (by its type: every CUDA device shares one set); with
    `batch_invariant`, the set whose outputs do not depend on the batch (see the module docstring)."""
    return _kernel_set(torch.device(device).type, batch_invariant)


@functools.cache
def _kernel_set(device_type: str, batch_invariant: bool) -> KernelSet:
    return KernelSet(device_type, batch_invariant)
