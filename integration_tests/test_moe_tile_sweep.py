"""benchmarks/moe_tile_sweep.py --cpu-smoke: the sweep's code on the CPU under Triton's interpreter
(tiny experts, one tile, 3 tokens) writes a row per format and MXFP4 decoder (`packed` on re-packed
copies of the experts), each close to the reference, and prints the summary (a function check only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_under_test import ROOT, load_script


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    pytest.importorskip("triton")
    output = tmp_path_factory.mktemp("moe_tile_sweep") / "smoke.json"
    command = [sys.executable, str(ROOT / "benchmarks/moe_tile_sweep.py"), "--cpu-smoke", "--out", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(Path(output).read_text()), done.stdout


def test_one_row_per_format_and_interpretable_decoder(smoke) -> None:
    report, _ = smoke
    assert report["shape"] == {"name": "smoke", "experts": 8, "hidden": 128, "inter": 128, "top_k": 6}
    assert [(r["format"], r["decode"]) for r in report["rows"]] == [
        ("bf16", None), ("fp8", None), ("mxfp4", "bits"), ("mxfp4", "group_dot"), ("mxfp4", "words"),
        ("mxfp4", "packed")]
    for row in report["rows"]:
        assert (row["batch"], row["BLOCK_N"], row["BLOCK_K"], row["num_warps"], row["num_stages"]) == (3, 32, 128, 4, 3)
        assert row["us"] > 0 and row["weight_GBps"] > 0 and row["distinct_experts"] <= 8
        assert row["max_rel_error"] < 1e-5          # float32 activations: exact weights, accumulation order


def test_shipped_choice_and_summary(smoke) -> None:
    report, stdout = smoke
    assert report["shipped"]["mxfp4_decode"] in report["shipped"]["mxfp4_tiles"]
    lines = stdout.strip().splitlines()
    assert lines[-7].split()[:2] == ["batch", "format/decoder"]
    assert [line.split()[1] for line in lines[-6:]] == ["bf16", "fp8", "mxfp4/bits", "mxfp4/group_dot", "mxfp4/packed",
                                                        "mxfp4/words"]


def test_a_tile_that_fails_to_build_is_reported_and_skipped(monkeypatch, capsys) -> None:
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))            # the script imports kernels_gpu
    sweep = load_script("benchmarks/moe_tile_sweep.py")
    asm = sweep.Variant("mxfp4", sweep.mxfp4.MX_ASM)

    def too_big() -> None:
        raise RuntimeError("out of shared memory\nmore detail")

    failed = sweep.compile_all([((asm, 64, 128, 4, 3), lambda: None), ((asm, 128, 256, 4, 3), too_big)], threads=2)
    assert failed == {(asm, 128, 256, 4, 3): "RuntimeError: out of shared memory"}
    assert "skipped mxfp4/asm 128x256w4s3: RuntimeError: out of shared memory" in capsys.readouterr().out
