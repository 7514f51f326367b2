"""Shared argument checks and the state-slot sizing rule of both BlockManager implementations.

The slot ratio is an argument: the engine reads its setting (DEEPINFER_NUM_STATE_SLOTS_RATIO, in
deepinfer.engine.config.env) and passes the value in.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_STATE_SLOTS_RATIO = 1.2
MAX_NUM_BLOCKS = 2**31 - 1  # ids are int32; block num_blocks - 1 must fit


def check_num_blocks(num_blocks: object) -> int:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
        raise ValueError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
    value = int(num_blocks)
    if not 2 <= value <= MAX_NUM_BLOCKS:
        raise ValueError(
            f"num_blocks={value} out of range: must be in [2, {MAX_NUM_BLOCKS}] "
            "(block 0 is reserved, so at least one usable block is needed)"
        )
    return value


def check_count(name: str, count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(count).__name__}")
    value = int(count)
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value


def check_hash(block_hash: object) -> bytes:
    """A block's content hash: non-empty bytes (`deepinfer.cache.prefix` makes 32-byte sha256 digests)."""
    if type(block_hash) is not bytes or not block_hash:
        raise ValueError(f"block_hash must be non-empty bytes, got {type(block_hash).__name__}")
    return block_hash


def as_id_array(ids: object) -> np.ndarray:
    """Any 1-D integer sequence -> contiguous int64 array; floats, bools and 2-D input are refused."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > MAX_NUM_BLOCKS:
        # int64 would wrap these; every other integer dtype converts exactly
        raise ValueError(f"block id {int(arr.max())} out of range (ids must fit in int32)")
    return np.ascontiguousarray(arr, dtype=np.int64)


def resolve_state_slots(max_num_seqs: object, ratio: float | None) -> int:
    """Number of state slots, dummy slot 0 included: int(max_num_seqs * ratio) + 1.

    ratio None means the default, 1.2.
    """
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, (int, np.integer)):
        raise ValueError(f"max_num_seqs must be an int, got {type(max_num_seqs).__name__}")
    num_seqs = int(max_num_seqs)
    if num_seqs < 1:
        raise ValueError(f"max_num_seqs={num_seqs} must be >= 1")
    if ratio is None:
        value = DEFAULT_STATE_SLOTS_RATIO
        source = "default ratio"
    else:
        source = "ratio"
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.integer, np.floating)):
            raise ValueError(f"ratio must be a float > 0 or None, got {type(ratio).__name__}")
        value = float(ratio)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{source}={value!r} must be a finite float > 0")
    num_usable = int(num_seqs * value)
    if num_usable < 1:
        raise ValueError(
            f"{source}={value!r} with max_num_seqs={num_seqs} gives no usable state slot; "
            "int(max_num_seqs * ratio) must be >= 1"
        )
    return check_num_blocks(num_usable + 1)
