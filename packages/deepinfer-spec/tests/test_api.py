import importlib.metadata

import deepinfer.spec


def test_public_names_resolve_and_version_matches() -> None:
    assert deepinfer.spec.__version__ == importlib.metadata.version("deepinfer-spec")
    for name in deepinfer.spec.__all__:
        assert getattr(deepinfer.spec, name) is not None, name
