"""Host-to-device copies that never synchronise: small step inputs go through pinned memory.

A copy from pageable memory to a CUDA device may wait for the stream (the driver stages it), which
would stall the CPU behind the GPU's queued work and defeat ZOS. `to_device` stages host arrays in
pinned memory from torch's caching host allocator and copies them with `non_blocking=True`; the
allocator does not hand the pinned block out again before the copy has run, so no buffer is
overwritten early. On the CPU the array is wrapped without a copy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_device(array: np.ndarray | Tensor, device: torch.device) -> Tensor:
    """`array` (a numpy array or a CPU tensor) as a tensor on `device` (same dtype and shape).

    On CUDA: one pinned staging copy on the host, then one asynchronous host-to-device copy. On the
    CPU: a tensor sharing `array`'s memory (the caller must not change the array afterwards).
    """
    if isinstance(array, Tensor):
        return array.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else array
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(array))
    staged = torch.empty(array.shape, dtype=_TORCH_DTYPES[array.dtype.type], pin_memory=True)
    staged.numpy()[...] = array
    return staged.to(device, non_blocking=True)


def host_staging(shape: tuple[int, ...], device: torch.device) -> tuple[np.ndarray, Tensor]:
    """An int64 host buffer to fill and then copy to `device` without waiting: (its numpy view, the
    tensor), pinned on CUDA; on the CPU made from numpy, so filling it calls no tensor method (the sync
    guard's CPU emulation counts `Tensor.numpy` as a host read)."""
    if device.type != "cuda":
        array = np.empty(shape, dtype=np.int64)
        return array, torch.from_numpy(array)
    staged = torch.empty(shape, dtype=torch.int64, pin_memory=True)
    return staged.numpy(), staged


def to_host(tensors: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], torch.cuda.Event | None]:
    """Start copying device tensors back to the host without waiting.

    Returns:
        (host tensors, event): on CUDA pinned host tensors filled asynchronously and the event that
        marks the copies done (wait on it before reading them); on the CPU the tensors themselves and
        None.
    """
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
    for dst, src in zip(host, tensors):
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32, np.bool_: torch.bool}
