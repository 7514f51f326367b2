"""The engine's environment variables: the only module that reads them (STYLE.md rule 6).

`read_env()` reads them once into a frozen `EngineEnv`, which is passed down like any config. An
unset or empty variable takes its default. Booleans accept 0/1/true/false (any case), nothing else.

| variable | field | allowed | default |
|---|---|---|---|
| DEEPINFER_PREFILL_ATTEMPT_INTERVAL | prefill_attempt_interval | int >= 1 | 70 |
| DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL | prefill_any_attempt_interval | int >= 1 | 100 |
| DEEPINFER_NUM_STATE_SLOTS_RATIO | num_state_slots_ratio | float > 0 | 1.2 |
| DEEPINFER_MAX_BACKTRACKING_TOKENS | max_backtracking_tokens | int >= 0 | 6 |
| DEEPINFER_DISABLE_SYNC_GUARD | disable_sync_guard | bool | False |
| DEEPINFER_BATCH_INVARIANT | batch_invariant | bool | False |
| DEEPINFER_SAMPLER_FORCE_TOPK | sampler_force_topk | int >= 1, or unset | None |
| DEEPINFER_USE_NEXTN_DECODE | use_nextn_decode | int >= 0 | 0 |
| DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL | cudagraph_batch_size_interval | int >= 1 | 8 |

DEEPINFER_USE_NEXTN_DECODE is the draft block size of speculative decoding; the original engine
defaults to 5, ours to 0 (no drafts) until speculative decoding is implemented.
DEEPINFER_SAMPLER_FORCE_TOPK=0 means the same as unset (no forced top-k).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

PREFIX = "DEEPINFER_"


class InvalidEnvVar(ValueError):
    """An environment variable has a value outside its allowed range; the message names it."""


@dataclass(frozen=True, slots=True)
class EngineEnv:
    """Engine settings taken from the environment (see the module docstring for the variables)."""

    prefill_attempt_interval: int = 70       # decode steps between ALL-vote prefill attempts
    prefill_any_attempt_interval: int = 100  # decode steps between ANY-vote prefill attempts
    num_state_slots_ratio: float = 1.2       # state slots = max_num_seqs * ratio + 1
    max_backtracking_tokens: int = 6         # spare ring slots for rejected draft tokens
    disable_sync_guard: bool = False         # turn off forbid_cuda_sync() (debugging)
    batch_invariant: bool = False            # batch-invariant kernels (deterministic outputs)
    sampler_force_topk: int | None = None    # sampler considers only this many tokens per row
    use_nextn_decode: int = 0                # draft tokens per step; 0 = no speculative decoding
    cudagraph_batch_size_interval: int = 8   # CUDA-graph sizes: powers of 2 up to it, then steps of it

    def __post_init__(self) -> None:
        if self.sampler_force_topk == 0 and not isinstance(self.sampler_force_topk, bool):
            object.__setattr__(self, "sampler_force_topk", None)
        for field in fields(self):
            _check(field.name, getattr(self, field.name))


def env_var_name(field_name: str) -> str:
    """The environment variable behind an `EngineEnv` field, e.g. 'DEEPINFER_BATCH_INVARIANT'."""
    return PREFIX + field_name.upper()


def read_env(environ: Mapping[str, str] = os.environ) -> EngineEnv:
    """Read every DEEPINFER_* setting from `environ` into an `EngineEnv`.

    Raises:
        InvalidEnvVar: a variable does not parse or is out of range; the message names the variable,
            its value and the allowed range.
    """
    values: dict[str, Any] = {}
    for field in fields(EngineEnv):
        name = env_var_name(field.name)
        raw = environ.get(name, "").strip()
        if raw:
            values[field.name] = _PARSERS[field.name](name, raw)
    return EngineEnv(**values)


def unknown_env_vars(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """DEEPINFER_* variables set in `environ` that no `EngineEnv` field reads (likely typos), sorted."""
    known = {env_var_name(field.name) for field in fields(EngineEnv)}
    return tuple(sorted(name for name in environ if name.startswith(PREFIX) and name not in known))


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidEnvVar(f"{name}={raw!r} must be an integer ({_RANGES[name]})") from None


def _parse_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise InvalidEnvVar(f"{name}={raw!r} must be a number ({_RANGES[name]})") from None
    if not math.isfinite(value):
        raise InvalidEnvVar(f"{name}={raw!r} must be finite ({_RANGES[name]})")
    return value


def _parse_bool(name: str, raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("1", "true"):
        return True
    if lowered in ("0", "false"):
        return False
    raise InvalidEnvVar(f"{name}={raw!r} must be one of 0, 1, true, false (any case)")


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "prefill_attempt_interval": _parse_int,
    "prefill_any_attempt_interval": _parse_int,
    "num_state_slots_ratio": _parse_float,
    "max_backtracking_tokens": _parse_int,
    "disable_sync_guard": _parse_bool,
    "batch_invariant": _parse_bool,
    "sampler_force_topk": _parse_int,
    "use_nextn_decode": _parse_int,
    "cudagraph_batch_size_interval": _parse_int,
}

# Allowed values per field: a check and the wording used in errors.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "prefill_attempt_interval": (lambda v: v >= 1, "an int >= 1"),
    "prefill_any_attempt_interval": (lambda v: v >= 1, "an int >= 1"),
    "num_state_slots_ratio": (lambda v: v > 0, "a float > 0"),
    "max_backtracking_tokens": (lambda v: v >= 0, "an int >= 0"),
    "disable_sync_guard": (lambda v: True, "a bool"),
    "batch_invariant": (lambda v: True, "a bool"),
    "sampler_force_topk": (lambda v: v is None or v >= 1, "an int >= 1, or 0 / unset for none"),
    "use_nextn_decode": (lambda v: v >= 0, "an int >= 0"),
    "cudagraph_batch_size_interval": (lambda v: v >= 1, "an int >= 1"),
}
_RANGES = {env_var_name(name): wording for name, (_, wording) in _RULES.items()}
_TYPES: dict[str, tuple[type, ...]] = {
    "num_state_slots_ratio": (int, float),
    "disable_sync_guard": (bool,),
    "batch_invariant": (bool,),
    "sampler_force_topk": (int, type(None)),
}


def _check(field_name: str, value: object) -> None:
    check, wording = _RULES[field_name]
    types = _TYPES.get(field_name, (int,))
    wrong_type = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
    if wrong_type or not check(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise InvalidEnvVar(f"{env_var_name(field_name)}={value!r} must be {wording}")
