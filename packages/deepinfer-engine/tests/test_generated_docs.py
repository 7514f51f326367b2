"""docs/engine_args.md and docs/environment.md are what `python -m deepinfer.engine.gen_docs` writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deepinfer.engine import EngineArgs
from deepinfer.engine.cli import build_parser
from deepinfer.engine.config.dataclass_flags import flag_name
from deepinfer.engine.config.env import MOVED_VARIABLES, OTHER_VARIABLES, VARIABLES
from deepinfer.engine.gen_docs import DOCS, engine_args_markdown, environment_markdown, main

REPO_DOCS = Path(__file__).resolve().parents[3] / "docs"


@pytest.mark.parametrize("name", sorted(DOCS))
def test_committed_docs_match_the_code(name: str) -> None:
    committed = (REPO_DOCS / name).read_text()
    assert committed == DOCS[name]() + "\n", (
        f"docs/{name} is out of date: run `.venv/bin/python -m deepinfer.engine.gen_docs` from the repository root")


def test_tables_have_a_row_per_field_and_variable() -> None:
    engine_table = engine_args_markdown().split("\n## ")[0]
    args_rows = [line for line in engine_table.splitlines() if line.startswith("| `--")]
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


def _docs_defaults(section: str, command: str) -> dict[str, str]:
    """flag -> default shown by docs/engine_args.md for `command`: the EngineArgs table, then the
    command's own defaults, then (serve) its own flags."""
    sections = {part.split("\n", 1)[0]: part for part in (REPO_DOCS / "engine_args.md").read_text().split("\n## ")}
    defaults = {}
    for line in sections["# Engine arguments"].splitlines():
        if line.startswith("| `--"):
            cells = line.split(" | ")
            defaults[cells[0].split("`")[1]] = cells[2]
    for line in sections["Defaults the commands apply"].splitlines():
        if line.startswith(f"| `deepinfer {command}`"):
            cells = line.strip("| ").split(" | ")
            defaults[cells[1].strip("`")] = cells[2]
    if section:
        for line in sections[section].splitlines():
            if line.startswith("| `--"):
                cells = line.split(" | ")
                defaults[cells[0].split("`")[1]] = cells[1]
    return defaults


@pytest.mark.parametrize(("command", "section"), [("serve", "`deepinfer serve`'s own flags"), ("generate", ""),
                                                  ("bench", "")])
def test_help_and_docs_show_the_same_defaults(command: str, section: str) -> None:
    """Each flag's `[... default: X]` in `deepinfer COMMAND --help` is the default docs/engine_args.md
    gives it (the commands' own defaults included, e.g. serve recomputes preempted requests)."""
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    parser = subparsers.choices[command]
    docs = _docs_defaults(section, command)
    shown = {}
    for action in parser._actions:
        flag = next((o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")), None)
        if flag is None or flag == "--help" or (not section and flag not in docs):
            continue
        shown[flag] = action.help.rsplit("default: ", 1)[1].rstrip("]").replace("%%", "%")
    assert shown == {flag: docs[flag] for flag in shown} and len(shown) >= len(dataclasses.fields(EngineArgs))
    recompute = shown["--stop-preempted-request"]
    assert recompute.startswith("False") if command != "bench" else recompute == "True"      # LLMEngine's own
    if command == "serve":
        assert set(docs) == set(shown)                                # every serve flag is documented
