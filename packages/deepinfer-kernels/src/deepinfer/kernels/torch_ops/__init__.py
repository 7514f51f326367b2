"""Device-agnostic PyTorch implementations that are faster than the reference on a GPU and safe to
capture in a CUDA graph (static shapes, no host synchronisation). Registered for "cuda"."""

from .moe import moe_experts_grouped

__all__ = ["moe_experts_grouped"]
