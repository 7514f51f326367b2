"""The engine's environment variables: the only module that reads them (docs/design.md §13).

They are for tuning and debugging only; every switch that changes what the engine does is an
`EngineArgs` field (and a CLI flag). `read_env()` reads them once into a frozen `EngineEnv`, which is
passed down like any config (deepinfer-cache and deepinfer-sched take the values, never the variables). An
unset or empty variable takes its default. Booleans accept 0/1/true/false (any case), nothing else; a
"path" variable a file path (~ expanded) or "off" (any case).

`VARIABLES` describes each variable (allowed values and meaning); the table in docs/environment.md
is generated from it by `python -m deepinfer.engine.gen_docs`. A DEEPINFER_* variable that nothing
reads (a typo, most likely) is warned about, with the closest known name.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

PREFIX = "DEEPINFER_"
OFF = "off"           # a "path" variable's value that turns its file off
logger = logging.getLogger(__name__)


class InvalidEnvVar(ValueError):
    """An environment variable has a value outside its allowed range; the message names the variable."""


@dataclass(frozen=True, slots=True)
class EngineEnv:
    """Engine settings taken from the environment: one field per variable DEEPINFER_<FIELD>, described
    in `VARIABLES` (and docs/environment.md)."""

    prefill_attempt_interval: int = 70
    prefill_any_attempt_interval: int = 100
    num_state_slots_ratio: float = 1.2
    max_backtracking_tokens: int = 6
    disable_sync_guard: bool = False
    sampler_force_topk: int | None = None
    cudagraph_batch_size_interval: int = 8
    varlen_profile_cache: str | None = None     # None: the user cache folder's file (`varlen_profile_cache_path`)
    emulate_cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.sampler_force_topk == 0 and not isinstance(self.sampler_force_topk, bool):
            object.__setattr__(self, "sampler_force_topk", None)
        if isinstance(self.varlen_profile_cache, str) and self.varlen_profile_cache.lower() == OFF:
            object.__setattr__(self, "varlen_profile_cache", OFF)
        for field in fields(self):
            _check(_BY_FIELD[field.name], getattr(self, field.name))


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One engine environment variable.

    Attributes:
        field: the `EngineEnv` field it sets; the variable is DEEPINFER_<FIELD>.
        kind: how its text is parsed: "int", "float", "bool" or "path" (a file path, ~ expanded, or
            "off").
        allowed: the allowed values, in the words of errors and docs.
        description: what it does (docs/environment.md).
        check: True for an allowed (parsed) value.
        optional: None is a value too (the field is `int | None` or `str | None`).
        shown_default: the default as the docs state it, where the field's default stands for another
            value (None for a file under the user cache folder).
    """

    field: str
    kind: str
    allowed: str
    description: str
    check: Callable[[Any], bool]
    optional: bool = False
    shown_default: str | None = None

    @property
    def name(self) -> str:
        return env_var_name(self.field)


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("prefill_attempt_interval", "int", "an int >= 1",
           "every this many decode steps is an ALL attempt point: a prefill step runs if every DP rank "
           "wants one", lambda v: v >= 1),
    EnvVar("prefill_any_attempt_interval", "int", "an int >= 1",
           "every this many decode steps is an ANY attempt point: a prefill step runs if any DP rank "
           "wants one (it wins where both points coincide)", lambda v: v >= 1),
    EnvVar("num_state_slots_ratio", "float", "a float > 0",
           "state slots per admitted sequence: the engine keeps int(max_num_seqs × ratio) + 1 state "
           "slots", lambda v: v > 0),
    EnvVar("max_backtracking_tokens", "int", "an int >= 0",
           "spare slots of each sequence's window ring, kept for rejected draft tokens; speculative decoding "
           "needs at least k + 1 (k = draft tokens per step)", lambda v: v >= 0),
    EnvVar("disable_sync_guard", "bool", "a bool",
           "turn off the guard that forbids host-device synchronisation while a ZOS decode step is "
           "launched (`forbid_cuda_sync`; debugging)", lambda v: True),
    EnvVar("sampler_force_topk", "int", "an int >= 1, or 0 / unset for none",
           "the sampler considers only this many most likely tokens of each row", lambda v: v is None or v >= 1,
           optional=True),
    EnvVar("cudagraph_batch_size_interval", "int", "an int >= 1",
           "CUDA-graph batch sizes: 1, 2, 4, ... below it, then every multiple of it up to max_num_seqs",
           lambda v: v >= 1),
    EnvVar("varlen_profile_cache", "path", "a file path, or off",
           "the JSON file where varlen_verify keeps the step-time curve it measures at engine start, "
           "one entry per hash of the model and parallel config (docs/spec.md): a start that finds its entry "
           "skips the measurement. Writes are atomic, the last writer wins; an unreadable or corrupt file is "
           "warned about and measured again. off = measure at every start, write nothing",
           lambda v: v != "", optional=True,
           shown_default="$XDG_CACHE_HOME/deepinfer/varlen_profile.json (XDG_CACHE_HOME unset: ~/.cache)"),
    EnvVar("emulate_cuda_graphs", "bool", "a bool",
           "tests: capture the decode, draft-walk and verify-tail graphs as CPU stand-ins (a replay re-runs "
           "the captured function on the same static buffers), so the CUDA-graph path runs on any device; "
           "slower than eager, never faster", lambda v: True),
)
_BY_FIELD = {var.field: var for var in VARIABLES}

