"""What travels between the serving front (`dp_async.DPAsyncLLM`) and its rank processes
(`serve_rank`), over torch.multiprocessing queues: one inbox per rank, one outbox shared by the ranks.

Front -> rank. Every new request makes one *counted* message per rank, numbered by `seq` (1, 2, ...,
the same number on every rank): `Submit` to the rank chosen for it, `Wake` to the others; `Stop` is
counted too. The ranks compare how many counted messages each has taken before deciding, together,
to block on their inboxes (see `serve_rank`). `Abort` goes to the request's rank only, uncounted.

Rank -> front: `RankReady` once, then a `RankReport` after each step (and after taking requests it
refused), `RankStopping` once if the rank gets SIGTERM (the front then stops every rank with `Stop`),
or `RankError` before the process exits on an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.intake import PromptInput
from ..core.outputs import RequestOutput
from ..core.stats import HostCacheStats, RebalanceStats
from ..sampling.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Submit:
    """A new request for this rank (counted)."""

    seq: int
    request_id: str
    prompt: PromptInput | Sequence[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Wake:
    """A new request went to another rank (counted): this one must take part in the next steps."""

    seq: int


@dataclass(frozen=True, slots=True)
class Stop:
    """Exit once no rank has work left (counted; the front sends nothing after it)."""

    seq: int


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort a request of this rank (uncounted; an unknown or finished id is ignored)."""

    request_id: str


FrontMessage = Submit | Wake | Stop | Abort


@dataclass(frozen=True, slots=True)
class RankReady:
    """The rank joined the group and built its engine."""

    rank: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class Refusal:
    """The rank's engine refused a request (nothing was queued); `error` is raised to its caller."""

    request_id: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class RankLoad:
    """The rank's scheduler and KV cache after its latest step."""

    num_running: int
    num_free_kv_blocks: int
    num_kv_blocks: int            # usable blocks (block 0 excluded)
    host_cache: HostCacheStats = HostCacheStats()


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one rank has to tell after a step.

    Attributes:
        rank: the rank reporting.
        outputs: the step's DELTA outputs. The prompt (text and token ids) travels once, in the first
            output of a request, and prompt_logprobs once they are filled; later outputs carry
            None, [] and None (the front keeps the first).
        refusals: requests the rank's engine refused since its previous report.
        load: the rank after the step.
        rebalances: EPLB re-placements adopted since the previous report (rank 0 only: every rank
            computes the same ones).
    """

    rank: int
    outputs: tuple[RequestOutput, ...]
    refusals: tuple[Refusal, ...]
    load: RankLoad
    rebalances: tuple[RebalanceStats, ...]


@dataclass(frozen=True, slots=True)
class RankStopping:
    """The rank got SIGTERM: it refuses new requests, and the front stops every rank (`Stop`) once
    they have finished the requests they hold, as one engine process does on SIGTERM."""

    rank: int


@dataclass(frozen=True, slots=True)
class RankError:
    """The rank failed and is exiting; `detail` is the exception's one-line text."""

    rank: int
    detail: str


RankMessage = RankReady | RankReport | RankStopping | RankError
