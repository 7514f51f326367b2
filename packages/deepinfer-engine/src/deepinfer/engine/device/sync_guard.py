"""`forbid_cuda_sync`: fail loudly when the launch of a ZOS step would wait for the device.

ZOS (docs/design.md §6) only overlaps host work with the GPU if launching a decode step never waits for
the device: one `.item()`, `.tolist()`, `.cpu()`, `nonzero()` or blocking copy on a device tensor
makes the CPU wait for every kernel queued before it, and the overlap is gone without any error.
The engine wraps the launch of each ZOS decode step (input update, graph replay, sampling) in this
guard:

- on CUDA it sets torch's sync debug mode to "error", so every synchronising CUDA call raises
  (torch's own check, at the synchronisation points inside torch);
- on the CPU, where nothing synchronises, it emulates that check with a `TorchFunctionMode` that
  raises on the tensor calls which would read device memory on the host (`HOST_READS`), so the CPU
  test suite catches a synchronising call added to the launch path.

`DEEPINFER_DISABLE_SYNC_GUARD=1` turns the guard off (debugging). The CUDA mode is process-wide:
while a step launches, a synchronising CUDA call from another thread raises too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class CudaSyncError(RuntimeError):
    """A synchronising call inside a guarded ZOS launch."""


# Tensor calls that copy device memory to the host (and so wait for the device on CUDA).
HOST_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
    torch.Tensor.unique, torch.unique, torch.Tensor.unique_consecutive,
})   # and indexing by a boolean mask


class _HostReadGuard(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in HOST_READS or (func is torch.Tensor.__getitem__ and _has_bool_mask(args[1])):
            name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
            raise CudaSyncError(f"{name} inside a ZOS launch reads device memory on the host (a CUDA "
                                "synchronisation); keep it out of the launch path, or set "
                                "DEEPINFER_DISABLE_SYNC_GUARD=1 to debug")
        return func(*args, **(kwargs or {}))


def _has_bool_mask(index: object) -> bool:
    """Whether an index holds a boolean tensor (indexing by a mask counts its True entries on the host)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


@contextmanager
def forbid_cuda_sync(device: torch.device, *, enabled: bool = True) -> Iterator[None]:
    """Raise on any host-device synchronisation inside the block.

    Args:
        device: the engine's device: CUDA uses torch's sync debug mode (raises RuntimeError from
            inside torch), the CPU the `HOST_READS` emulation (raises `CudaSyncError`).
        enabled: False = no guard.
    """
    if not enabled:
        yield
    elif device.type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    else:
        with _HostReadGuard():
            yield
