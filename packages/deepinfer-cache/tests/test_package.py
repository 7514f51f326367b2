"""The public surface: exports, version, and that the compiled pool is the one in use."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
from pathlib import Path

import deepinfer.cache
from deepinfer.cache import _block_pool

SOURCE_DIR = Path(deepinfer.cache.__file__).parent


def test_all_names_resolve() -> None:
    assert sorted(deepinfer.cache.__all__) == sorted(set(deepinfer.cache.__all__))
    for name in deepinfer.cache.__all__:
        assert getattr(deepinfer.cache, name) is not None
    assert deepinfer.cache.__version__ == importlib.metadata.version("deepinfer-cache")


def test_block_manager_is_the_compiled_extension() -> None:
    assert deepinfer.cache.BlockManager is _block_pool.BlockManager
    assert deepinfer.cache.BlockManager.__module__ == "deepinfer.cache._block_pool"
    assert _block_pool.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_compiled_extension_matches_its_source() -> None:
    # An in-place (editable) build older than the .pyx/.pxd would fail here: rebuild with
    # `pip install -e packages/deepinfer-cache`.
    pyx = SOURCE_DIR / "_block_pool.pyx"
    if not pyx.exists():  # an install without the Cython sources has nothing to compare against
        return
    digest = hashlib.sha256(pyx.read_bytes())
    for pxd in sorted(SOURCE_DIR.glob("*.pxd")):  # the same rule as hatch_build.source_sha256
        digest.update(pxd.read_bytes())
    assert _block_pool.SOURCE_SHA256 == digest.hexdigest()


def test_cache_package_imports_no_torch_or_sibling() -> None:
    import subprocess
    import sys

    code = (
        "import sys, deepinfer.cache; "
        "bad = [m for m in sys.modules if m == 'torch' or (m.startswith('deepinfer.') "
        "and not m.startswith('deepinfer.cache'))]; print(bad)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
