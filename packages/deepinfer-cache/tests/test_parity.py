"""The Cython pool and its pure-Python twin give the same ids, counts and error messages."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.cache._block_pool import BlockManager as CythonBlockManager
from deepinfer.cache._pure.block_pool import BlockManager as PureBlockManager


def _apply(manager, op: str, arg):
    try:
        result = getattr(manager, op)(arg)
    except ValueError as error:
        return ("error", str(error))
    return ("ok", result.tolist() if isinstance(result, np.ndarray) else result)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operation_streams_match(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_blocks = 40
    cython_pool, pure_pool = CythonBlockManager(num_blocks), PureBlockManager(num_blocks)
    num_errors = 0
    for _ in range(600):
        op = rng.choice(["allocate", "free", "pin"], p=[0.4, 0.4, 0.2])
        if op == "allocate":
            arg = int(rng.integers(-1, 8))
        else:
            held = [b for b in range(1, num_blocks) if pure_pool.ref_count(b)]
            pool = held if held and rng.random() < 0.85 else list(range(-1, num_blocks + 1))
            arg = rng.choice(pool, size=int(rng.integers(0, 6))).astype(rng.choice([np.int32, np.int64]))
        outcome = _apply(cython_pool, op, arg)
        assert outcome == _apply(pure_pool, op, arg), (op, arg)
        num_errors += outcome[0] == "error"
        assert cython_pool.free_block_ids().tolist() == pure_pool.free_block_ids().tolist()
        assert cython_pool.num_free == pure_pool.num_free
    assert [cython_pool.ref_count(b) for b in range(num_blocks)] == [
        pure_pool.ref_count(b) for b in range(num_blocks)
    ]
    assert 0 < num_errors < 600  # the stream exercised both accepted and rejected calls
    cython_pool.check_integrity()
    pure_pool.check_integrity()
