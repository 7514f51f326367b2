"""Without the compiled module, the package refuses to import unless the pure twin is asked for."""

from __future__ import annotations

import importlib
import sys

import pytest


def _reimport(monkeypatch, env: str | None):
    monkeypatch.setitem(sys.modules, "deepinfer.cache._block_pool", None)     # as if never built
    for name in [m for m in sys.modules if m == "deepinfer.cache"]:
        monkeypatch.delitem(sys.modules, name)
    if env is None:
        monkeypatch.delenv("DEEPINFER_CACHE_PURE_PYTHON", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_CACHE_PURE_PYTHON", env)
    return importlib.import_module("deepinfer.cache")


def test_unbuilt_module_is_an_error_by_default(monkeypatch) -> None:
    with pytest.raises(ImportError, match="DEEPINFER_CACHE_PURE_PYTHON=1"):
        _reimport(monkeypatch, None)


def test_pure_twin_on_request(monkeypatch) -> None:
    from deepinfer.cache._pure.block_pool import BlockManager as Pure

    cache = _reimport(monkeypatch, "1")
    assert cache.BlockManager is Pure
    assert cache.BlockManager(4).allocate(2).tolist() == [1, 2]
