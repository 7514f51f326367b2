"""ForwardBatch: `build` from per-sequence lists and `decode` from the scheduler's arrays give the same
batch, field by field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.model import ForwardBatch


def _assert_same(a: ForwardBatch, b: ForwardBatch) -> None:
    for name in ("token_ids", "positions", "block_tables", "state_slots", "logits_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.cu_seqlens == b.cu_seqlens and a.start_positions == b.start_positions
    assert (a.max_context_len, a.uniform_decode) == (b.max_context_len, b.uniform_decode)


def test_build_pads_ragged_block_tables_with_zeros() -> None:
    batch = ForwardBatch.build([[5, 6, 7], [8], [9, 10]], [0, 4, 2], [[3, 1, 4], [], np.array([2, 7])], [1, 2, 3],
                               logits="all")
    assert batch.block_tables.dtype == torch.int32
    assert batch.block_tables.tolist() == [[3, 1, 4], [0, 0, 0], [2, 7, 0]]
    assert batch.positions.tolist() == [0, 1, 2, 4, 2, 3]
    assert batch.cu_seqlens == (0, 3, 4, 6) and batch.logits_indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert batch.max_context_len == 5 and not batch.uniform_decode
    empty = ForwardBatch.build([[1]], [0], [[]], [1])
    assert empty.block_tables.tolist() == [[0]]


@pytest.mark.parametrize("num_seqs", [1, 7, 64])
def test_decode_from_arrays_equals_build_from_lists(num_seqs: int) -> None:
    rng = np.random.default_rng(num_seqs)
    token_ids = rng.integers(0, 4096, num_seqs).astype(np.int32)
    seq_lens = rng.integers(1, 300, num_seqs).astype(np.int32)
    width = int(-(-seq_lens.max() // 16))
    tables = np.zeros((num_seqs, width), dtype=np.int32)
    for row, seq_len in enumerate(seq_lens):
        num_blocks = -(-int(seq_len) // 16)
        tables[row, :num_blocks] = rng.integers(1, 10_000, num_blocks)
    slots = rng.integers(1, 500, num_seqs).astype(np.int32)
    decoded = ForwardBatch.decode(token_ids, seq_lens, tables, slots)
    built = ForwardBatch.build([[t] for t in token_ids.tolist()], [s - 1 for s in seq_lens.tolist()],
                               [row.tolist() for row in tables], slots.tolist(), logits="last")
    _assert_same(decoded, built)
    assert decoded.uniform_decode and decoded.max_context_len == int(seq_lens.max())


def test_decode_copies_the_scheduler_arrays() -> None:
    tables = np.array([[4, 5], [6, 0]], dtype=np.int32)
    batch = ForwardBatch.decode(np.array([1, 2], dtype=np.int32), np.array([20, 3], dtype=np.int32), tables,
                                np.array([1, 2], dtype=np.int32))
    tables[0, 0] = 99                       # the scheduler's buffers may be reused: the batch keeps its own
    assert batch.block_tables.tolist() == [[4, 5], [6, 0]]


def test_decode_refuses_inconsistent_arrays() -> None:
    one = np.array([1], dtype=np.int32)
    with pytest.raises(ValueError, match="must agree"):
        ForwardBatch.decode(one, np.array([3, 4], dtype=np.int32), np.zeros((1, 1), dtype=np.int32), one)
    with pytest.raises(ValueError, match="seq_lens must be >= 1"):
        ForwardBatch.decode(one, np.array([0], dtype=np.int32), np.zeros((1, 1), dtype=np.int32), one)
    with pytest.raises(ValueError, match="at least one sequence"):
        empty = np.zeros(0, dtype=np.int32)
        ForwardBatch.decode(empty, empty, np.zeros((0, 1), dtype=np.int32), empty)
