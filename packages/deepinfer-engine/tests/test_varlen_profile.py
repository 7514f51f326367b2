"""varlen_verify keeps the curves it measures at start in DEEPINFER_VARLEN_PROFILE_CACHE
(varlen_profile.py): a second start with the same config loads them, a changed config measures again,
a corrupt or unwritable file costs a warning and a measurement, "off" writes nothing. The verify sizes
are every graph size the engine can replay.

The engine is the embedded model with its shipped draft head; `DummySpecSteps.timed` is replaced by a
fake (verify ms = 10 + tokens, draft walk ms = rows, verification 0.5 ms) that counts the verify
calls, so a measurement is cheap and its curves known.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
from pathlib import Path

import pytest
import torch

from deepinfer.engine import EngineArgs, LLMEngine
from deepinfer.engine.config.env import EngineEnv, read_env
from deepinfer.engine.speculative.spec_dummy import DummySpecSteps
from deepinfer.engine.speculative.varlen_profile import profile_fields, profile_sizes
from deepinfer.spec import ProfileCache, StepTimeCurve, cuda_graph_sizes, profile_key

ARGS = EngineArgs(device="cpu", kv_cache_memory_mb=16, max_num_seqs=2, max_model_len=256,
                  num_speculative_tokens=2)
SIZES = profile_sizes(2 * 3, False, 8)             # max_num_seqs × (k + 1) tokens, no graphs on the CPU
CURVE = StepTimeCurve(SIZES, tuple(10.0 + s for s in SIZES))
LOGGER = "deepinfer.engine.speculative.varlen_profile"
FAKE_MS = {"verify_forward": lambda size: 10.0 + size, "draft_walk": float, "verification": lambda rows: 0.5}


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The verify sizes measured (5 calls per size and measurement)."""
    calls: list[int] = []

    def fake_timed(self: DummySpecSteps, work):
        name = work.__name__

        def run(size: int) -> float:
            if name == "verify_forward":
                calls.append(size)
            return FAKE_MS[name](size)

        return run

    monkeypatch.setattr(DummySpecSteps, "timed", fake_timed)
    return calls


def _verify_key(engine: LLMEngine) -> str:
    spec = engine.spec
    assert spec is not None
    return profile_key(*profile_fields(spec.draft, engine.runner, engine.args, engine.env, SIZES))


def _start(cache: Path | str, args: EngineArgs = ARGS) -> LLMEngine:
    return LLMEngine(args, env=EngineEnv(varlen_profile_cache=str(cache)))


