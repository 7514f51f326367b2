"""benchmarks/spec_gpu.py (issue #31 item 4) on CPU with its tiny shape: plain and speculative runs
end to end with every figure in the JSON, the acceptance rates solved for each mean accepted length,
and the acceptance override reachable from no engine argument, environment variable, server or
command flag (it patches the script's own process, inside a `with` only)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_under_test import ROOT, load_script

from deepinfer.engine import EngineArgs
from deepinfer.engine.cli import build_parser
from deepinfer.engine.config.env import EngineEnv
from deepinfer.engine.speculative import spec_step

CONCURRENCY, LENGTHS = (1, 2), (2.0, 4.0)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # --no-varlen: every drafting row verifies its k drafts, so the figures below do not hang on this
    # machine's timings (varlen may keep every row plain on a loaded CPU; its policy has tests of its own).
    output = tmp_path_factory.mktemp("spec_gpu") / "tiny.json"
    command = [sys.executable, str(ROOT / "benchmarks/spec_gpu.py"), "--tiny", "--device", "cpu", "--dtype",
               "float32", "--concurrency", *map(str, CONCURRENCY), "--accepted-lengths", *map(str, LENGTHS),
               "--input-len", "8", "--output-len", "10", "--waves", "1", "--warmup", "1", "--no-varlen", "--out",
               str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(Path(output).read_text())


def test_plain_and_speculative_runs_report_every_figure(report: dict) -> None:
    assert (report["shape"], report["device"], report["k"], report["varlen"]) == ("tiny", "cpu", 5, False)
    assert sorted(report["plain"]) == sorted(map(str, CONCURRENCY))
    assert sorted(report["spec"]) == sorted(map(str, LENGTHS))
    for c in map(str, CONCURRENCY):
        assert report["plain"][c]["mean_tpot_ms"] > 0 and report["plain"][c]["output_tokens_per_s"] > 0
        for length in map(str, LENGTHS):
            run = report["spec"][length][c]
            assert run["mean_tpot_ms"] > 0 and run["output_tokens_per_s"] > 0 and run["tpot_vs_plain"] > 0
            assert run["spec_verify_steps"] > 0
            assert 0 < run["draft_share_of_step"] < 1 and run["spec_mean_accepted_length"] > 1


def test_acceptance_rates_give_the_mean_accepted_lengths() -> None:
    bench = load_script("benchmarks/spec_gpu.py")
    for length in (1.5, 2.0, 3.0, 4.0):
        p = bench.acceptance_rate(length, 5)
        assert sum(p ** i for i in range(6)) == pytest.approx(length)
    assert bench.acceptance_rate(1.0, 5) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="mean accepted length 7.0 must be in"):
        bench.acceptance_rate(7.0, 5)


def test_the_acceptance_override_is_reachable_from_no_argument_flag_or_variable() -> None:
    def names(fields: object) -> list[str]:
        return [f.name for f in dataclasses.fields(fields)]

    for name in names(EngineArgs) + names(EngineEnv):
        assert "accept" not in name and "override" not in name
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert {"serve", "generate", "bench"} <= set(commands.choices)
    for command, sub in commands.choices.items():          # every flag of every command
        for action in sub._actions:
            for name in (*action.option_strings, action.dest):
                assert "accept" not in name and "override" not in name, (command, name)
    real = spec_step.verify
    bench = load_script("benchmarks/spec_gpu.py")        # importing the script patches nothing
    assert spec_step.verify is real and spec_step.DSparkDraft is not bench._RandomDraft
    with bench.forced_acceptance(0.5), bench.random_draft_head():
        assert spec_step.verify is not real and spec_step.DSparkDraft is bench._RandomDraft
    assert spec_step.verify is real and spec_step.DSparkDraft is not bench._RandomDraft
