"""deepinfer.kernels — every numeric op of DeepSeek-V4, behind one per-device registry.

`deepinfer.kernels.reference` holds the pure-PyTorch twin of each op (the specification that
GPU kernels must match); `kernels_for(device)` resolves, per op, a registered device kernel or
the reference. Only the reference implementations exist so far.
"""

from importlib.metadata import version as _version

from . import reference
from .registry import OP_NAMES, KernelSet, kernels_for, register

__version__ = _version("deepinfer-kernels")
__all__ = ["OP_NAMES", "KernelSet", "kernels_for", "reference", "register"]
