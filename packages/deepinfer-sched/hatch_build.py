"""Hatchling build hook: compiles deepinfer.sched's Cython decode core.

Same approach as deepinfer-cache's hook: a regular wheel gets the compiled module force-included
(platform-tagged wheel); an editable install writes it in place next to its .pyx under src/, where
the editable .pth makes it importable. The module gets the sha256 of its .pyx as the C macro
DEEPINFER_SCHED_SOURCE_SHA256 (exposed as SOURCE_SHA256) so a test can spot a stale build.
Without Cython or a C compiler the package still works: deepinfer.sched falls back to the numpy
twin in _pure/ (Scheduler.uses_native_core tells which one runs).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE_DIR = Path("src/deepinfer/sched")
EXTENSIONS = ("_decode_core",)


def source_sha256(package_dir: Path, module: str) -> str:
    """sha256 of the module's .pyx; the tests recompute it the same way."""
    return hashlib.sha256((package_dir / f"{module}.pyx").read_bytes()).hexdigest()


def compile_extensions(root: Path, build_lib: Path, build_temp: Path) -> list[Path]:
    """Cythonizes and compiles EXTENSIONS; returns the shared objects written under build_lib."""
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    package_dir = root / PACKAGE_DIR
    extensions = [
        Extension(
            f"deepinfer.sched.{module}",
            [str(package_dir / f"{module}.pyx")],
            define_macros=[("DEEPINFER_SCHED_SOURCE_SHA256", f'"{source_sha256(package_dir, module)}"')],
            extra_compile_args=["-O3"],
            # CPython's default flags carry -g; debug info would make the .so ~5x larger.
            extra_link_args=["-Wl,--strip-debug"] if sys.platform.startswith("linux") else [],
        )
        for module in EXTENSIONS
    ]
    modules = cythonize(
        extensions,
        build_dir=str(build_temp / "cython"),
        compiler_directives={"language_level": 3},
        force=True,
        quiet=True,
    )
    command = build_ext(Distribution({"name": "deepinfer-sched", "ext_modules": modules}))
    command.build_lib = str(build_lib)
    command.build_temp = str(build_temp / "obj")
    command.inplace = False
    command.ensure_finalized()
    command.run()
    return [build_lib / command.get_ext_filename(ext.name) for ext in modules]


class CythonBuildHook(BuildHookInterface):
    """Builds the extension for both the wheel and the editable wheel."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        root = Path(self.root)
        self._tmp = tempfile.mkdtemp(prefix="deepinfer-sched-build-")
        build_lib = Path(self._tmp) / "lib"
        built = compile_extensions(root, build_lib, Path(self._tmp) / "temp")
        if version == "editable":
            for path in built:
                shutil.copy2(path, root / "src" / path.relative_to(build_lib))
            return
        for path in built:
            build_data["force_include"][str(path)] = str(path.relative_to(build_lib))
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)
