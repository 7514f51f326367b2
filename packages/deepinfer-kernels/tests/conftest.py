"""Shared fixtures of the kernel tests.

`kernel_bounds`: out-of-bounds accesses of Triton kernels, caught on CPU. Triton's interpreter
(TRITON_INTERPRET=1) runs a kernel's loads and stores as numpy reads and writes at raw addresses and
checks none of them, so an access past a tensor reads or writes neighbouring host memory quietly,
where the GPU would raise "an illegal memory access" (or, inside the caching allocator's segment,
read another tensor's bytes). While the fixture is active, every masked-in address of every load and
store is checked against the storages of that launch's tensor arguments (the only memory a kernel
may touch). Block-pointer, descriptor and atomic accesses are not checked.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest


@dataclass(frozen=True, slots=True)
class Violation:
    kernel: str
    kind: str                 # "load" or "store"
    num_bad: int              # addresses outside every tensor argument's storage
    num_checked: int          # masked-in addresses of that access
    offset: int               # of the first bad address from the nearest storage's start, in bytes


@dataclass(slots=True)
class BoundsLog:
    violations: list[Violation] = field(default_factory=list)
    launches: Counter[str] = field(default_factory=Counter)    # kernel name -> launches checked

    def assert_clean(self, *kernels: str) -> None:
        """No violation, and each of `kernels` was launched (so the check did run on it)."""
        missing = [k for k in kernels if not self.launches[k]]
        assert not missing, f"not launched under the check: {missing} (launched: {dict(self.launches)})"
        assert not self.violations, "out-of-bounds accesses:\n" + "\n".join(map(str, self.violations[:10]))


@pytest.fixture
def kernel_bounds() -> Iterator[BoundsLog]:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("bounds are checked under Triton's interpreter (TRITON_INTERPRET=1)")
    import numpy as np
    from triton.runtime import interpreter

    log = BoundsLog()
    launch: dict = {"kernel": "", "ranges": np.zeros((0, 2), dtype=np.int64)}
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init_args, load, store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges = [(s.data_ptr(), s.data_ptr() + s.nbytes())
                  for s in (a.untyped_storage() for a in [*args_hst, *kwargs_hst.values()] if hasattr(a, "data_ptr"))]
        launch["kernel"] = self.fn.__name__
        launch["ranges"] = np.array(ranges, dtype=np.int64).reshape(-1, 2)
        log.launches[self.fn.__name__] += 1
        return args_hst, kwargs_hst

    def check(ptrs, mask, kind: str) -> None:
        addresses = ptrs.data.astype(np.int64)
        if mask is not None:
            addresses = addresses[np.broadcast_to(mask.data.astype(bool), addresses.shape)]
        addresses = addresses.reshape(-1, 1)
        if addresses.size == 0:
            return
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        lo, hi = launch["ranges"][:, 0], launch["ranges"][:, 1]
        inside = ((addresses >= lo) & (addresses + size <= hi)).any(axis=1)
        if inside.all():
            return
        first = int(addresses[~inside][0, 0])
        offset = first
        if lo.size:
            nearest = int(np.argmin(np.maximum(np.maximum(lo - first, first + size - hi), 0)))
            offset = first - int(lo[nearest])
        log.violations.append(Violation(launch["kernel"], kind, int((~inside).sum()), int(inside.size), offset))

    def load_checked(self, ptrs, mask, other, *args):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, *args)

    def store_checked(self, ptrs, value, mask, *args):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args)

    executor._init_args_hst = init_args_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    try:
        yield log
    finally:
        executor._init_args_hst = init_args
        builder.create_masked_load, builder.create_masked_store = load, store
