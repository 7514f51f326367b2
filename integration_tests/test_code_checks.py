"""tools/code_checks.py: no import cycle between the packages' modules (the check finds one wherever
it hides: a TYPE_CHECKING block, a function body, a package's __init__) and no function over radon
complexity 20 outside the named exemptions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_code_checks():
    spec = importlib.util.spec_from_file_location("deepinfer_code_checks_under_test", ROOT / "tools" / "code_checks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


code_checks = _load_code_checks()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "packages" / "deepinfer-x" / "src" / "deepinfer" / "x" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _cycles(root: Path) -> list[list[str]]:
    return code_checks.cycles(code_checks.import_graph(code_checks.find_modules(root)))


def test_the_packages_have_no_import_cycle() -> None:
    assert code_checks.check_cycles() == []


def test_a_type_checking_import_and_a_function_level_import_close_a_cycle(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "b.py": "def f():\n    from deepinfer.x import c\n",
        "c.py": "from . import a\n",
        "d.py": "from .a import *\nimport deepinfer.x.b\n",        # imports into the cycle, not part of it
    })
    assert _cycles(root) == [["deepinfer.x.a", "deepinfer.x.b", "deepinfer.x.c"]]


def test_a_name_taken_from_a_package_imports_its_init(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "__init__.py": "from .core import run\n",
        "core.py": "def run(): ...\n",
        "sub/__init__.py": "",
        "sub/user.py": "from .. import run\nfrom ..sub import helper\n",
        "sub/helper.py": "",
    })
    assert _cycles(root) == []
    (root / "packages" / "deepinfer-x" / "src" / "deepinfer" / "x" / "core.py").write_text("from .sub import user\n")
    assert _cycles(root) == [["deepinfer.x", "deepinfer.x.core", "deepinfer.x.sub.user"]]


def test_a_cycle_message_names_each_closing_import(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"__init__.py": "", "a.py": "import os\nfrom . import b\n", "b.py": "from .a import x\n"})
    problems = [p for p in code_checks.check_cycles(root) if p.startswith("import cycle")]
    assert problems == ["import cycle between 2 modules:\n"
                        "    packages/deepinfer-x/src/deepinfer/x/a.py:2 imports deepinfer.x.b\n"
                        "    packages/deepinfer-x/src/deepinfer/x/b.py:1 imports deepinfer.x.a"]


def test_a_function_over_complexity_20_is_reported(tmp_path: Path) -> None:
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(20))    # 20 ifs: complexity 21
    root = _tree(tmp_path, {"__init__.py": "", "big.py": f"def pick(x):\n{branches}    return -1\n",
                            "small.py": "def pick(x):\n    return x\n"})
    problems = [p for p in code_checks.check_complexity(root) if p.startswith("packages/deepinfer-x")]
    assert problems == ["packages/deepinfer-x/src/deepinfer/x/big.py:1: pick has cyclomatic complexity 21 "
                        "(at most 20): split it"]


def test_the_packages_have_no_function_over_complexity_20() -> None:
    assert code_checks.check_complexity() == []


def test_an_exemption_whose_fix_landed_is_a_note_not_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exempt_file = "packages/deepinfer-engine/src/deepinfer/engine/llm_engine.py"
    monkeypatch.setattr(code_checks, "EXEMPT_COMPLEXITY", {exempt_file: "a branch that has landed"})
    root = _tree(tmp_path, {"__init__.py": ""})
    small = root / exempt_file
    small.parent.mkdir(parents=True, exist_ok=True)
    small.write_text("def step(x):\n    return x\n")
    assert [p for p in code_checks.check_complexity(root) if exempt_file in p] == []
    notes = code_checks.stale_exemptions(root)
    assert any(exempt_file in note and "remove the entry" in note for note in notes)
    assert any(note.startswith("EXEMPT_CYCLES") for note in notes)      # the tree has no kernels cycle
