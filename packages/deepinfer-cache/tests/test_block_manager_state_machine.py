"""Hypothesis state machine: random allocate / fork (pin) / release / misuse against a plain model."""

from __future__ import annotations

from collections import Counter, deque

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from deepinfer.cache._block_pool import BlockManager as CythonBlockManager
from deepinfer.cache._pure.block_pool import BlockManager as PureBlockManager

NUM_BLOCKS = 12


class BlockManagerMachine(RuleBasedStateMachine):
    """Owners are lists of block ids held by one simulated sequence; forks pin the parent's ids."""

    impl: type = PureBlockManager
    owners = Bundle("owners")

    def __init__(self) -> None:
        super().__init__()
        self.manager = self.impl(NUM_BLOCKS)
        self.model_free: deque[int] = deque(range(1, NUM_BLOCKS))
        self.model_refs: Counter[int] = Counter()
        self.live: dict[int, list[int]] = {}  # owner key -> ids it holds
        self.next_key = 0

    def _add_owner(self, ids: list[int]) -> int:
        self.next_key += 1
        self.live[self.next_key] = ids
        return self.next_key

    @rule(target=owners, num=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, num: int):
        if num > len(self.model_free):
            before = self.manager.free_block_ids().tolist()
            try:
                self.manager.allocate(num)
            except ValueError:
                assert self.manager.free_block_ids().tolist() == before
                return self._add_owner([])
            raise AssertionError(f"allocate({num}) with {len(self.model_free)} free did not raise")
        expected = [self.model_free.popleft() for _ in range(num)]
        ids = self.manager.allocate(num).tolist()
        assert ids == expected
        self.model_refs.update(ids)
        return self._add_owner(ids)

    @rule(target=owners, parent=owners)
    def fork(self, parent: int):
        ids = list(self.live.get(parent, []))
        self.manager.pin(ids)
        self.model_refs.update(ids)
        return self._add_owner(ids)

    @rule(owner=consumes(owners))
    def release(self, owner: int):
        ids = self.live.pop(owner, [])
        expected_released = 0
        for block in ids:
            self.model_refs[block] -= 1
            if self.model_refs[block] == 0:
                del self.model_refs[block]
                self.model_free.append(block)
                expected_released += 1
        assert self.manager.free(ids) == expected_released

    @rule(ids=st.lists(st.integers(-1, NUM_BLOCKS), max_size=6), pin=st.booleans())
    def arbitrary_ids(self, ids: list[int], pin: bool):
        """Random ids, valid or not: either the model accepts them or nothing may change."""
        tally = Counter(ids)
        valid = all(1 <= b < NUM_BLOCKS and self.model_refs[b] >= (1 if pin else tally[b]) for b in tally)
        if valid and not pin:
            return  # a valid foreign free would steal references from owners; covered by release()
        before = self._observed()
        if valid:
            self.manager.pin(ids)
            self.model_refs.update(ids)
            self._add_owner(list(ids))  # keep refcount == references held by owners
            return
        try:
            (self.manager.pin if pin else self.manager.free)(ids)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{'pin' if pin else 'free'}({ids}) should have been rejected")
        assert self._observed() == before

    def _observed(self) -> tuple[list[int], list[int]]:
        refs = [self.manager.ref_count(b) for b in range(NUM_BLOCKS)]
        return self.manager.free_block_ids().tolist(), refs

    @invariant()
    def matches_model(self) -> None:
        manager = self.manager
        assert manager.free_block_ids().tolist() == list(self.model_free)
        assert manager.num_free == len(self.model_free)
        held = Counter(b for ids in self.live.values() for b in ids)
        for block in range(NUM_BLOCKS):
            # refcount == references held by live owners: no leak, no double ownership.
            assert manager.ref_count(block) == self.model_refs[block] == held[block]
        assert manager.num_free + len(+self.model_refs) == NUM_BLOCKS - 1
        assert manager.usage == (NUM_BLOCKS - 1 - manager.num_free) / (NUM_BLOCKS - 1)
        manager.check_integrity()


MACHINE_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class CythonMachine(BlockManagerMachine):
    impl = CythonBlockManager


class PureMachine(BlockManagerMachine):
    impl = PureBlockManager


TestCythonBlockManagerMachine = CythonMachine.TestCase
TestCythonBlockManagerMachine.settings = MACHINE_SETTINGS
TestPureBlockManagerMachine = PureMachine.TestCase
TestPureBlockManagerMachine.settings = MACHINE_SETTINGS
