"""Build the Cython extensions of deepinfer-cache and deepinfer-sched in place (run on purpose).

    python3 benchmarks/device_build_cython.py

For a machine that has gcc, the Python headers, Cython and setuptools but cannot pip-install the
packages (the lent H200: no network, no hatchling). Each package's `hatch_build.compile_extensions`
is called with a stand-in for hatchling's hook class, writing the shared objects next to their .pyx
under src/, where `benchmarks/device_env.sh`'s PYTHONPATH finds them.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    hook = types.ModuleType("hatchling.builders.hooks.plugin.interface")
    hook.BuildHookInterface = object                     # only subclassed by the build hooks
    for name in ("hatchling", "hatchling.builders", "hatchling.builders.hooks", "hatchling.builders.hooks.plugin"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[hook.__name__] = hook
    for package in ("deepinfer-cache", "deepinfer-sched"):
        root = ROOT / "packages" / package
        spec = importlib.util.spec_from_file_location(f"{package}_hatch_build", root / "hatch_build.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with tempfile.TemporaryDirectory() as temp:
            built = module.compile_extensions(root, root / "src", Path(temp))
        print(package, "->", ", ".join(str(path.relative_to(ROOT)) for path in built))


if __name__ == "__main__":
    main()
