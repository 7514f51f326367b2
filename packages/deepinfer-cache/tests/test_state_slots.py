"""BlockManager.for_state_slots: the slot count rule and its argument checks."""

from __future__ import annotations

import pytest


def test_default_ratio_is_1_2_plus_dummy_slot(manager_cls) -> None:
    slots = manager_cls.for_state_slots(256)
    assert slots.num_blocks == int(256 * 1.2) + 1 == 308
    assert type(slots) is manager_cls
    assert slots.allocate(2).tolist() == [1, 2]  # slot 0 is the dummy, never handed out


@pytest.mark.parametrize(("max_num_seqs", "ratio", "num_slots"), [(10, 1.0, 11), (7, 2.5, 18), (3, 0.5, 2)])
def test_explicit_ratio(manager_cls, max_num_seqs: int, ratio: float, num_slots: int) -> None:
    assert manager_cls.for_state_slots(max_num_seqs, ratio).num_blocks == num_slots


def test_the_environment_is_not_read(manager_cls, monkeypatch) -> None:
    # the engine reads DEEPINFER_NUM_STATE_SLOTS_RATIO (deepinfer.engine.config.env) and passes the ratio in
    monkeypatch.setenv("DEEPINFER_NUM_STATE_SLOTS_RATIO", "2")
    assert manager_cls.for_state_slots(10).num_blocks == 13


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_seqs": 0}, r"max_num_seqs=0 must be >= 1"),
        ({"max_num_seqs": 2.0}, r"max_num_seqs must be an int"),
        ({"max_num_seqs": 4, "ratio": 0.0}, r"ratio=0.0 must be a finite float > 0"),
        ({"max_num_seqs": 4, "ratio": -1}, r"ratio=-1.0 must be a finite float > 0"),
        ({"max_num_seqs": 4, "ratio": "1.2"}, r"ratio must be a float > 0 or None"),
        ({"max_num_seqs": 4, "ratio": 0.2}, r"ratio=0.2 with max_num_seqs=4 gives no usable state slot"),
        ({"max_num_seqs": 2**30, "ratio": 4.0}, r"num_blocks=4294967297 out of range"),
    ],
)
def test_bad_arguments(manager_cls, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        manager_cls.for_state_slots(**kwargs)
