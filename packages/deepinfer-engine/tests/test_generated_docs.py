"""docs/engine_args.md and docs/environment.md are what `python -m deepinfer.engine.gen_docs` writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deepinfer.engine import EngineArgs
from deepinfer.engine.dataclass_flags import flag_name
from deepinfer.engine.env import MOVED_VARIABLES, OTHER_VARIABLES, VARIABLES
from deepinfer.engine.gen_docs import DOCS, engine_args_markdown, environment_markdown, main

REPO_DOCS = Path(__file__).resolve().parents[3] / "docs"


@pytest.mark.parametrize("name", sorted(DOCS))
def test_committed_docs_match_the_code(name: str) -> None:
    committed = (REPO_DOCS / name).read_text()
    assert committed == DOCS[name]() + "\n", (
        f"docs/{name} is out of date: run `.venv/bin/python -m deepinfer.engine.gen_docs` from the repository root")


def test_tables_have_a_row_per_field_and_variable() -> None:
    args_rows = [line for line in engine_args_markdown().splitlines() if line.startswith("| `--")]
    assert [row.split("`")[1] for row in args_rows] == [flag_name(f.name) for f in dataclasses.fields(EngineArgs)]
    env_rows = [line for line in environment_markdown().splitlines() if line.startswith("| `DEEPINFER_")]
    assert [row.split("`")[1] for row in env_rows] == [var.name for var in VARIABLES] + sorted(OTHER_VARIABLES) + \
        list(MOVED_VARIABLES)
    assert "| `--chunk-checkpoints` | `tuple[int, ...]` | empty | ints in [1, 2147483647], strictly increasing |" \
        in engine_args_markdown()
    assert "| `DEEPINFER_SAMPLER_FORCE_TOPK` | `sampler_force_topk` | an int >= 1, or 0 / unset for none | unset |" \
        in environment_markdown()


def test_generator_writes_then_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--docs-dir", str(tmp_path), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert main(["--docs-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(DOCS)
    assert (tmp_path / "engine_args.md").read_text() == engine_args_markdown() + "\n"
    assert main(["--docs-dir", str(tmp_path), "--check"]) == 0
    (tmp_path / "environment.md").write_text("stale\n")
    capsys.readouterr()
    assert main(["--docs-dir", str(tmp_path), "--check"]) == 1
    assert capsys.readouterr().err == (f"out of date: {tmp_path / 'environment.md'}; run `python -m "
                                       "deepinfer.engine.gen_docs` from the repository root\n")
