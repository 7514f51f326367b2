"""Exact-id and misuse tests of BlockManager (both implementations, see conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.cache._pure.block_pool import BlockManager as PureBlockManager


def snapshot(manager) -> tuple:
    """Everything observable: free order, counts and every refcount."""
    refs = tuple(manager.ref_count(b) for b in range(manager.num_blocks))
    return (manager.free_block_ids().tolist(), manager.num_free, manager.usage, refs)


def test_allocation_order_is_head_first_and_freed_blocks_join_the_tail(manager_cls) -> None:
    manager = manager_cls(5)  # block 0 reserved: usable 1..4
    first = manager.allocate(2)
    assert first.dtype == np.int32 and first.tolist() == [1, 2]
    assert manager.free(first) == 2
    assert manager.allocate(1).tolist() == [3]
    assert manager.free_block_ids().tolist() == [4, 1, 2]
    assert manager.allocate(3).tolist() == [4, 1, 2]
    assert manager.num_free == 0
    manager.free([2])
    manager.free(np.array([4], dtype=np.int64))
    assert manager.allocate(2).tolist() == [2, 4]
    manager.check_integrity()


def test_free_order_follows_when_each_block_reaches_zero(manager_cls) -> None:
    manager = manager_cls(6)
    manager.allocate(5)  # [1..5]
    manager.pin([1])  # block 1 now holds 2 references
    assert manager.free([1, 2, 1, 3]) == 3  # 2 reaches 0, then 1, then 3
    assert manager.free_block_ids().tolist() == [2, 1, 3]
    assert manager.allocate(3).tolist() == [2, 1, 3]
    manager.check_integrity()


def test_pin_shares_a_block_until_the_last_free(manager_cls) -> None:
    manager = manager_cls(4)
    ids = manager.allocate(2)
    manager.pin(ids)
    manager.pin([2])
    assert [manager.ref_count(b) for b in (0, 1, 2, 3)] == [0, 2, 3, 0]
    assert manager.free(ids) == 0
    assert manager.num_free == 1
    assert manager.free([1, 2, 2]) == 2
    assert manager.free_block_ids().tolist() == [3, 1, 2]
    assert manager.usage == 0.0
    manager.check_integrity()


def test_counts_usage_and_can_allocate(manager_cls) -> None:
    manager = manager_cls(9)
    assert (manager.num_blocks, manager.num_free, manager.usage) == (9, 8, 0.0)
    manager.allocate(6)
    assert manager.num_free == 2 and manager.usage == 0.75
    assert manager.can_allocate(2) and not manager.can_allocate(3) and manager.can_allocate(0)
    manager.allocate(2)
    assert manager.usage == 1.0 and manager.num_free == 0


def test_allocate_zero_and_empty_free(manager_cls) -> None:
    manager = manager_cls(3)
    empty = manager.allocate(0)
    assert empty.dtype == np.int32 and empty.shape == (0,)
    assert manager.free([]) == 0
    manager.pin(np.empty(0, dtype=np.int32))
    assert manager.num_free == 2


def test_accepts_numpy_integer_arguments_and_non_contiguous_ids(manager_cls) -> None:
    manager = manager_cls(np.int64(8))
    ids = manager.allocate(np.int32(6))
    assert manager.ref_count(np.int64(3)) == 1
    assert manager.free(ids[::2]) == 3  # blocks 1, 3, 5
    assert manager.free_block_ids().tolist() == [7, 1, 3, 5]
    assert manager.free(ids[1::2].astype(np.uint16)) == 3
    manager.check_integrity()


@pytest.mark.parametrize(
    ("action", "match"),
    [
        (lambda m: m.allocate(4), r"num=4 exceeds the 3 free blocks"),
        (lambda m: m.allocate(-1), r"num=-1 must be >= 0"),
        (lambda m: m.allocate(1.0), r"num must be an int"),
        (lambda m: m.allocate(True), r"num must be an int"),
        (lambda m: m.can_allocate(-2), r"num=-2 must be >= 0"),
        (lambda m: m.free([0]), r"block 0 is reserved"),
        (lambda m: m.pin([1, 0]), r"block 0 is reserved"),
        (lambda m: m.free([1, 7]), r"block id 7 out of range \[1, 7\)"),
        (lambda m: m.free([-3, 1]), r"block id -3 out of range"),
        (lambda m: m.pin([99]), r"block id 99 out of range"),
        (lambda m: m.free([1, 2**40]), r"block id 1099511627776 out of range \[1, 7\)"),
        (lambda m: m.pin(np.array([1, 2**33 + 1])), r"block id 8589934593 out of range"),
        (lambda m: m.free(np.array([1, 2**63], dtype=np.uint64)), r"block id 9223372036854775808 out of range"),
        (lambda m: m.free([1, 4, 2]), r"block 2 is freed 1 time\(s\) but holds 0 reference"),
        (lambda m: m.free([4, 1, 4]), r"block 4 is freed 2 time\(s\) but holds 1 reference"),
        (lambda m: m.free([3, 3, 1, 3]), r"block 3 is freed 3 time\(s\) but holds 2 reference"),
        (lambda m: m.pin([1, 5]), r"block 5 is not allocated"),
        (lambda m: m.free([[1, 2]]), r"ids must be 1-D"),
        (lambda m: m.free([1.0]), r"ids must be integers"),
        (lambda m: m.pin(np.array([True])), r"ids must be integers"),
        (lambda m: m.ref_count(7), r"block_id=7 out of range \[0, 7\)"),
        (lambda m: m.ref_count(-1), r"block_id=-1 out of range"),
    ],
)
def test_misuse_raises_and_changes_nothing(manager_cls, action, match: str) -> None:
    manager = manager_cls(7)
    manager.allocate(3)  # 1, 2, 3 held once
    manager.pin([3])  # 3 held twice
    manager.free([2])  # free list: 4, 5, 6, 2
    manager.allocate(1)  # takes 4; now refcounts 1:1 2:0 3:2 4:1, free list 5, 6, 2
    before = snapshot(manager)
    with pytest.raises(ValueError, match=match):
        action(manager)
    assert snapshot(manager) == before
    manager.check_integrity()


def test_rejected_free_undoes_blocks_it_had_already_released(manager_cls) -> None:
    manager = manager_cls(6)
    manager.allocate(4)
    before = snapshot(manager)
    with pytest.raises(ValueError, match="block 1 is freed 2 time"):
        manager.free([3, 4, 2, 1, 1])  # 3, 4, 2 and 1 would reach 0 before the second 1
    assert snapshot(manager) == before
    manager.free([3])
    assert manager.allocate(2).tolist() == [5, 3]  # free list was untouched: 5, then the freed 3
    manager.check_integrity()


def test_pin_overflow_is_rejected() -> None:
    # Reaching 2**31 - 1 references through the public API needs an 8-GiB id array, so this runs on
    # the pure twin only, with its refcount set directly; the Cython check mirrors it line by line.
    manager = PureBlockManager(3)
    manager.allocate(1)
    manager._ref_counts[1] = 2**31 - 3
    manager.pin([1])
    with pytest.raises(ValueError, match=r"block 1: refcount 2147483646 \+ 2 overflows int32"):
        manager.pin([1, 1])
    assert manager.ref_count(1) == 2**31 - 2


@pytest.mark.parametrize(
    ("num_blocks", "match"),
    [(1, r"num_blocks=1 out of range"), (0, r"out of range"), (-5, r"out of range"),
     (2**31, r"num_blocks=2147483648 out of range"), (4.0, r"num_blocks must be an int"),
     (None, r"num_blocks must be an int")],
)
def test_bad_num_blocks(manager_cls, num_blocks, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        manager_cls(num_blocks)


def test_smallest_pool_has_one_usable_block(manager_cls) -> None:
    manager = manager_cls(2)
    assert manager.allocate(1).tolist() == [1]
    assert not manager.can_allocate(1)
    assert repr(manager) == "BlockManager(num_blocks=2, num_free=0)"
