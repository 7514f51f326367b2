"""Snapshots the fronts report to the server's metrics: one engine's `EngineStats`, and for DP ranks
`ParallelStats` with the EPLB re-placements (`RebalanceStats`) adopted so far. Plain frozen data with no
imports of the engine's own, so the fronts (`async_front`) and the rank messages (`parallel.messages`)
both take them from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostCacheStats:
    """The prefix cache's host tier (docs/prefix_cache.md), summed over DP ranks where there are several.

    Attributes:
        hits: prompt tokens whose KV blocks came back from host memory so far (of the prefix-cache hits).
        spills: KV blocks copied to host memory so far.
        num_blocks: KV blocks held in host memory now.
        num_snapshots: state snapshots held in host memory now.
    """

    hits: int = 0
    spills: int = 0
    num_blocks: int = 0
    num_snapshots: int = 0

    def __add__(self, other: HostCacheStats) -> HostCacheStats:
        return HostCacheStats(self.hits + other.hits, self.spills + other.spills, self.num_blocks + other.num_blocks,
                              self.num_snapshots + other.num_snapshots)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of one engine (or the sum over DP ranks) after its latest step.

    Attributes:
        num_running: sequences decoding (or about to), per the scheduler.
        num_waiting: requests accepted but not running: in the inbox, compiling a grammar or
            waiting for prefill.
        num_free_kv_blocks: free paged KV blocks (block 0, reserved, not counted).
        num_kv_blocks: usable paged KV blocks (block 0 excluded).
        host_cache: the prefix cache's host tier (all 0 without one).
        kv_transfer: a prefill/decode pair's KV handed over so far; None for a NORMAL engine.
    """

    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    host_cache: HostCacheStats = HostCacheStats()
    kv_transfer: TransferStats | None = None

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the usable KV blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0



@dataclass(frozen=True, slots=True)
class RebalanceStats:
    """One adopted re-placement, as the engine reports it.

    Attributes:
        step: forward steps counted when it was decided.
        layer_ids: MoE layer indices (forward order) it re-placed.
        max_mean_before: per layer of `layer_ids`: max / mean rank load over the window, old placement.
        max_mean_after: the same under the new placement.
        num_moves: expert copies made; num_remote_moves of them travelled between ranks.
        num_remote_moves: see num_moves.
    """

    step: int
    layer_ids: tuple[int, ...]
    max_mean_before: tuple[float, ...]
    max_mean_after: tuple[float, ...]
    num_moves: int
    num_remote_moves: int


@dataclass(frozen=True, slots=True)
class ParallelStats:
    """The DP ranks as the server's metrics see them.

    Attributes:
        rank_stats: per rank, its running and waiting requests and KV cache.
        num_requests: per rank, the requests sent to it so far.
        eplb: EPLB is on (re-placements happen and are counted).
        rebalances: every re-placement adopted so far, oldest first.
    """

    rank_stats: tuple[EngineStats, ...]
    num_requests: tuple[int, ...]
    eplb: bool
    rebalances: tuple[RebalanceStats, ...]


@dataclass(frozen=True, slots=True)
class TransferStats:
    """KV handed over between the engines of a prefill/decode pair so far (`kv_handoff.KVTransfer`).

    Attributes:
        num_transfers: requests whose KV was sent (prefill side) or received (decode side).
        num_bytes: their KV and state bytes (framing and metadata not counted).
        seconds: wall time spent moving them (the prefill side: writing them out; the decode side:
            from the prefill request until the last byte arrived, prefill included).
    """

    num_transfers: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
