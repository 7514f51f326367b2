"""Prefix caching in BlockManager (both implementations, see conftest.py) and the hash chain."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.cache import chain_hashes, root_hash
from deepinfer.cache._block_pool import BlockManager as CythonBlockManager
from deepinfer.cache._pure.block_pool import BlockManager as PureBlockManager

ROOT = root_hash(b"model-a/bf16")


def test_chain_hashes_depend_on_every_earlier_token_and_the_extra_key() -> None:
    tokens = list(range(10))
    full = chain_hashes(tokens, 4, ROOT)
    assert len(full) == 2 and all(len(h) == 32 for h in full)          # the 2 tokens of block 2 are not full
    assert chain_hashes(tokens[:8], 4, ROOT) == full
    assert chain_hashes(tokens, 4, full[0], first_block=1) == full[1:]  # resumes from a parent
    assert chain_hashes(tokens, 4, ROOT, num_blocks=1) == full[:1]
    changed = chain_hashes([99] + tokens[1:], 4, ROOT)
    assert changed[0] != full[0] and changed[1] != full[1]              # block 1 chains over block 0
    assert chain_hashes(tokens, 4, root_hash(b"model-a/fp8"))[0] != full[0]
    with pytest.raises(ValueError, match="extra_key"):
        root_hash("text")
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        chain_hashes([-1, 0], 2, ROOT)


def test_a_freed_block_keeps_its_hash_until_allocate_hands_it_out(manager_cls) -> None:
    manager = manager_cls(5)                              # usable 1..4
    h = chain_hashes(list(range(8)), 4, ROOT)
    blocks = manager.allocate(2)                          # [1, 2]
    assert manager.cache_block(1, h[0]) and manager.cache_block(2, h[1])
    assert not manager.cache_block(1, h[0])               # already holds it
    manager.free(blocks[::-1])                            # free list 3, 4, 2, 1: the chain's tail goes first
    assert manager.num_cached == 2 and manager.match(h) == 2
    assert [manager.cached_block(x) for x in h] == [1, 2]
    assert manager.allocate(2).tolist() == [3, 4]         # uncached blocks first: hashes kept
    assert manager.allocate(1).tolist() == [2]            # LRU among free: block 2 loses its hash
    assert manager.block_hash(2) is None and manager.cached_block(h[1]) == 0
    assert manager.match(h) == 1 and manager.num_cached == 1
    manager.check_integrity()


def test_evictions_are_recorded_once_asked_for_and_taken_once(manager_cls) -> None:
    manager = manager_cls(4)                              # usable 1..3
    h = chain_hashes(list(range(8)), 4, ROOT)
    manager.allocate(2)
    manager.cache_block(1, h[0])
    manager.cache_block(2, h[1])
    manager.free([2, 1])                                  # free list 3, 2, 1
    manager.allocate(2)                                   # 3, then 2 loses h[1]: not recorded yet
    assert manager.take_evictions() == []
    manager.record_evictions()
    manager.allocate(1)                                   # 1 loses h[0]
    assert manager.take_evictions() == [(1, h[0])] and manager.take_evictions() == []
    manager.free([1])
    manager.drop_hashes()                                 # forgetting is not evicting
    assert manager.take_evictions() == []


def test_reuse_takes_free_and_held_cached_blocks_by_reference(manager_cls) -> None:
    manager = manager_cls(6)
    h = chain_hashes(list(range(8)), 4, ROOT)
    manager.allocate(3)                                   # [1, 2, 3]
    manager.cache_block(1, h[0])
    manager.cache_block(2, h[1])
    manager.free([2, 3])                                  # 2 free but cached, 1 still held
    assert manager.free_block_ids().tolist() == [4, 5, 2, 3]
    manager.reuse([1, 2])
    assert [manager.ref_count(b) for b in (1, 2)] == [2, 1]
    assert manager.free_block_ids().tolist() == [4, 5, 3]     # 2 left the free list from its middle
    assert manager.num_free == 3
    assert manager.free([1, 2, 1]) == 2
    assert manager.free_block_ids().tolist() == [4, 5, 3, 2, 1]
    manager.check_integrity()


def test_a_duplicate_hash_leaves_the_second_block_uncached(manager_cls) -> None:
    manager = manager_cls(4)
    manager.allocate(2)
    assert manager.cache_block(1, b"x")
    assert not manager.cache_block(2, b"x")
    assert manager.block_hash(2) is None and manager.cached_block(b"x") == 1


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m.cache_block(3, b"h"), "not allocated"),
    (lambda m: m.cache_block(1, b"other"), "already holds another hash"),
    (lambda m: m.cache_block(1, "h"), "non-empty bytes"),
    (lambda m: m.cache_block(0, b"h"), r"block_id=0 out of range \[1, 5\)"),
    (lambda m: m.reuse([2]), "holds no hash"),
    (lambda m: m.reuse([1, 1]), "repeat"),
    (lambda m: m.reuse([0]), "reserved"),
    (lambda m: m.cached_block(b""), "non-empty bytes"),
])
def test_misuse_is_refused_and_changes_nothing(manager_cls, call, message) -> None:
    manager = manager_cls(5)
    manager.allocate(2)
    manager.cache_block(1, b"h")
    before = (manager.free_block_ids().tolist(), manager.num_cached, manager.block_hash(1))
    with pytest.raises(ValueError, match=message):
        call(manager)
    assert (manager.free_block_ids().tolist(), manager.num_cached, manager.block_hash(1)) == before


def test_drop_hashes_forgets_every_hash_and_keeps_the_blocks(manager_cls) -> None:
    manager = manager_cls(4)
    manager.allocate(2)
    manager.cache_block(1, b"a")
    manager.cache_block(2, b"b")
    manager.free([2])
    assert manager.drop_hashes() == 2
    assert manager.num_cached == 0 and manager.match([b"a"]) == 0
    assert manager.ref_count(1) == 1 and manager.free_block_ids().tolist() == [3, 2]
    manager.check_integrity()


@pytest.mark.parametrize("seed", [0, 1])
def test_cached_operation_streams_match_between_the_twins(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pools = CythonBlockManager(24), PureBlockManager(24)
    for pool in pools:
        pool.record_evictions()
    hashes = [bytes([k]) * 4 for k in range(1, 30)]
    for _ in range(500):
        op = rng.choice(["allocate", "free", "cache_block", "reuse", "drop_hashes"], p=[0.3, 0.3, 0.2, 0.18, 0.02])
        held = [b for b in range(1, 24) if pools[1].ref_count(b)]
        if op == "allocate":
            args = (int(rng.integers(0, 4)),)
        elif op == "free":
            args = (rng.choice(held, size=min(len(held), int(rng.integers(0, 3))), replace=False).astype(np.int32),)
        elif op == "cache_block":
            args = (int(rng.integers(1, 24)), hashes[int(rng.integers(0, len(hashes)))])
        elif op == "reuse":
            picked = (hashes[int(k)] for k in rng.integers(0, len(hashes), 2))
            args = ([pools[1].cached_block(h) for h in picked if pools[1].cached_block(h)],)
        else:
            args = ()
        outcomes = []
        for pool in pools:
            try:
                result = getattr(pool, op)(*args)
                outcomes.append(("ok", result.tolist() if isinstance(result, np.ndarray) else result))
            except ValueError as error:
                outcomes.append(("error", str(error)))
        assert outcomes[0] == outcomes[1], (op, args)
        assert pools[0].take_evictions() == pools[1].take_evictions()
        assert pools[0].free_block_ids().tolist() == pools[1].free_block_ids().tolist()
        assert [pools[0].block_hash(b) for b in range(1, 24)] == [pools[1].block_hash(b) for b in range(1, 24)]
    for pool in pools:
        pool.check_integrity()
