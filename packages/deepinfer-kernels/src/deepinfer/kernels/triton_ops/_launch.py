"""When the Triton kernels run, and at which dot-product precision."""

from __future__ import annotations

import os

from torch import Tensor


def on_triton(t: Tensor) -> bool:
    """Whether a kernel launch can take `t`: CUDA tensors, or any tensor under Triton's CPU
    interpreter (TRITON_INTERPRET=1, used to check the kernels without a GPU)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def precision(t: Tensor) -> str:
    """`tl.dot` input precision: exact float32 products for float32 inputs (not TF32)."""
    return "ieee" if t.dtype.is_floating_point and t.element_size() == 4 else "tf32"


def paged_inputs(paged: Tensor | None, block_tables: Tensor | None, entry_ids: Tensor | None,
                 placeholder: Tensor) -> tuple[Tensor, Tensor, Tensor, bool]:
    """(paged, block_tables, entry_ids, has_paged) for a kernel launch: with no paged stream the
    three are `placeholder` (a kernel compiled with HAS_PAGED=False never reads them).

    Raises:
        ValueError: a paged stream without its block tables or entry ids.
    """
    if paged is None:
        return placeholder, placeholder, placeholder, False
    if block_tables is None or entry_ids is None:
        raise ValueError("a paged stream needs its block tables and entry ids")
    return paged, block_tables, entry_ids, True
