"""The public surface: everything in `__all__` exists, and importing the package does not load torch."""

import subprocess
import sys

import deepinfer.eplb as eplb


def test_all_names_resolve() -> None:
    for name in eplb.__all__:
        assert getattr(eplb, name) is not None, name
    assert eplb.__version__


def test_import_does_not_load_torch() -> None:
    code = "import sys, deepinfer.eplb; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
