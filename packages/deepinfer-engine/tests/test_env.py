from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from deepinfer.engine.config.env import (
    MOVED_VARIABLES,
    OTHER_VARIABLES,
    VARIABLES,
    EngineEnv,
    InvalidEnvVar,
    env_var_name,
    read_env,
    unknown_env_vars,
    varlen_profile_cache_path,
)


def test_defaults_when_nothing_is_set() -> None:
    env = read_env({"PATH": "/bin"})
    assert env == EngineEnv()
    assert (env.prefill_attempt_interval, env.prefill_any_attempt_interval) == (70, 100)
    assert env.num_state_slots_ratio == 1.2 and env.max_backtracking_tokens == 6
    assert not env.disable_sync_guard
    assert env.sampler_force_topk is None
    assert env.cudagraph_batch_size_interval == 8


def test_every_variable_is_read() -> None:
    env = read_env({
        "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "5",
        "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": " 9 ",
        "DEEPINFER_NUM_STATE_SLOTS_RATIO": "2.5",
        "DEEPINFER_MAX_BACKTRACKING_TOKENS": "0",
        "DEEPINFER_DISABLE_SYNC_GUARD": "FALSE",
        "DEEPINFER_SAMPLER_FORCE_TOPK": "64",
        "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL": "16",
    })
    assert env == EngineEnv(5, 9, 2.5, 0, False, 64, 16)


def test_variables_describe_every_field_in_order() -> None:
    assert [var.field for var in VARIABLES] == [field.name for field in dataclasses.fields(EngineEnv)]
    assert all(var.description and var.allowed for var in VARIABLES)


@pytest.mark.parametrize(("name", "field"), sorted(MOVED_VARIABLES.items()))
def test_behaviour_switches_moved_to_engine_args_are_refused(name: str, field: str) -> None:
    from deepinfer.engine import EngineArgs

    assert field in {f.name for f in dataclasses.fields(EngineArgs)}
    assert field not in {f.name for f in dataclasses.fields(EngineEnv)}
    flag = "--" + field.replace("_", "-")
    with pytest.raises(InvalidEnvVar, match=rf"^{name} is no longer read: it is the engine argument {field} "
                                            rf"\({flag}\) now; unset it$"):
        read_env({name: "1"})
    assert read_env({name: " "}) == EngineEnv()       # empty = unset


@pytest.mark.parametrize(("raw", "expected"), [("0", False), ("1", True), ("true", True), ("False", False),
                                               ("tRuE", True), ("", False)])
def test_bool_parsing(raw: str, expected: bool) -> None:
    assert read_env({"DEEPINFER_DISABLE_SYNC_GUARD": raw}).disable_sync_guard is expected


