"""The Cython decode core and its numpy twin: same results on the same inputs; fresh build."""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

import numpy as np
import pytest

from deepinfer.sched._pure import decode_core as pure

try:
    native = importlib.import_module("deepinfer.sched._decode_core")
except ImportError:  # the tests of the scheduler still run the twin; this file needs both
    native = None

needs_native = pytest.mark.skipif(native is None, reason="Cython decode core not built")


def test_native_core_is_built_from_the_current_source() -> None:
    assert native is not None, "deepinfer.sched._decode_core is not built: pip install -e packages/deepinfer-sched"
    source = Path(native.__file__).with_name("_decode_core.pyx")
    assert native.SOURCE_SHA256 == hashlib.sha256(source.read_bytes()).hexdigest(), (
        "the in-place build is older than _decode_core.pyx: pip install -e packages/deepinfer-sched"
    )


def make_case(rng: np.random.Generator, num_rows: int, capacity: int, width: int, block_size: int,
              query_len: int, spread: int):
    seq_len = np.zeros(capacity, dtype=np.int32)
    rows = rng.permutation(capacity)[:num_rows].astype(np.int32)
    seq_len[rows] = rng.integers(1, spread, num_rows)
    num_blocks = ((seq_len + block_size - 1) // block_size).astype(np.int32)
    table = np.zeros((capacity, width), dtype=np.int32)
    for row in range(capacity):
        table[row, : num_blocks[row]] = rng.integers(1, 1000, num_blocks[row])
    return dict(
        rows=rows,
        seq_len=seq_len,
        num_inflight=rng.integers(0, 3, capacity).astype(np.int32),
        pending_steps=rng.integers(0, 2, capacity).astype(np.int32),
        num_blocks=num_blocks,
        block_table=table,
        state_slot=rng.integers(1, 50, capacity).astype(np.int32),
        last_token=rng.integers(0, 5000, capacity).astype(np.int32),
    )


def run(core, case, query_len: int, block_size: int, width: int):
    case = {name: array.copy() for name, array in case.items()}
    num_rows = len(case["rows"])
    need = np.zeros(num_rows + 3, dtype=np.int32)
    total = core.count_new_blocks(case["rows"], case["seq_len"], case["num_blocks"], query_len,
                                  block_size, width, need)
    if total < 0:
        return total, None
    new_ids = np.arange(2000, 2000 + total, dtype=np.int32)
    outs = [np.zeros(num_rows + 3, dtype=np.int32) for _ in range(3)]
    used = core.commit_decode(case["rows"], need, new_ids, query_len, case["seq_len"],
                              case["num_inflight"], case["pending_steps"], case["num_blocks"],
                              case["block_table"], case["state_slot"], case["last_token"], *outs)
    tables = np.full((num_rows, used), -1, dtype=np.int32)
    core.gather_block_tables(case["rows"], case["block_table"], tables)
    return total, (used, case, [out[:num_rows] for out in outs], tables)


@needs_native
@pytest.mark.parametrize("spread", [4, 40, 4000])        # many ties ... few ties
@pytest.mark.parametrize("num_rows", [0, 1, 7, 300])
def test_twins_agree(num_rows: int, spread: int) -> None:
    rng = np.random.default_rng(num_rows * 31 + spread)
    for query_len, block_size in ((1, 4), (3, 1), (6, 16)):
        width = (spread + 2 * query_len) // block_size + 2
        case = make_case(rng, num_rows, num_rows + 5, width, block_size, query_len, spread)
        total_native, result_native = run(native, case, query_len, block_size, width)
        total_pure, result_pure = run(pure, case, query_len, block_size, width)
        assert total_native == total_pure
        used_native, case_native, outs_native, tables_native = result_native
        used_pure, case_pure, outs_pure, tables_pure = result_pure
        assert used_native == used_pure
        for name in case:
            np.testing.assert_array_equal(case_native[name], case_pure[name], err_msg=name)
        for out_native, out_pure in zip(outs_native, outs_pure):
            np.testing.assert_array_equal(out_native, out_pure)
        np.testing.assert_array_equal(tables_native, tables_pure)
        np.testing.assert_array_equal(tables_pure, case_pure["block_table"][case_pure["rows"], :used_pure])
        keys = case["seq_len"][case_pure["rows"]]
        assert (np.diff(keys) <= 0).all()                 # sorted by KV length, descending


@needs_native
def test_reversed_order_takes_the_merge_sort_path_and_stays_stable() -> None:
    capacity = 2000
    seq_len = np.repeat(np.arange(1, 201, dtype=np.int32), 10)   # ascending: worst case
    rows = np.arange(capacity, dtype=np.int32)
    results = []
    for core in (native, pure):
        order = rows.copy()
        lens = seq_len.copy()
        need = np.zeros(capacity, dtype=np.int32)
        outs = [np.zeros(capacity, dtype=np.int32) for _ in range(3)]
        width = core.commit_decode(order, need, np.zeros(0, dtype=np.int32), 1, lens,
                                   np.zeros(capacity, dtype=np.int32), np.zeros(capacity, dtype=np.int32),
                                   np.zeros(capacity, dtype=np.int32), np.zeros((capacity, 1), dtype=np.int32),
                                   np.ones(capacity, dtype=np.int32), np.zeros(capacity, dtype=np.int32),
                                   *outs)
        assert width == 0
        results.append(order)
    np.testing.assert_array_equal(results[0], results[1])
    expected = np.concatenate([np.arange(10 * block, 10 * block + 10) for block in range(199, -1, -1)])
    np.testing.assert_array_equal(results[0], expected)   # equal lengths keep their row order


@pytest.mark.parametrize("core", [pytest.param(native, id="cython", marks=needs_native),
                                  pytest.param(pure, id="numpy")])
def test_too_long_row_is_reported(core) -> None:
    rows = np.array([0, 1], dtype=np.int32)
    seq_len = np.array([3, 8], dtype=np.int32)
    num_blocks = np.array([1, 2], dtype=np.int32)
    need = np.zeros(2, dtype=np.int32)
    assert core.count_new_blocks(rows, seq_len, num_blocks, 1, 4, 3, need) == 1
    assert core.count_new_blocks(rows, seq_len, num_blocks, 5, 4, 3, need) == -2   # row index 1


@needs_native
def test_gather_refuses_a_mismatched_output() -> None:
    rows = np.array([0, 1], dtype=np.int32)
    table = np.zeros((2, 3), dtype=np.int32)
    with pytest.raises(ValueError, match="expected"):
        native.gather_block_tables(rows, table, np.zeros((1, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="expected"):
        native.gather_block_tables(rows, table, np.zeros((2, 4), dtype=np.int32))
