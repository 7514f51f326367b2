"""Attention data parallel + MoE expert parallel over torch.distributed (docs/design.md §9, §3.1, §10).

`LLM(..., data_parallel_size=N, expert_parallel=True)` runs N ranks (spawned, or this process under
torchrun): `launcher` starts them, `rank.DPRank` is one rank's engine and lockstep loop, and
`eplb_live.LiveBalancer` re-places experts from the router's counts while serving. `deepinfer serve
--data-parallel-size N` runs the ranks online: `dp_async.DPAsyncLLM` is the server's front, each
rank process runs `serve_rank.RankServer`, `messages` is what travels between them, and
`rank_processes` watches and reaps the rank processes.
"""

from ..core.stats import ParallelStats, RebalanceStats
from .dp_async import DPAsyncLLM
from .eplb_live import LiveBalancer
from .launcher import SpawnedRanks, rank_main, start_ranks
from .rank import DPRank, RankFailure, RankSpec, assign_least_loaded

__all__ = [
    "DPAsyncLLM",
    "DPRank",
    "LiveBalancer",
    "ParallelStats",
    "RankFailure",
    "RankSpec",
    "RebalanceStats",
    "SpawnedRanks",
    "assign_least_loaded",
    "rank_main",
    "start_ranks",
]