# DEEPINFER_* variables read outside this module (not engine settings): known, so not warned about.
OTHER_VARIABLES: dict[str, str] = {
    "DEEPINFER_CACHE_PURE_PYTHON": "read by deepinfer-cache at import: 1 = use its pure-Python block pools "
                                   "instead of the Cython extension",
    "DEEPINFER_TORCH_SPEC": "read by dev.sh: the torch requirement it installs into .venv (default "
                            "torch==2.13.0, a CPU build)",
}

# Variables that used to switch a behaviour and are `EngineArgs` fields now (variable -> field): refused
# when set, naming the field, so a setting that no longer acts never passes silently.
MOVED_VARIABLES: dict[str, str] = {
    "DEEPINFER_USE_NEXTN_DECODE": "num_speculative_tokens",
    "DEEPINFER_BATCH_INVARIANT": "batch_invariant",
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "yoco_prefill_truncation_mode",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "yoco_prefill_keep_tokens",
}


def env_var_name(field_name: str) -> str:
    """The environment variable behind an `EngineEnv` field, e.g. 'DEEPINFER_DISABLE_SYNC_GUARD'."""
    return PREFIX + field_name.upper()


def read_env(environ: Mapping[str, str] = os.environ) -> EngineEnv:
    """Read every DEEPINFER_* setting from `environ` into an `EngineEnv`.

    Logs one warning (logger "deepinfer.engine.config.env") per DEEPINFER_* variable that nothing reads,
    naming the closest known variable when there is one.

    Raises:
        InvalidEnvVar: a variable does not parse or is out of range (the message names the variable,
            its value and what is allowed), or is one of `MOVED_VARIABLES` (naming its engine argument).
    """
    for name, field in MOVED_VARIABLES.items():
        if environ.get(name, "").strip():
            flag = "--" + field.replace("_", "-")
            raise InvalidEnvVar(f"{name} is no longer read: it is the engine argument {field} ({flag}) now; "
                                "unset it")
    for name in unknown_env_vars(environ):
        logger.warning("%s", unknown_env_var_message(name))
    values: dict[str, Any] = {}
    for var in VARIABLES:
        raw = environ.get(var.name, "").strip()
        if raw:
            values[var.field] = _PARSERS[var.kind](var, raw)
    return EngineEnv(**values)


def varlen_profile_cache_path(env: EngineEnv, environ: Mapping[str, str] = os.environ) -> str | None:
    """The file of DEEPINFER_VARLEN_PROFILE_CACHE, or None when it is off.

    Its default (`env.varlen_profile_cache` None) is <user cache folder>/deepinfer/varlen_profile.json,
    the user cache folder being XDG_CACHE_HOME when that is an absolute path, else ~/.cache (the XDG
    base directory rule), both read from `environ` now.
    """
    if env.varlen_profile_cache == OFF:
        return None
    if env.varlen_profile_cache is not None:
        return env.varlen_profile_cache
    base = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deepinfer", "varlen_profile.json")


