import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from deepinfer.spec import ProfileCache, StepTimeCurve, profile_key, profile_step_times, trimmed_mean


def test_each_size_is_five_replays_without_min_and_max() -> None:
    replays = {1: iter([9.0, 1.0, 2.0, 3.0, 100.0]), 8: iter([4.0, 4.0, 4.0, 4.0, 4.0])}
    calls = []

    def run(size: int) -> float:
        calls.append(size)
        return next(replays[size])

    curve = profile_step_times(run, [8, 1])
    assert curve == StepTimeCurve((1, 8), (pytest.approx(14 / 3), 4.0))
    assert sorted(calls) == [1] * 5 + [8] * 5
    assert trimmed_mean([3.0, 5.0]) == 4.0


def test_curve_interpolates_between_sizes() -> None:
    curve = StepTimeCurve((1, 4, 8), (1.0, 4.0, 6.0))
    assert [curve.at(s) for s in (0, 1, 2, 6, 8, 20)] == [1.0, 1.0, 2.0, 5.0, 6.0, 6.0]
    with pytest.raises(ValueError):
        StepTimeCurve((4, 1), (1.0, 2.0))


def test_profile_cache_round_trips_and_is_keyed_by_config(tmp_path) -> None:
    cache = ProfileCache(tmp_path / "sub" / "profiles.json")
    key = profile_key({"hidden_size": 64, "dtype": "bf16"}, {"dp": 1, "ep": 1})
    assert key == profile_key({"dtype": "bf16", "hidden_size": 64}, {"ep": 1, "dp": 1})   # order-free
    other = profile_key({"hidden_size": 64, "dtype": "bf16"}, {"dp": 2, "ep": 2})
    assert other != key
    assert cache.load(key) is None
    counter = itertools.count()
    curve = cache.load_or_profile(key, lambda size: float(size + next(counter) % 3), [1, 2, 4])
    assert ProfileCache(cache.path).load(key) == curve
    assert cache.load(other) is None
    cache.store(other, StepTimeCurve((1,), (0.5,)))
    assert cache.load(key) == curve and cache.load(other) == StepTimeCurve((1,), (0.5,))

    def fail(size: int) -> float:
        raise AssertionError("a cached curve must not be measured again")

    assert cache.load_or_profile(key, fail, [1, 2, 4]) == curve


def test_a_corrupt_file_or_entry_raises_naming_the_file_and_store_replaces_it(tmp_path) -> None:
    cache = ProfileCache(tmp_path / "profiles.json")
    for text in ("{not json", "[1, 2]", ""):
        cache.path.write_text(text)
        with pytest.raises(ValueError, match=f"^{cache.path}: "):
            cache.load("a")
        cache.store("a", StepTimeCurve((1, 2), (1.0, 2.0)))        # the unreadable file is replaced whole
        assert json.loads(cache.path.read_text()) == {"a": {"sizes": [1, 2], "ms": [1.0, 2.0]}}
    for entry in ({"sizes": [2, 1], "ms": [1.0, 2.0]}, {"ms": [1.0]}, {"sizes": 3, "ms": [1.0]}, [1]):
        cache.path.write_text(json.dumps({"b": entry, "c": {"sizes": [1], "ms": [0.5]}}))
        with pytest.raises(ValueError, match=r"the entry b\.\.\. is not a step-time curve"):
            cache.load("b")
        assert cache.load("c") == StepTimeCurve((1,), (0.5,))
        cache.store("b", StepTimeCurve((4,), (3.0,)))              # a bad entry is replaced, the others kept
        assert cache.load("b") == StepTimeCurve((4,), (3.0,)) and cache.load("c") == StepTimeCurve((1,), (0.5,))
    with pytest.raises(OSError):
        ProfileCache(tmp_path).load("a")                           # a folder: unreadable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profiles.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    cache = ProfileCache(tmp_path / "profiles.json")
    cache.store("a", StepTimeCurve((1,), (1.0,)))
    before = cache.path.read_text()

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        cache.store("b", StepTimeCurve((1,), (2.0,)))
    assert cache.path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["profiles.json"]


def test_concurrent_writers_leave_a_valid_file(tmp_path) -> None:
    path = tmp_path / "profiles.json"

    def write(worker: int) -> None:
        cache = ProfileCache(path)
        for i in range(25):
            cache.store(f"{worker}-{i}", StepTimeCurve((1, 2), (float(worker), float(i))))
            assert isinstance(json.loads(path.read_text()), dict)    # readers never see a partial file

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(4)))
    data = json.loads(path.read_text())
    assert data and all(ProfileCache(path).load(key) is not None for key in data)   # the last writer wins
    assert [p.name for p in tmp_path.iterdir()] == ["profiles.json"]
