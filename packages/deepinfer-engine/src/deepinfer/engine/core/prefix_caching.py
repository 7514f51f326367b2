"""The engine's side of prefix caching (deepinfer.sched.prefix_cache holds the logic): the key that
salts every block hash, and what a request reports of its cache hit."""

from __future__ import annotations

import hashlib

from deepinfer.sched import PrefixCacheStats

from ..config.engine_args import EngineArgs
from ..config.env import EngineEnv
from .request import Request
from .stats import HostCacheStats


def prefix_cache_key(args: EngineArgs, env: EngineEnv) -> bytes:
    """Bytes naming everything besides the tokens that changes a block's KV or a state snapshot: the
    model (folder, load format, seed of dummy weights), dtypes, KV quantisation, the draft head (its
    rings are part of the state) and the ring lengths. One engine's cache never meets another's; the
    key keeps a later shared tier (host memory, disk) from mixing them."""
    parts = (args.model, args.load_format, args.seed if args.load_format == "dummy" else None, args.dtype,
             args.kv_quant, args.expert_dtype, args.num_speculative_tokens, env.max_backtracking_tokens,
             args.yoco_prefill_truncation_mode, args.yoco_prefill_keep_tokens)
    return hashlib.sha256(repr(parts).encode()).digest()


def num_prefix_snapshots(args: EngineArgs, slot_bytes: int, snapshot_bytes: int, num_state_slots: int,
                         budget_bytes: int) -> int:
    """State snapshots to keep: `prefix_cache_snapshots`, or by default 2 × max_num_seqs (a chat between
    turns holds one, a shared system prompt one more) but at most a quarter of what the state slots
    leave of the cache budget when the budget sizes the cache (num_kv_blocks unset); 0 turns prefix
    caching off."""
    if args.prefix_cache_snapshots is not None:
        return args.prefix_cache_snapshots
    wanted = 2 * args.max_num_seqs
    if args.num_kv_blocks is None:
        wanted = min(wanted, max(0, budget_bytes - num_state_slots * slot_bytes) // 4 // snapshot_bytes)
    return wanted


def record_cached_tokens(req: Request | None, num_cached_tokens: int) -> None:
    """A request admitted from the waiting queue with `num_cached_tokens` of its prompt from the cache:
    reported by its first admission (a recompute after preemption reports nothing new)."""
    if req is not None and not req.output_token_ids:
        req.num_cached_tokens = num_cached_tokens


def host_cache_stats(stats: PrefixCacheStats) -> HostCacheStats:
    """A scheduler's prefix-cache host tier (`Scheduler.prefix_cache_stats`) as the fronts report it."""
    return HostCacheStats(stats.host_hits, stats.num_host_spills, stats.num_host_blocks, stats.num_host_snapshots)