def unknown_env_vars(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """DEEPINFER_* variables set in `environ` that nothing reads (likely typos), sorted."""
    known = _known_names() | set(MOVED_VARIABLES)
    return tuple(sorted(name for name in environ if name.startswith(PREFIX) and name not in known))


def unknown_env_var_message(name: str) -> str:
    """The warning for an unknown variable `name`, with the closest known name when one is close."""
    suffixes = {known[len(PREFIX):]: known for known in _known_names()}
    close = difflib.get_close_matches(name[len(PREFIX):], list(suffixes), n=1)
    hint = f" (did you mean {suffixes[close[0]]}?)" if close else ""
    return f"{name} is not a DeepInfer environment variable; it is ignored{hint}"


def _known_names() -> set[str]:
    return {var.name for var in VARIABLES} | set(OTHER_VARIABLES)


def _parse_int(var: EnvVar, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidEnvVar(f"{var.name}={raw!r} must be an integer ({var.allowed})") from None


def _parse_float(var: EnvVar, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise InvalidEnvVar(f"{var.name}={raw!r} must be a number ({var.allowed})") from None
    if not math.isfinite(value):
        raise InvalidEnvVar(f"{var.name}={raw!r} must be finite ({var.allowed})")
    return value


def _parse_path(var: EnvVar, raw: str) -> str:
    return OFF if raw.lower() == OFF else os.path.expanduser(raw)


def _parse_bool(var: EnvVar, raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("1", "true"):
        return True
    if lowered in ("0", "false"):
        return False
    raise InvalidEnvVar(f"{var.name}={raw!r} must be one of 0, 1, true, false (any case)")


_PARSERS: dict[str, Callable[[EnvVar, str], Any]] = {"int": _parse_int, "float": _parse_float, "bool": _parse_bool,
                                                   "path": _parse_path}
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,),
                                       "path": (str,)}


def _check(var: EnvVar, value: object) -> None:
    types = _TYPES[var.kind] + ((type(None),) if var.optional else ())
    wrong_type = not isinstance(value, types) or (isinstance(value, bool) and var.kind != "bool")
    if wrong_type or not var.check(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise InvalidEnvVar(f"{var.name}={value!r} must be {var.allowed}")


@dataclass(frozen=True, slots=True)
class TorchrunEnv:
    """The rank variables torchrun sets (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`)."""

    rank: int            # in [0, world_size)
    world_size: int      # >= 1
    master_addr: str
    master_port: int     # in [1, 65535]


def read_torchrun_env(environ: Mapping[str, str] = os.environ) -> TorchrunEnv | None:
    """torchrun's rank variables, or None when WORLD_SIZE is unset (not launched by torchrun).

    Raises:
        InvalidEnvVar: a variable missing or out of range, naming it.
    """
    if not environ.get("WORLD_SIZE"):
        return None
    values: dict[str, int] = {}
    for name, low, high in (("WORLD_SIZE", 1, 2**20), ("RANK", 0, 2**20), ("MASTER_PORT", 1, 65535)):
        raw = environ.get(name, "")
        if not raw.strip().isdigit() or not low <= int(raw) <= high:
            raise InvalidEnvVar(f"{name}={raw!r} must be an integer in [{low}, {high}] (torchrun sets it)")
        values[name] = int(raw)
    if values["RANK"] >= values["WORLD_SIZE"]:
        raise InvalidEnvVar(f"RANK={values['RANK']} must be < WORLD_SIZE={values['WORLD_SIZE']}")
    addr = environ.get("MASTER_ADDR", "")
    if not addr:
        raise InvalidEnvVar("MASTER_ADDR must be set with WORLD_SIZE (torchrun sets it)")
    return TorchrunEnv(values["RANK"], values["WORLD_SIZE"], addr, values["MASTER_PORT"])
