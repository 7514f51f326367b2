"""deepinfer.kernels — every numeric op of DeepSeek-V4, behind one per-device registry.

`deepinfer.kernels.reference` holds the pure-PyTorch twin of each op (the specification that
GPU kernels must match); `kernels_for(device)` resolves, per op, a registered device kernel or
the reference. Registered for CUDA: Triton kernels (`triton_ops`, CUDA-graph safe) for the decode
path — attention, indexer + top-k, compressor, mHC, RMSNorm, RoPE, routing, experts, GEMV; every
other op runs its reference (see `backends.py`). `kernels_for(device, batch_invariant=True)` is the
set whose every output row is bitwise the same whatever batch it runs in (`deepinfer.kernels.invariant`
holds the PyTorch twins it uses where a reference op is not; docs/batch_invariance.md).
`repack_mxfp4_for_decode` re-packs MXFP4 expert codes once at load time for the small-batch expert
kernels' `packed` decoder (`mxfp4_layout`; `packed_layout_wanted` says when), the ops then take
`packed=True`.
"""

from importlib.metadata import version as _version

from . import invariant, reference
from .backends import packed_layout_wanted, register_builtin_backends
from .mxfp4_layout import repack_mxfp4_for_decode, unpack_mxfp4_from_decode
from .registry import OP_NAMES, KernelSet, kernels_for, register

register_builtin_backends()

__version__ = _version("deepinfer-kernels")
__all__ = ["OP_NAMES", "KernelSet", "invariant", "kernels_for", "packed_layout_wanted", "reference", "register",
           "repack_mxfp4_for_decode", "unpack_mxfp4_from_decode"]
