import importlib.metadata

import deepinfer.spec


def test_spec_exports_nothing_yet() -> None:
    assert deepinfer.spec.__all__ == []
    assert deepinfer.spec.__version__ == importlib.metadata.version("deepinfer-spec")
