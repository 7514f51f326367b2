"""BlockManager.for_state_slots: slot count rule and DEEPINFER_NUM_STATE_SLOTS_RATIO handling."""

from __future__ import annotations

import pytest

ENV = "DEEPINFER_NUM_STATE_SLOTS_RATIO"


@pytest.fixture(autouse=True)
def _no_ratio_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


def test_default_ratio_is_1_2_plus_dummy_slot(manager_cls) -> None:
    slots = manager_cls.for_state_slots(256)
    assert slots.num_blocks == int(256 * 1.2) + 1 == 308
    assert type(slots) is manager_cls
    assert slots.allocate(2).tolist() == [1, 2]  # slot 0 is the dummy, never handed out


@pytest.mark.parametrize(("max_num_seqs", "ratio", "num_slots"), [(10, 1.0, 11), (7, 2.5, 18), (3, 0.5, 2)])
def test_explicit_ratio(manager_cls, max_num_seqs: int, ratio: float, num_slots: int) -> None:
    assert manager_cls.for_state_slots(max_num_seqs, ratio).num_blocks == num_slots


def test_env_var_sets_the_ratio_and_an_explicit_ratio_wins(manager_cls, monkeypatch) -> None:
    monkeypatch.setenv(ENV, "2")
    assert manager_cls.for_state_slots(10).num_blocks == 21
    assert manager_cls.for_state_slots(10, ratio=1.5).num_blocks == 16
    monkeypatch.setenv(ENV, " 1.25 ")
    assert manager_cls.for_state_slots(8).num_blocks == 11


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("abc", r"DEEPINFER_NUM_STATE_SLOTS_RATIO='abc' is not a number; it must be a float > 0"),
        ("", r"DEEPINFER_NUM_STATE_SLOTS_RATIO='' is not a number"),
        ("0", r"DEEPINFER_NUM_STATE_SLOTS_RATIO=0.0 must be a finite float > 0"),
        ("-1.5", r"DEEPINFER_NUM_STATE_SLOTS_RATIO=-1.5 must be a finite float > 0"),
        ("nan", r"DEEPINFER_NUM_STATE_SLOTS_RATIO=nan must be a finite float > 0"),
        ("inf", r"DEEPINFER_NUM_STATE_SLOTS_RATIO=inf must be a finite float > 0"),
        ("0.01", r"DEEPINFER_NUM_STATE_SLOTS_RATIO=0.01 with max_num_seqs=4 gives no usable state slot"),
    ],
)
def test_bad_env_var_is_a_clear_error(manager_cls, monkeypatch, value: str, match: str) -> None:
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=match):
        manager_cls.for_state_slots(4)


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
