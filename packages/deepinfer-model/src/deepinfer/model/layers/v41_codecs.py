"""How DeepSeek-V4.1 stores each kind of cached row (packed formats of deepinfer.kernels.reference.v41_quant).

The model is trained with its caches quantised, so writing a row packed and reading it back gives
exactly the values the model attends to. A head size the format's block does not divide (tiny test
models) keeps plain rows in the model dtype, unquantised — what transformers does for such shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from deepinfer.kernels import KernelSet, reference
from deepinfer.kernels.reference import packed_row_bytes

from ..config_v41 import DeepseekV41Config

_BLOCKS = {"mxfp8": 32, "fp4_e4m3": 16, "fp4_ue8m0": 32}


@dataclass(frozen=True, slots=True)
class RowCodec:
    """One kind of cached row: `fmt` ("mxfp8" window KV, "fp4_e4m3" compressed KV, "fp4_ue8m0" index
    keys) of `dim` channels, or "plain" rows of `dtype`."""

    fmt: str
    dim: int
    dtype: torch.dtype
    ops: Any = field(default=reference, compare=False)   # where the quantise / dequantise ops come from

    @classmethod
    def choose(cls, fmt: str, dim: int, dtype: torch.dtype, ops: Any = reference) -> RowCodec:
        """The packed format when its block divides `dim`, else plain rows of `dtype`; `ops` (a KernelSet,
        default the reference) quantises and dequantises."""
        return cls(fmt, dim, torch.uint8, ops) if dim % _BLOCKS[fmt] == 0 else cls("plain", dim, dtype, ops)

    @property
    def row_dim(self) -> int:
        """Elements of `dtype` per stored row (bytes for packed formats)."""
        return self.dim if self.fmt == "plain" else packed_row_bytes(self.fmt, self.dim)

    def encode(self, x: Tensor) -> Tensor:
        """[..., dim] float → stored rows [..., row_dim]."""
        if self.fmt == "mxfp8":
            return self.ops.quant_mxfp8_rows(x)
        if self.fmt == "plain":
            return x.to(self.dtype)
        return self.ops.quant_fp4_rows(x, e4m3_scales=self.fmt == "fp4_e4m3")

    def decode(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """Stored rows [..., row_dim] → [..., dim] in `dtype`."""
        if self.fmt == "mxfp8":
            return self.ops.dequant_mxfp8_rows(rows, self.dim).to(dtype)
        if self.fmt == "plain":
            return rows.to(dtype)
        return self.ops.dequant_fp4_rows(rows, self.dim, e4m3_scales=self.fmt == "fp4_e4m3").to(dtype)

    def round_trip(self, x: Tensor) -> Tensor:
        """x as the cache gives it back (the model's quantisation semantics), in x's dtype."""
        if self.fmt == "mxfp8":
            return self.ops.fake_quant_mxfp8(x)
        if self.fmt == "plain":
            return x
        return self.ops.fake_quant_fp4_rows(x, e4m3_scales=self.fmt == "fp4_e4m3")


@dataclass(frozen=True, slots=True)
class Codecs:
    """The row formats of a V4.1 model's caches."""

    window: RowCodec
    kv: RowCodec
    index: RowCodec

    @classmethod
    def for_model(cls, cfg: DeepseekV41Config, dtype: torch.dtype, ops: KernelSet | None = None) -> Codecs:
        """The formats for `cfg`; `ops` quantises and dequantises (default: the reference ops)."""
        kw = {} if ops is None else {"ops": ops}
        return cls(RowCodec.choose("mxfp8", cfg.head_dim, dtype, **kw),
                   RowCodec.choose("fp4_e4m3", cfg.head_dim, dtype, **kw),
                   RowCodec.choose("fp4_ue8m0", cfg.index_head_dim, dtype, **kw))
