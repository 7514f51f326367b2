import itertools

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
