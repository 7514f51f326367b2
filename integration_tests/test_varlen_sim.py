"""benchmarks/varlen_sim.py: the fixed-vs-varlen simulation on synthetic step-time curves, the
acceptance model, the curve's extension limit and the reading of a v4_decode_gpu.py JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scripts_under_test import load_script

from deepinfer.spec import SamplerRuntimeEstimator, StepTimeCurve

sim = load_script("benchmarks/varlen_sim.py")
P = sim.continuation_for_mean(3.2, 5)


def test_constant_continuation_gives_the_mean() -> None:
    assert sum(P**j for j in range(1, 6)) == pytest.approx(3.2, abs=1e-9)
    assert P == pytest.approx(0.8548, abs=1e-4)
    assert sim.continuation_for_mean(5.0, 5) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        sim.continuation_for_mean(5.5, 5)


def test_flat_curve_varlen_verifies_everything_and_never_loses() -> None:
    flat = StepTimeCurve((1, 1024), (10.0, 10.0))
    for r in (16, 32, 60, 96):
        res = sim.simulate(flat, [P] * 5, r, SamplerRuntimeEstimator())
        assert res.fixed_total_q == res.varlen_total_q == r * 6
        assert res.fixed_tokens == pytest.approx(r * 4.2)
        assert res.gain_percent == 0.0


def test_proportional_curve_varlen_cuts_to_the_golden_tokens() -> None:
    # ms = 0.1 · tokens: a draft (worth p^j < 1 token) never pays for its slot.
    steep = StepTimeCurve((1, 1024), (0.1, 102.4))
    res = sim.simulate(steep, [P] * 5, 16, SamplerRuntimeEstimator())
    assert (res.fixed_total_q, res.varlen_total_q) == (96, 16)
    assert res.varlen_tokens == 16.0 and res.varlen_ms == pytest.approx(1.6)
    assert res.gain_percent == pytest.approx(100 * (6 / 4.2 - 1))


def test_linear_curve_with_a_fixed_cost_cuts_the_last_two_drafts() -> None:
    # ms = 2 + 0.1 · tokens. At 16 requests each draft level adds 16 tokens (1.6 ms) worth 16 · p^j:
    # tokens/ms is 6.08, 6.12, 5.99, 5.79 with 2, 3, 4, 5 drafts verified, so varlen stops at 3.
    curve = StepTimeCurve((1, 1001), (2.1, 102.1))
    res = sim.simulate(curve, [P] * 5, 16, SamplerRuntimeEstimator())
    assert (res.fixed_total_q, res.varlen_total_q) == (96, 64)
    assert res.varlen_ms == pytest.approx(8.4) and res.fixed_ms == pytest.approx(11.6)
    assert res.varlen_tokens == pytest.approx(16 * (1 + P + P**2 + P**3))
    assert res.gain_percent == pytest.approx(100 * ((1 + P + P**2 + P**3) / 8.4 / (4.2 / 11.6) - 1))
    lens = np.full(16, 4)
    assert sim.expected_tokens(np.tile([P] * 5, (16, 1)), lens) == pytest.approx(res.varlen_tokens)


def test_sampler_time_is_added_to_both_steps() -> None:
    flat = StepTimeCurve((1, 1024), (10.0, 10.0))
    res = sim.simulate(flat, [P] * 5, 32, sim.parse_sampler_ms("1:0.5,32:1.0,64:1.5"))
    assert res.fixed_ms == res.varlen_ms == pytest.approx(11.0)


def test_curve_is_extended_by_the_stated_factor_only() -> None:
    curve = StepTimeCurve((128, 256), (20.0, 30.0))
    extended, limit = sim.extend_curve(curve, 1.25)
    assert limit == 320 and extended.sizes == (128, 256, 320) and extended.ms[-1] == pytest.approx(35.0)
    assert sim.extend_curve(curve, 1.0) == (curve, 256)
    measured = sim.MeasuredCurve(curve, "synthetic", "none", 1024)
    rows, limit = sim.run_experiment(measured, [P] * 5, [16, 32, 60, 96], SamplerRuntimeEstimator(), 1.25)
    assert [(r.num_requests, r.needed_tokens, r.result is None) for r in rows] == [
        (16, 96, False), (32, 192, False), (60, 360, True), (96, 576, True)]


def test_load_curve_reads_graph_ms_and_skips_other_rows(tmp_path: Path) -> None:
    report = {"gpu": "NVIDIA H200", "context": 1024, "ours": [
        {"batch": 32, "eager_ms": 19.0, "graph_ms": 15.5},
        {"batch": 1, "eager_ms": 25.0, "graph_ms": 2.4},
        {"batch": 512, "error": "OutOfMemoryError"},
        {"batch": 8, "eager_ms": 17.0, "graph_error": "RuntimeError"},
        {"profile": {"batch": 1}}, {"prefill": {"prompt_len": 8192}}]}
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(report))
    measured = sim.load_curve(path)
    assert measured.curve == StepTimeCurve((1, 32), (2.4, 15.5))
    assert (measured.gpu, measured.context) == ("NVIDIA H200", 1024)
    path.write_text(json.dumps({"ours": [{"profile": {}}]}))
    with pytest.raises(ValueError):
        sim.load_curve(path)
