"""Hatchling build hook: compiles the Cython extensions of deepinfer.cache.

Regular wheel (`pip install packages/deepinfer-cache`): each .pyx is cythonized and compiled in a
temporary directory and the shared object is force-included into the wheel, which gets a
platform tag. Editable install (`pip install -e packages/deepinfer-cache`): the shared object is
written in place, next to its .pyx under src/, where the editable .pth makes it importable.
Generated .c files stay in the temporary directory; .so files are git-ignored and explicitly
excluded from the wheel's file selection, so a stale in-place build never ships.

Each extension gets the sha256 of its .pyx + the package's .pxd files as the C macro DEEPINFER_CACHE_SOURCE_SHA256,
exposed as `SOURCE_SHA256`, so a test can detect an in-place build older than its source.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE_DIR = Path("src/deepinfer/cache")
EXTENSIONS = ("_block_pool",)  # module names under deepinfer.cache, each with a .pyx


def source_sha256(package_dir: Path, module: str) -> str:
    """sha256 over the module's .pyx, then every .pxd of the package by name (they are cimported)."""
    digest = hashlib.sha256((package_dir / f"{module}.pyx").read_bytes())
    for path in sorted(package_dir.glob("*.pxd")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def compile_extensions(root: Path, build_lib: Path, build_temp: Path) -> list[Path]:
    """Cythonizes and compiles EXTENSIONS; returns the shared objects written under build_lib."""
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    package_dir = root / PACKAGE_DIR
    extensions = [
        Extension(
            f"deepinfer.cache.{module}",
            [str(package_dir / f"{module}.pyx")],
            define_macros=[("DEEPINFER_CACHE_SOURCE_SHA256", f'"{source_sha256(package_dir, module)}"')],
            extra_compile_args=["-O3"],
            # CPython's default flags carry -g; debug info would make the .so ~5x larger.
            extra_link_args=["-Wl,--strip-debug"] if sys.platform.startswith("linux") else [],
        )
        for module in EXTENSIONS
    ]
    modules = cythonize(
        extensions,
        build_dir=str(build_temp / "cython"),
        include_path=[str(root / "src")],
        compiler_directives={"language_level": 3},
        force=True,
        quiet=True,
    )
    command = build_ext(Distribution({"name": "deepinfer-cache", "ext_modules": modules}))
    command.build_lib = str(build_lib)
    command.build_temp = str(build_temp / "obj")
    command.inplace = False
    command.ensure_finalized()
    command.run()
    return [build_lib / command.get_ext_filename(ext.name) for ext in modules]


class CythonBuildHook(BuildHookInterface):
    """Builds the extensions for both the wheel and the editable wheel."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        root = Path(self.root)
        self._tmp = tempfile.mkdtemp(prefix="deepinfer-cache-build-")
        build_lib = Path(self._tmp) / "lib"
        built = compile_extensions(root, build_lib, Path(self._tmp) / "temp")
        if version == "editable":
            for path in built:
                shutil.copy2(path, root / "src" / path.relative_to(build_lib))
            return
        for path in built:  # the wheel is written after initialize(); finalize() cleans up
            build_data["force_include"][str(path)] = str(path.relative_to(build_lib))
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)
