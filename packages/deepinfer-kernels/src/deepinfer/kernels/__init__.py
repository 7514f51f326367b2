"""deepinfer.kernels — every numeric op of DeepSeek-V4, behind one per-device registry.

`deepinfer.kernels.reference` holds the pure-PyTorch twin of each op (the specification that
GPU kernels must match); `kernels_for(device)` resolves, per op, a registered device kernel or
the reference. Registered so far, for CUDA: `moe_experts` → `torch_ops.moe_experts_grouped` (grouped
GEMMs over the active experts, CUDA-graph safe); `hc_pre`, `rms_norm`, `apply_rope` → Triton kernels
(`triton_ops`); every other op runs its reference.
"""

from importlib.metadata import version as _version

from . import reference
from .backends import register_builtin_backends
from .registry import OP_NAMES, KernelSet, kernels_for, register

register_builtin_backends()

__version__ = _version("deepinfer-kernels")
__all__ = ["OP_NAMES", "KernelSet", "kernels_for", "reference", "register"]