def _curve(engine: LLMEngine) -> StepTimeCurve:
    assert engine.spec is not None and engine.spec.varlen is not None
    return engine.spec.varlen.forward.curve


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_a_second_start_loads_the_curve_without_measuring(tmp_path: Path, measured: list[int],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "sub" / "varlen_profile.json"
    with caplog.at_level(logging.INFO, logger=LOGGER):
        first = _start(path)
    assert sorted(measured) == sorted(SIZES * 5) and _curve(first) == CURVE
    key = _verify_key(first)
    assert len(json.loads(path.read_text())) == 3                # verify, draft walk, verification
    assert ProfileCache(path).load(key) == CURVE
    assert first.spec.varlen.draft.prior == StepTimeCurve((1, 2), (1.0, 2.0))
    assert first.spec.varlen.sampler.estimate_ms(2) == 0.5 and not first.spec.varlen.plain_only
    [line] = _messages(caplog, logging.INFO)
    assert line.startswith(f"varlen step-time curves ({len(SIZES)} verify sizes): measured in ")
    assert line.endswith(f"stored in {path} (key {key[:16]})")
    assert [p.name for p in path.parent.iterdir()] == ["varlen_profile.json"]      # no temporary file left

    measured.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        second = _start(path)
    assert measured == [] and _curve(second) == CURVE
    assert _messages(caplog, logging.INFO) == [
        f"varlen step-time curves ({len(SIZES)} verify sizes): loaded from {path} (key {key[:16]})"]
    assert _messages(caplog, logging.WARNING) == []


def test_a_changed_config_measures_again_and_keeps_the_other_entries(tmp_path: Path, measured: list[int]) -> None:
    path = tmp_path / "varlen_profile.json"
    _start(path)
    measured.clear()
    bigger = _start(path, dataclasses.replace(ARGS, max_num_seqs=3))
    assert sorted(set(measured)) == list(profile_sizes(3 * 3, False, 8)) and _curve(bigger).sizes == (1, 2, 4, 8, 9)
    assert len(json.loads(path.read_text())) == 6
    measured.clear()
    _start(path)                                       # the first config's entry is still there
    _start(path, dataclasses.replace(ARGS, max_num_seqs=3))
    assert measured == []


def test_every_field_of_the_key_changes_it(tmp_path: Path, measured: list[int],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _start(tmp_path / "varlen_profile.json")
    spec, env = engine.spec, engine.env
    assert spec is not None

    def key(args: object = engine.args, env: EngineEnv = env, sizes: tuple[int, ...] = SIZES) -> str:
        return profile_key(*profile_fields(spec.draft, engine.runner, args, env, sizes))  # type: ignore[arg-type]

    base = key()
    assert key() == base
    keys = [
        key(dataclasses.replace(engine.args, dtype="bfloat16")),
        key(dataclasses.replace(engine.args, expert_dtype="fp8")),
        key(dataclasses.replace(engine.args, kv_quant=True)),
        key(dataclasses.replace(engine.args, enforce_eager=True)),
        key(dataclasses.replace(engine.args, max_num_seqs=3)),
        key(types.SimpleNamespace(**{**dataclasses.asdict(engine.args), "data_parallel_size": 2})),
        key(types.SimpleNamespace(**{**dataclasses.asdict(engine.args), "data_parallel_size": 2,
                                     "expert_parallel": True})),
        # (EngineArgs refuses batch_invariant with varlen verify; the key still tells the two apart)
        key(types.SimpleNamespace(**{**dataclasses.asdict(engine.args), "batch_invariant": True})),
        key(env=dataclasses.replace(env, cudagraph_batch_size_interval=4)),
        key(sizes=profile_sizes(9, False, 8)),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        keys.append(key())                            # CPU times depend on torch's thread count
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    keys.append(key())
    monkeypatch.undo()
    monkeypatch.setattr(engine.runner.model, "cfg", dataclasses.replace(engine.runner.model.cfg, index_topk=7))
    keys.append(key())
    monkeypatch.setattr(spec.draft, "block_size", 3)
    keys.append(key())
    assert len(set(keys)) == len(keys) and base not in keys


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_a_corrupt_file_is_measured_again_with_a_warning(tmp_path: Path, measured: list[int], text: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "varlen_profile.json"
    path.write_text(text)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = _start(path)
    assert _curve(engine) == CURVE and sorted(measured) == sorted(SIZES * 5)
    [warning] = _messages(caplog, logging.WARNING)
    assert warning.startswith(f"varlen profile cache {path} is unreadable (") and "measuring" in warning
    assert ProfileCache(path).load(_verify_key(engine)) == CURVE       # replaced by a valid file


def test_a_bad_entry_is_measured_again_and_the_others_kept(tmp_path: Path, measured: list[int],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "varlen_profile.json"
    key = _verify_key(_start(path))
    entries = json.loads(path.read_text())
    path.write_text(json.dumps({**entries, key: {"sizes": [4, 1], "ms": [1.0, 2.0]},
                                "other": {"sizes": [1], "ms": [0.5]}}))
    measured.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        engine = _start(path)
    assert _curve(engine) == CURVE and measured
    [warning] = _messages(caplog, logging.WARNING)
    assert f"the entry {key[:12]}... is not a step-time curve" in warning
    assert json.loads(path.read_text())["other"] == {"sizes": [1], "ms": [0.5]}
    assert ProfileCache(path).load(key) == CURVE


def test_an_unusable_path_is_survived_with_warnings(tmp_path: Path, measured: list[int],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = _start(tmp_path)                      # a folder: neither readable nor writable as the file
    assert _curve(engine) == CURVE
    unreadable, unwritable = _messages(caplog, logging.WARNING)
    assert unreadable.startswith(f"varlen profile cache {tmp_path} is unreadable (")
    assert unwritable.startswith(f"could not write the varlen profile cache {tmp_path} (")
    assert _messages(caplog, logging.INFO)[0].endswith(", not stored")
    assert list(tmp_path.iterdir()) == []


def test_off_measures_and_writes_no_file(tmp_path: Path, measured: list[int], monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("DEEPINFER_VARLEN_PROFILE_CACHE", "Off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert read_env().varlen_profile_cache == "off"
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger=LOGGER):
            engine = LLMEngine(ARGS)                   # env read from os.environ
        assert _curve(engine) == CURVE
    assert sorted(measured) == sorted(SIZES * 10)
    assert list(tmp_path.iterdir()) == []
    assert _messages(caplog, logging.INFO)[-1].endswith("not cached (DEEPINFER_VARLEN_PROFILE_CACHE=off)")


def test_the_default_file_is_in_the_user_cache_folder(tmp_path: Path, measured: list[int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPINFER_VARLEN_PROFILE_CACHE")          # set by conftest.py for every other test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    LLMEngine(ARGS)
    assert list((tmp_path / "xdg" / "deepinfer").iterdir()) == [tmp_path / "xdg" / "deepinfer" / "varlen_profile.json"]
    measured.clear()
    LLMEngine(ARGS)
    assert measured == []


def test_the_verify_sizes_are_every_graph_size_the_engine_replays() -> None:
    # max_num_seqs = 64 and k = 5: graphs up to 384 query tokens, each measured (none interpolated)
    assert profile_sizes(64 * 6, True, 8) == cuda_graph_sizes(64 * 6) and profile_sizes(64 * 6, True, 8)[-1] == 384
    assert 264 in profile_sizes(64 * 6, True, 8)
    assert profile_sizes(64 * 6, False, 8) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 384)   # eager: interpolated


PROMPTS = ["def fibonacci(", "import os\n"]
GREEDY = {"max_tokens": 10, "temperature": 0.0}


def _greedy(engine: LLMEngine) -> list[list[int]]:
    from deepinfer.engine import SamplingParams
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(**GREEDY))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[str(i)] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def plain_greedy() -> list[list[int]]:
    return _greedy(LLMEngine(dataclasses.replace(ARGS, num_speculative_tokens=0)))


def test_where_drafting_cannot_pay_the_engine_says_so_once_and_decodes_plainly(
        measured: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        plain_greedy: list[list[int]]) -> None:
    # a steep curve (every query token costs as much as the first) and a costly draft walk: even
    # drafts that are always accepted lose
    monkeypatch.setitem(FAKE_MS, "verify_forward", lambda size: 10.0 * size)
    monkeypatch.setitem(FAKE_MS, "draft_walk", lambda rows: 5.0 * rows)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine = _start("off")
    [line] = [m for m in _messages(caplog, logging.INFO) if "cannot pay" in m]
    assert line.startswith("speculative decoding cannot pay on cpu: ") and line.endswith(
        "decoding plainly (every row verifies 0 drafts)")
    assert engine.spec.varlen.plain_only
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert _greedy(engine) == plain_greedy
    assert not [m for m in _messages(caplog, logging.INFO) if "cannot pay" in m]      # said once, at start
    stats = engine.stats()
    assert stats.spec_verify_steps == 0 and stats.spec_draft_tokens == 0


def test_where_drafting_pays_rows_draft_and_greedy_tokens_stay(measured: list[int],
                                                               plain_greedy: list[list[int]]) -> None:
    engine = _start("off")            # a flat curve (10 ms + 1 per token), a cheap draft walk
    assert not engine.spec.varlen.plain_only
    assert _greedy(engine) == plain_greedy
    stats = engine.stats()
    assert stats.spec_verify_steps > 0 and stats.spec_draft_tokens > 0
    varlen = engine.spec.varlen            # the estimators learned from the real steps
    assert len(varlen.forward._steps) >= stats.spec_verify_steps and varlen.draft._times and varlen.sampler._times
    assert len(varlen.calibration._rows) == stats.spec_verify_rows        # and how far the confidences were right
