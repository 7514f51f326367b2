"""The block pools the scheduler is handed (`deepinfer.cache.BlockManager`s), as protocols: the
scheduler never imports the cache's classes, only their shape."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeGuard

import numpy as np

__all__ = ["BlockPool", "HashedBlockPool", "is_hashed"]


class BlockPool(Protocol):
    """What the scheduler uses of a `deepinfer.cache.BlockManager` (paged KV blocks or state slots;
    id 0 reserved), declared here so that the scheduler takes any pool with these methods (it imports
    only deepinfer.cache's hash chain, for prefix caching: prefix_cache.py)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def usage(self) -> float: ...

    def ref_count(self, block_id: int) -> int: ...

    def allocate(self, num: int) -> np.ndarray: ...

    def free(self, block_ids: Iterable[int] | np.ndarray) -> int: ...

    def pin(self, block_ids: Iterable[int] | np.ndarray) -> None: ...


class HashedBlockPool(BlockPool, Protocol):
    """What prefix caching uses of a `deepinfer.cache.BlockManager` (KV blocks or snapshot slots):
    the allocation calls plus the hash index that free blocks keep until they are reused."""

    @property
    def num_cached(self) -> int: ...

    def cache_block(self, block_id: int, block_hash: bytes) -> bool: ...

    def cached_block(self, block_hash: bytes) -> int: ...

    def match(self, block_hashes: Iterable[bytes]) -> int: ...

    def reuse(self, block_ids: Iterable[int] | np.ndarray) -> None: ...

    def drop_hashes(self) -> int: ...

    def record_evictions(self) -> None: ...

    def take_evictions(self) -> list[tuple[int, bytes]]: ...

    def check_integrity(self) -> None: ...


HASH_METHODS = ("cache_block", "cached_block", "match", "reuse", "drop_hashes", "num_cached", "check_integrity",
                "record_evictions", "take_evictions")


def is_hashed(pool: object) -> TypeGuard[HashedBlockPool]:
    """Whether `pool` has the hash index prefix caching needs (a `deepinfer.cache.BlockManager` has)."""
    return all(hasattr(pool, attr) for attr in HASH_METHODS)
