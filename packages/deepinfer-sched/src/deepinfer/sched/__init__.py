"""DeepInfer scheduler: sequences, queues and the per-step choice of what a DP rank runs.

`Scheduler.schedule()` returns one frozen `SchedulerOutput` per step: either a prefill (FIFO
admission under token, prompt-count and sum-of-K budgets, chunked) or a decode (LCFS with
preemption from the longest-output end), chosen by a vote over the DP group (`StepVoteGroup`).
Block ids and state slots come from two `deepinfer.cache.BlockManager`s. No torch.
"""

from importlib.metadata import PackageNotFoundError, version

from .config import ConfigError, EngineType, SchedulerConfig
from .output import DecodeBatch, IgnoredSeq, PrefillChunk, PrefilledSeq, SchedulerOutput, StepKind
from .prefix_cache import PrefixCacheStats
from .scheduler import Scheduler
from .sequence import BranchId, FinishReason, IgnoreReason, SeqStatus, SeqView, TokenLog, seq_key
from .verify import VerifyLengthPolicy
from .vote import AttemptPoint, SingleRankVoteGroup, StepVoteGroup

try:
    __version__ = version("deepinfer-sched")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AttemptPoint",
    "BranchId",
    "ConfigError",
    "DecodeBatch",
    "EngineType",
    "FinishReason",
    "IgnoreReason",
    "IgnoredSeq",
    "PrefillChunk",
    "PrefilledSeq",
    "PrefixCacheStats",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SeqStatus",
    "SeqView",
    "SingleRankVoteGroup",
    "StepKind",
    "StepVoteGroup",
    "TokenLog",
    "seq_key",
    "VerifyLengthPolicy",
    "__version__",
]
