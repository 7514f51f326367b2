"""`LoadRecorder`: sliding-window sums."""

import numpy as np
import pytest

from deepinfer.eplb import LoadRecorder


def test_window_sums_the_last_steps_across_many_wraps() -> None:
    rng = np.random.default_rng(7)
    recorder = LoadRecorder(num_layers=3, num_logical_experts=5, window_steps=4)
    history = []
    for step in range(23):
        loads = rng.integers(0, 1000, size=(3, 5)) if step % 2 else rng.random((3, 5)) * 50
        recorder.record(loads)
        history.append(np.asarray(loads, dtype=np.float32).astype(np.float64))
        np.testing.assert_allclose(recorder.window_loads(), np.sum(history[-4:], axis=0), rtol=1e-12, atol=1e-9)
        assert recorder.num_steps == step + 1
        assert recorder.num_window_steps == min(step + 1, 4)


def test_integer_counts_are_exact() -> None:
    recorder = LoadRecorder(1, 2, window_steps=3)
    for counts in ([5, 0], [7, 1], [11, 2], [13, 3]):
        recorder.record([counts])
    np.testing.assert_array_equal(recorder.window_loads(), [[31, 6]])


def test_starts_empty_and_resets() -> None:
    recorder = LoadRecorder(2, 3, window_steps=10)
    np.testing.assert_array_equal(recorder.window_loads(), np.zeros((2, 3)))
    recorder.record(np.ones((2, 3), dtype=np.int32))
    np.testing.assert_array_equal(recorder.window_loads(), np.ones((2, 3)))
    recorder.reset()
    assert recorder.num_steps == 0
    np.testing.assert_array_equal(recorder.window_loads(), np.zeros((2, 3)))


def test_window_loads_is_a_copy() -> None:
    recorder = LoadRecorder(1, 2, window_steps=2)
    recorder.record([[1, 2]])
    recorder.window_loads()[0, 0] = 100
    np.testing.assert_array_equal(recorder.window_loads(), [[1, 2]])


@pytest.mark.parametrize(
    ("loads", "match"),
    [
        (np.zeros((2, 4)), r"loads must have shape \[2, 3\]"),
        (np.zeros(3), "loads must have 2 dims"),
        ([[1, 2, -3], [0, 0, 0]], r"loads\[0, 2\]=-3.0 must be >= 0"),
        ([[1, 2, float("nan")], [0, 0, 0]], r"loads\[0, 2\]=nan must be finite"),
    ],
)
def test_bad_loads_are_rejected_and_not_recorded(loads, match: str) -> None:
    recorder = LoadRecorder(2, 3, window_steps=5)
    with pytest.raises(ValueError, match=match):
        recorder.record(loads)
    assert recorder.num_steps == 0


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="window_steps=0"):
        LoadRecorder(1, 1, window_steps=0)
    with pytest.raises(ValueError, match="num_logical_experts=-1"):
        LoadRecorder(1, -1, window_steps=1)