def test_force_topk_zero_or_empty_means_none() -> None:
    assert read_env({"DEEPINFER_SAMPLER_FORCE_TOPK": "0"}).sampler_force_topk is None
    assert read_env({"DEEPINFER_SAMPLER_FORCE_TOPK": ""}).sampler_force_topk is None
    assert EngineEnv(sampler_force_topk=0).sampler_force_topk is None


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("DEEPINFER_PREFILL_ATTEMPT_INTERVAL", "0", "DEEPINFER_PREFILL_ATTEMPT_INTERVAL=0 must be an int >= 1"),
        ("DEEPINFER_PREFILL_ATTEMPT_INTERVAL", "abc",
         r"DEEPINFER_PREFILL_ATTEMPT_INTERVAL='abc' must be an integer \(an int >= 1\)"),
        ("DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL", "-3", "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL=-3 must be"),
        ("DEEPINFER_NUM_STATE_SLOTS_RATIO", "0", "DEEPINFER_NUM_STATE_SLOTS_RATIO=0.0 must be a float > 0"),
        ("DEEPINFER_NUM_STATE_SLOTS_RATIO", "nan", "DEEPINFER_NUM_STATE_SLOTS_RATIO='nan' must be finite"),
        ("DEEPINFER_NUM_STATE_SLOTS_RATIO", "x", "DEEPINFER_NUM_STATE_SLOTS_RATIO='x' must be a number"),
        ("DEEPINFER_MAX_BACKTRACKING_TOKENS", "-1", "DEEPINFER_MAX_BACKTRACKING_TOKENS=-1 must be an int >= 0"),
        ("DEEPINFER_DISABLE_SYNC_GUARD", "yes", r"DEEPINFER_DISABLE_SYNC_GUARD='yes' must be one of 0, 1"),
        ("DEEPINFER_DISABLE_SYNC_GUARD", "2", r"DEEPINFER_DISABLE_SYNC_GUARD='2' must be one of 0, 1, true, false"),
        ("DEEPINFER_SAMPLER_FORCE_TOPK", "-5", "DEEPINFER_SAMPLER_FORCE_TOPK=-5 must be an int >= 1, or 0"),
        ("DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL", "1.5", "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL='1.5' must be an "
         "integer"),
        ("DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL", "0", "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL=0 must be"),
    ],
)
def test_bad_values_name_variable_and_range(name: str, raw: str, message: str) -> None:
    with pytest.raises(InvalidEnvVar, match=message):
        read_env({name: raw})


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(InvalidEnvVar, match="DEEPINFER_DISABLE_SYNC_GUARD=1 must be a bool"):
        EngineEnv(disable_sync_guard=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidEnvVar, match="DEEPINFER_MAX_BACKTRACKING_TOKENS=True must be an int >= 0"):
        EngineEnv(max_backtracking_tokens=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineEnv().disable_sync_guard = True  # type: ignore[misc]


def test_unknown_deepinfer_variables_are_reported() -> None:
    environ = {"DEEPINFER_DISABLE_SYNC_GAURD": "1", "DEEPINFER_DISABLE_SYNC_GUARD": "1", "HOME": "/root",
               "DEEPINFER_ZZZ": "", "DEEPINFER_BATCH_INVARIANT": "1"}     # moved: refused, not unknown
    assert unknown_env_vars(environ) == ("DEEPINFER_DISABLE_SYNC_GAURD", "DEEPINFER_ZZZ")
    assert env_var_name("disable_sync_guard") == "DEEPINFER_DISABLE_SYNC_GUARD"


def test_variables_read_elsewhere_are_known() -> None:
    assert set(OTHER_VARIABLES) == {"DEEPINFER_CACHE_PURE_PYTHON", "DEEPINFER_TORCH_SPEC"}
    assert unknown_env_vars({"DEEPINFER_CACHE_PURE_PYTHON": "1", "DEEPINFER_TORCH_SPEC": "torch"}) == ()


def test_read_env_warns_once_per_unknown_variable_with_a_suggestion(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"DEEPINFER_DISABLE_SYNC_GAURD": "1", "DEEPINFER_ZZZ": "1", "DEEPINFER_CACHE_PURE_PYTHON": "1",
               "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "5", "DEEPINFER_SAMPLER_FORCE_TOP_K": "3"}
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine.config.env"):
        env = read_env(environ)
    assert env == EngineEnv(prefill_attempt_interval=5)
    assert [(r.name, r.levelno) for r in caplog.records] == [("deepinfer.engine.config.env", logging.WARNING)] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "DEEPINFER_DISABLE_SYNC_GAURD is not a DeepInfer environment variable; it is ignored "
        "(did you mean DEEPINFER_DISABLE_SYNC_GUARD?)",
        "DEEPINFER_SAMPLER_FORCE_TOP_K is not a DeepInfer environment variable; it is ignored "
        "(did you mean DEEPINFER_SAMPLER_FORCE_TOPK?)",
        "DEEPINFER_ZZZ is not a DeepInfer environment variable; it is ignored",
    ]


def test_known_variables_give_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine.config.env"):
        read_env({"DEEPINFER_DISABLE_SYNC_GUARD": "1", "DEEPINFER_TORCH_SPEC": "torch==2.13.0", "HOME": "/root"})
    assert caplog.records == []


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_SAMPLER_FORCE_TOPK", "3")
    assert read_env().sampler_force_topk == 3


def test_varlen_profile_cache_is_a_path_or_off() -> None:
    assert read_env({}).varlen_profile_cache is None and EngineEnv().varlen_profile_cache is None
    assert read_env({"DEEPINFER_VARLEN_PROFILE_CACHE": " "}).varlen_profile_cache is None     # empty: the default
    assert read_env({"DEEPINFER_VARLEN_PROFILE_CACHE": "/tmp/p.json"}).varlen_profile_cache == "/tmp/p.json"
    assert read_env({"DEEPINFER_VARLEN_PROFILE_CACHE": "~/p.json"}).varlen_profile_cache == \
        os.path.expanduser("~/p.json")
    assert read_env({"DEEPINFER_VARLEN_PROFILE_CACHE": "OFF"}).varlen_profile_cache == "off"
    assert EngineEnv(varlen_profile_cache="Off").varlen_profile_cache == "off"
    with pytest.raises(InvalidEnvVar, match="DEEPINFER_VARLEN_PROFILE_CACHE='' must be a file path, or off"):
        EngineEnv(varlen_profile_cache="")


def test_varlen_profile_cache_default_is_in_the_user_cache_folder() -> None:
    default = EngineEnv()
    assert varlen_profile_cache_path(default, {"XDG_CACHE_HOME": "/xdg", "HOME": "/home/u"}) == \
        "/xdg/deepinfer/varlen_profile.json"
    for xdg in ("", "relative/cache"):                 # XDG: a relative XDG_CACHE_HOME is ignored
        assert varlen_profile_cache_path(default, {"XDG_CACHE_HOME": xdg, "HOME": "/home/u"}) == \
            "/home/u/.cache/deepinfer/varlen_profile.json"
    assert varlen_profile_cache_path(EngineEnv(varlen_profile_cache="/p.json"), {"XDG_CACHE_HOME": "/xdg"}) == \
        "/p.json"
    assert varlen_profile_cache_path(EngineEnv(varlen_profile_cache="off"), {}) is None
