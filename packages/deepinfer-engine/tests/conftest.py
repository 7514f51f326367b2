import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))   # serve_helpers, kept_once, engine_tiny_v4


@pytest.fixture(scope="session", autouse=True)
def varlen_profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Engines started here (and their spawned processes) keep varlen step-time curves in a temporary
    file, never in the user's cache folder; the tests of the cache itself set their own file."""
    path = tmp_path_factory.mktemp("varlen_profile") / "varlen_profile.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_VARLEN_PROFILE_CACHE", str(path))
        yield path
