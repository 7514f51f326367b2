"""Content hashes of paged KV blocks for prefix caching: a chain over full blocks of tokens.

The hash of block i names the KV of tokens [0, (i + 1) * block_size): sha256 over the previous
block's hash (the root hash for block 0) and the block's token ids as little-endian int32. The root
hash folds in an `extra_key` for everything else that changes the KV of the same tokens (model,
KV dtype and quantisation, ...), so two caches with different keys never share a block. sha256 (not
Python's `hash`) so that a crafted prompt cannot collide with another user's cached prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["chain_hashes", "root_hash"]

_DOMAIN = b"deepinfer.cache.prefix/1\0"


def root_hash(extra_key: bytes = b"") -> bytes:
    """The parent hash of block 0: sha256 of a domain tag and `extra_key` (32 bytes).

    Raises:
        ValueError: extra_key is not bytes.
    """
    if type(extra_key) is not bytes:
        raise ValueError(f"extra_key must be bytes, got {type(extra_key).__name__}")
    return hashlib.sha256(_DOMAIN + extra_key).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: bytes, first_block: int = 0,
                 num_blocks: int | None = None) -> list[bytes]:
    """Hashes of the full blocks first_block, first_block + 1, ... of `token_ids`.

    Args:
        token_ids: the sequence's tokens from position 0 (ids in [0, 2**31)).
        block_size: tokens per block, >= 1.
        parent: the hash of block first_block - 1 (`root_hash(...)` when first_block is 0).
        first_block: the first block to hash, >= 0.
        num_blocks: at most this many blocks (None: every full block).

    Returns:
        One 32-byte hash per full block, in order (fewer when the tokens run out).

    Raises:
        ValueError: block_size < 1, first_block < 0 or a token id outside [0, 2**31).
    """
    if block_size < 1 or first_block < 0:
        raise ValueError(f"block_size={block_size} must be >= 1 and first_block={first_block} >= 0")
    last = len(token_ids) // block_size
    if num_blocks is not None:
        last = min(last, first_block + num_blocks)
    if last <= first_block:
        return []
    tokens = np.asarray(token_ids[first_block * block_size:last * block_size], dtype=np.int64)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 2**31):
        raise ValueError("token ids must be in [0, 2**31)")
    raw = tokens.astype("<i4").tobytes()
    width = 4 * block_size
    hashes = []
    for index in range(last - first_block):
        parent = hashlib.sha256(parent + raw[index * width:(index + 1) * width]).digest()
        hashes.append(parent)
    return hashes
