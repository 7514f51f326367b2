"""benchmarks/scaleout_gpu.py on CPU over gloo: 2 EP ranks and the one-process baseline of the tiny
V4-Flash-shaped model run end to end and the JSON holds every figure (a function check only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_under_test import ROOT

LAYERS, BATCHES, TOP_K = 4, (1, 2), 2      # layers 0-2 hash-routed, 3 routed by the gate; tiny: top-2


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("scaleout") / "smoke.json"
    command = [sys.executable, str(ROOT / "benchmarks/scaleout_gpu.py"), "--device", "cpu", "--shape", "tiny",
               "--layers", str(LAYERS), "--batches", ",".join(map(str, BATCHES)), "--steps", "3",
               "--prompt-len", "8", "--timeout-s", "60", "--output", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(Path(output).read_text())


def test_setup_names_the_run(report: dict) -> None:
    setup = report["setup"]
    assert (setup["device"], setup["ranks"], setup["layers"], setup["baseline_layers"]) == ("cpu", 2, LAYERS, 2)
    assert setup["batches"] == list(BATCHES) and setup["shape"] == "tiny"


def test_ep_rows_hold_the_step_the_tokens_and_the_all_to_all(report: dict) -> None:
    assert [row["batch_per_rank"] for row in report["ep"]] == list(BATCHES)
    for row in report["ep"]:
        batch = row["batch_per_rank"]
        assert row["capacity_rows_per_peer"] == batch * TOP_K and row["max_num_seqs"] == batch
        assert row["step_ms"] == max(row["step_ms_by_rank"]) > 0 and len(row["step_ms_by_rank"]) == 2
        assert row["output_tokens_per_s"] == pytest.approx(2 * batch / row["step_ms"] * 1e3, rel=1e-2)
        assert row["all_to_all_calls_per_step"] == 3 * LAYERS       # slots, rows, results per MoE layer
        assert 0 < row["all_to_all_ms"] == row["all_to_all_ms_by_rank"][0] <= row["step_ms_by_rank"][0]
        assert row["all_to_all_share"] == pytest.approx(row["all_to_all_ms"] / row["step_ms_by_rank"][0], abs=1e-3)


def test_baseline_rows_hold_half_the_layers(report: dict) -> None:
    assert [(row["batch"], row["layers"], row["enforce_eager"]) for row in report["baseline"]] == [
        (batch, 2, True) for batch in BATCHES]
    for row in report["baseline"]:
        assert row["output_tokens_per_s"] == pytest.approx(row["batch"] / row["step_ms"] * 1e3, rel=1e-2)
