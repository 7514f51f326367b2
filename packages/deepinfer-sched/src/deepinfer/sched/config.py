"""The scheduler's frozen configuration, validated on construction.

Environment overrides (DEEPINFER_PREFILL_ATTEMPT_INTERVAL, ...) are resolved by deepinfer.engine;
this package only takes values.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["ConfigError", "EngineType", "SchedulerConfig"]

_INT32_MAX = 2**31 - 1


class ConfigError(ValueError):
    """A configuration field is out of its allowed range; the message names the field."""


class EngineType(enum.Enum):
    """Which step kinds an engine runs (docs/design.md §3.5).

    NORMAL prefills and decodes, choosing the step kind by the DP vote; PROMPT only prefills (a
    prefill engine of a disaggregated deployment); COMPLETION only decodes (sequences arrive
    already prefilled, through `Scheduler.add_prefilled_seq`).
    """

    NORMAL = "normal"
    PROMPT = "prompt"
    COMPLETION = "completion"


def _check_int(name: str, value: object, low: int, high: int = _INT32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int in [{low}, {high}], got {type(value).__name__}")
    if not low <= value <= high:
        raise ConfigError(f"{name}={value} out of range: must be in [{low}, {high}]")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and policies of one scheduler (one DP rank).

    The KV block and state slot counts are not here: they come from the two BlockManagers handed
    to `Scheduler`.

    Attributes:
        block_size: tokens per KV block, >= 1.
        max_model_len: longest sequence (prompt + output tokens), >= 1. Longer prompts are ignored.
        max_num_seqs: most sequences holding KV at once (running, prompted or mid-prefill), >= 1.
        max_num_batched_tokens: prefill token budget of one step, >= 1; longer prompts are chunked.
        max_num_prompts: most sequences in one prefill step, >= 1; None means max_num_seqs.
        prefill_max_sum_seqlen_k: bound on the sum over a prefill step's sequences of their K
            length (cached + new tokens), bounding attention work; None means no bound. It must be
            >= max_model_len, so that every admissible prompt can run alone.
        nextn: draft tokens verified per decode step, >= 0; each decode step reserves nextn + 1
            query tokens per sequence (ZOS and drafts raise it).
        chunk_checkpoints: token positions at which a prompt may be cut into chunks, strictly
            increasing, each >= 1; empty means "anywhere". When no checkpoint fits the budget and
            the step is otherwise empty, the chunk is cut at the budget so the prompt progresses.
        stop_preempted_request: True finishes a preempted sequence with reason "preempted"; False
            frees it and puts it back at the front of the waiting queue to be recomputed (not
            allowed for COMPLETION engines, which cannot prefill).
        prefill_attempt_interval: every this many decode steps is an ALL attempt point (prefill if
            every DP rank wants it), >= 1.
        prefill_any_attempt_interval: every this many decode steps is an ANY attempt point (prefill
            if any DP rank wants it), >= 1; it wins where both points coincide.
        max_cache_usage_for_prefill: a rank wants prefill only while its KV block usage is <= this
            fraction, in [0, 1] (with nothing running, the rest of a prompt mid-prefill goes on anyway).
        engine_type: NORMAL, PROMPT or COMPLETION.
        enable_prefix_caching: reuse the KV blocks and state snapshots of cached prompt prefixes
            (prefix_cache.py); the Scheduler then needs `snapshot_slots`.
        prefix_cache_key: bytes folded into every block hash: what else changes the KV of the same
            tokens (model, KV dtype, ...).
    """

    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_num_prompts: int | None = None
    prefill_max_sum_seqlen_k: int | None = None
    nextn: int = 0
    chunk_checkpoints: tuple[int, ...] = ()
    stop_preempted_request: bool = True
    prefill_attempt_interval: int = 70
    prefill_any_attempt_interval: int = 100
    max_cache_usage_for_prefill: float = 0.9
    engine_type: EngineType = EngineType.NORMAL
    enable_prefix_caching: bool = False
    prefix_cache_key: bytes = b""

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_prompts is not None:
            _check_int("max_num_prompts", self.max_num_prompts, 1)
        if self.prefill_max_sum_seqlen_k is not None:
            _check_int("prefill_max_sum_seqlen_k", self.prefill_max_sum_seqlen_k, self.max_model_len)
        _check_int("nextn", self.nextn, 0, 64)
        _check_int("prefill_attempt_interval", self.prefill_attempt_interval, 1)
        _check_int("prefill_any_attempt_interval", self.prefill_any_attempt_interval, 1)
        if not isinstance(self.chunk_checkpoints, tuple):
            raise ConfigError(
                f"chunk_checkpoints must be a tuple of ints, got {type(self.chunk_checkpoints).__name__}"
            )
        previous = 0
        for index, position in enumerate(self.chunk_checkpoints):
            _check_int(f"chunk_checkpoints[{index}]", position, previous + 1)
            previous = position
        if not isinstance(self.stop_preempted_request, bool):
            raise ConfigError("stop_preempted_request must be a bool")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError("enable_prefix_caching must be a bool")
        if type(self.prefix_cache_key) is not bytes:
            raise ConfigError(f"prefix_cache_key must be bytes, got {type(self.prefix_cache_key).__name__}")
        usage = self.max_cache_usage_for_prefill
        if (isinstance(usage, bool) or not isinstance(usage, (int, float)) or not math.isfinite(usage)
                or not 0.0 <= usage <= 1.0):
            raise ConfigError(f"max_cache_usage_for_prefill={usage!r} out of range: must be in [0, 1]")
        if not isinstance(self.engine_type, EngineType):
            allowed = ", ".join(member.name for member in EngineType)
            raise ConfigError(f"engine_type={self.engine_type!r} must be an EngineType ({allowed})")
        if self.engine_type is EngineType.COMPLETION and not self.stop_preempted_request:
            raise ConfigError(
                "stop_preempted_request=False (recompute) is not allowed with engine_type=COMPLETION: "
                "a completion engine cannot prefill; it must be True"
            )

    @property
    def max_query_len(self) -> int:
        """Query tokens reserved per sequence by one decode step: nextn + 1."""
        return self.nextn + 1

    @property
    def prompt_limit(self) -> int:
        """Most sequences in one prefill step: max_num_prompts, or max_num_seqs when unset."""
        return self.max_num_seqs if self.max_num_prompts is None else self.max_num_prompts

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: max_model_len plus two in-flight decode reservations (ZOS), in blocks."""
        return -(-(self.max_model_len + 2 * self.max_query_len) // self.block_size)
