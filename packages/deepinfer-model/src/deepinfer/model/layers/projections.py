"""`Projections`: what an attention layer's input projections hand to its prefill and decode paths
(`attention`, `batched_decode`)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Projections(NamedTuple):
    """A layer's projections of its input tokens (num_tokens = t):
    q [t, heads, head_dim] and kv [t, head_dim] (RMSNorm + RoPE applied, KV-quantised when asked);
    index_q [t, index heads, index dim] and index_w [t, index heads] float32 (CSA only); the
    compressors' (kv, gate) inputs [t, mult·width] in the model dtype (column views of one GEMM
    output), for the layer's compressor and the indexer's (None where absent)."""

    q: Tensor
    kv: Tensor
    index_q: Tensor | None
    index_w: Tensor | None
    comp: tuple[Tensor, Tensor] | None
    index_comp: tuple[Tensor, Tensor] | None
