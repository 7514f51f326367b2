import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))   # serve_helpers, kept_once, engine_tiny_v4


@pytest.fixture(scope="session", autouse=True)
def varlen_profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Engines started here (and their spawned processes) keep varlen step-time curves in a temporary
    file, never in the user's cache folder; the tests of the cache itself set their own file."""
    path = tmp_path_factory.mktemp("varlen_profile") / "varlen_profile.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_VARLEN_PROFILE_CACHE", str(path))
        yield path


# Start-up curves under which drafting pays on any machine: a flat verify forward, a cheap draft walk.
FLAT_CURVES = {"verify_forward": lambda tokens: 10.0 + 0.01 * tokens, "draft_walk": lambda rows: 0.1 * rows,
               "verification": lambda rows: 0.1}


@pytest.fixture
def flat_varlen_curves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines started in the test measure `FLAT_CURVES` (not this machine's, whose CPU forward may
    make drafting lose) and cache nothing; their estimators still learn from the real steps."""
    from deepinfer.engine.speculative.spec_dummy import DummySpecSteps

    monkeypatch.setattr(DummySpecSteps, "timed", lambda self, work: FLAT_CURVES[work.__name__])
    monkeypatch.setenv("DEEPINFER_VARLEN_PROFILE_CACHE", "off")


@pytest.fixture
def drafting_pays(flat_varlen_curves: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`flat_varlen_curves`, and the estimators and the confidences' calibration keep them (real steps
    are not fed): rows draft at every step, for tests of what drafting rows do (the device split, V4.1's
    verify) rather than of the policy."""
    from deepinfer.spec import AcceptanceCalibration, ForwardRuntimeEstimator, SamplerRuntimeEstimator

    for estimator in (ForwardRuntimeEstimator, SamplerRuntimeEstimator, AcceptanceCalibration):
        monkeypatch.setattr(estimator, "observe", lambda self, count, measured: None)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny-model tests (as fast, and no stall on a busy CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
