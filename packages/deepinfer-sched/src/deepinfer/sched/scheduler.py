"""The step scheduler of one DP rank (docs/design.md §3). `schedule()` reads like the design:

    vote on the step kind -> prefill (FIFO admission, chunking) or decode (promote, reserve,
    preempt) -> emit one SchedulerOutput
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import numpy as np

from . import admission, requests
from .config import EngineType, SchedulerConfig
from .decode import DecodeScratch, schedule_decode
from .fork import fork_seq
from .host_tier import HostTier
from .integrity import check_integrity
from .output import DecodeBatch, PrefillChunk, PrefilledSeq, SchedulerOutput, StepKind
from .pools import BlockPool, HashedBlockPool, is_hashed
from .prefix_cache import PrefixCacheStats
from .sequence import BranchId, FinishReason, SeqView, TokenLog
from .state import SchedState
from .verify import VerifyLengthPolicy
from .vote import SingleRankVoteGroup, StepVoteGroup, attempt_point, cast_vote, confirm_prefill

__all__ = ["Scheduler"]


def load_decode_core(native: bool | None) -> ModuleType:
    """The compiled decode core (native True or None) or its numpy twin (False, or None when the
    extension is not built)."""
    if native is False:
        from ._pure import decode_core
        return decode_core
    try:
        import deepinfer.sched._decode_core as _decode_core
    except ImportError:
        if native:
            raise
        from ._pure import decode_core
        return decode_core
    return _decode_core


class Scheduler:
    """Sequences, queues and the per-step choice of what runs on this rank.

    Not thread-safe: the engine serialises all calls.

    Args:
        config: limits and policies (`SchedulerConfig`).
        kv_blocks: the paged KV `BlockManager` (deepinfer.cache); block 0 is never handed out.
        state_slots: the state-slot `BlockManager` (`BlockManager.for_state_slots`); slot 0 is
            the dummy slot.
        vote_group: the DP group the step-kind vote runs over; None = a single rank.
        verify_policy: assigns per-sequence query lengths in [1, nextn + 1] to decode batches;
            None = every sequence feeds nextn + 1 tokens.
        native: True requires the Cython decode core, False uses the numpy twin, None (default)
            uses the Cython core when it is built.
        snapshot_slots: with `config.enable_prefix_caching`, the `BlockManager` of state snapshot
            slots (`BlockManager(num_snapshots + 1)`, slot 0 unused; prefix_cache.py); ignored
            otherwise.
        host_blocks / host_snapshots: with prefix caching, the host tier's `BlockManager`s of host
            KV blocks and host snapshots (`BlockManager(n + 1)`, id 0 unused; host_tier.py), both or
            neither (None: no host tier).

    Raises:
        ValueError: kv_blocks, state_slots, snapshot_slots or a host pool lacks the BlockManager
            interface, prefix caching is on without snapshot_slots, or only one host pool is given.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_blocks: BlockPool,
        state_slots: BlockPool,
        *,
        vote_group: StepVoteGroup | None = None,
        verify_policy: VerifyLengthPolicy | None = None,
        native: bool | None = None,
        snapshot_slots: HashedBlockPool | None = None,
        host_blocks: HashedBlockPool | None = None,
        host_snapshots: HashedBlockPool | None = None,
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise ValueError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        for name, manager in (("kv_blocks", kv_blocks), ("state_slots", state_slots)):
            missing = [attr for attr in ("allocate", "free", "pin", "num_free", "num_blocks", "usage")
                       if not hasattr(manager, attr)]
            if missing:
                raise ValueError(f"{name} must be a deepinfer.cache.BlockManager; it lacks {missing}")
        self._st = SchedState(config, kv_blocks, state_slots, snapshot_slots,
                              _host_tier(config, host_blocks, host_snapshots))
        self._group: StepVoteGroup = vote_group if vote_group is not None else SingleRankVoteGroup()
        self._verify_policy = verify_policy
        self._core = load_decode_core(native)
        self._scratch = DecodeScratch(config.max_num_seqs)

    @property
    def config(self) -> SchedulerConfig:
        return self._st.config

    @property
    def uses_native_core(self) -> bool:
        """True when the decode hot loop runs in the Cython extension."""
        return not self._core.__name__.endswith("_pure.decode_core")

    # ---------------------------------------------------------------- engine -> scheduler

    def add_seq(
        self, seq_id: str, prompt_token_ids: Iterable[int], max_tokens: int, *, recomputable: bool = True,
        share_list: bool = False, use_prefix_cache: bool = True,
    ) -> None:
        """Queues a request for prefill (FIFO).

        Args:
            seq_id: unique id; not starting with "_" (reserved for fork branches).
            prompt_token_ids: token ids, each in [0, 2**31).
            max_tokens: output limit, >= 1 (the engine enforces it; kept for `get_seq`).
            recomputable: False = a preemption always finishes it, even with
                stop_preempted_request=False (structured-output requests, docs/design.md §3.3).
            share_list: False (default) = the scheduler keeps its own copy of the tokens and
                `append_*` extend it. True = `prompt_token_ids` must be a `TokenLog` of ints, which
                becomes the sequence's token history in place (no copy): the scheduler reads it
                (prefill chunks, recompute after preemption, fork) and never writes it; its owner,
                the one writer, appends each token it hands to `append_tokens` /
                `append_decode_tokens` (the kept ones only) to the log before the call, so the
                history is kept once.
            use_prefix_cache: False = prefill every token even where the prefix cache holds them (a
                request that wants every prompt position's logits); its blocks are still cached.

        An empty prompt, a prompt longer than max_model_len or one needing more KV blocks than
        the cache holds is not queued: the next `schedule()` reports it in `ignored`.

        Raises:
            ValueError: a bad or duplicate seq_id, bad token ids or max_tokens, or a COMPLETION
                engine (use `add_prefilled_seq`).
        """
        requests.add_seq(self._st, seq_id, prompt_token_ids, max_tokens, recomputable, share_list, use_prefix_cache)

    def add_prefilled_seq(
        self, seq_id: str, prompt_token_ids: Iterable[int], first_token_id: int, max_tokens: int, *,
        share_list: bool = False,
    ) -> PrefilledSeq | None:
        """Admits a sequence whose prompt was prefilled elsewhere (a COMPLETION engine's input):
        allocates its blocks and state slot now; the caller writes the transferred KV and state
        into them. It joins the running set at the next decode step.

        share_list: as `add_seq`; the shared list must already hold the prompt followed by
        first_token_id (a token reaches the list before the scheduler).

        Returns:
            The block table and state slot to fill, or None when blocks, a slot or
            max_num_seqs do not allow it now (nothing changed; retry later).

        Raises:
            ValueError: as `add_seq`, plus an empty or over-long prompt or a bad first_token_id.
        """
        return requests.add_prefilled_seq(self._st, seq_id, prompt_token_ids, first_token_id, max_tokens,
                                          share_list)

    def abort_seq(self, seq_id: str) -> None:
        """Finishes a sequence at once and frees what it holds. A WAITING one (never run, or
        queued for recompute) is reported by the next `schedule()` in `ignored` with reason
        ABORTED. Raises KeyError for an unknown id."""
        requests.abort_seq(self._st, seq_id)

    def finish_seq(self, seq_id: str, reason: FinishReason) -> None:
        """Finishes a sequence (the engine decided: STOP, LENGTH, ABORT, ERROR or PREFILLED) and frees
        its blocks, state slot and row. Raises KeyError for an unknown id, ValueError for another
        reason (PREEMPTED and IGNORED are the scheduler's own)."""
        requests.finish_seq(self._st, seq_id, reason)

    def append_tokens(self, seq_id: str, token_ids: Iterable[int]) -> None:
        """Records the tokens a step produced for a sequence, oldest step first.

        After the prefill chunk that completed the prompt: exactly the one sampled token. After a
        decode step: the accepted tokens, 1 to nextn + 1 (the verified drafts plus the bonus
        token); the step's unused reserved positions are given back. A sequence added with
        share_list=True takes only the count here: its list must already end with token_ids.

        Raises:
            KeyError: unknown id (e.g. finished or preempted: drop its in-flight results).
            ValueError: no step of it is in flight, a bad token count or id, or a shared list
                that does not end with token_ids.
        """
        requests.append_tokens(self._st, seq_id, token_ids)

    def append_decode_tokens(
        self, seq_ids: tuple[str, ...], token_ids: np.ndarray, num_accepted: np.ndarray
    ) -> int:
        """`append_tokens` for a whole decode step at once (the engine's fast path).

        Args:
            seq_ids: [num_seqs] the step's `DecodeBatch.seq_ids`. Sequences finished or preempted
                since the step was scheduled are skipped: their results are dropped.
            token_ids: [num_seqs, k] integer token ids, k in [1, nextn + 1]; row i holds the
                tokens of seq_ids[i], of which the first num_accepted[i] are kept (and are
                appended to its list, unless it shares the caller's list, whose owner has
                appended them; not checked here: `check_integrity` does).
            num_accepted: [num_seqs] integers in [1, k].

        Returns:
            The number of sequences that took tokens.

        Raises:
            ValueError: bad shapes or values, a repeated sequence, or a sequence with no decode
                step in flight (nothing is changed for any shape or value error).
        """
        return requests.append_decode_tokens(self._st, seq_ids, token_ids, num_accepted, self._scratch)

    def fork_seq(
        self, parent_id: str, num_branches: int, *, branch_lists: Iterable[TokenLog] | None = None
    ) -> tuple[BranchId, ...]:
        """Makes `num_branches` copies of a prefilled sequence that share its KV blocks and state
        slot (copy-on-write at their first decode step).

        Args:
            branch_lists: None (default) = each branch gets its own copy of the parent's tokens.
                Otherwise one `TokenLog` per branch, in order, each equal to the parent's tokens now
                and none of them the parent's: it becomes that branch's token history as with
                `add_seq(..., share_list=True)` (read in place, appended by the caller).

        Returns:
            The branches' ids, `BranchId("{parent_id}.{k}")` (spelled "_{parent_id}.{k}"), k counting
            forks of this parent from 1; once a branch is copied its id is its key "{parent_id}.{k}"
            (both ids are accepted everywhere).

        Raises:
            KeyError: unknown parent. ValueError: num_branches < 1, a parent that is not PROMPTED
                or RUNNING, has a decode step in flight or is itself an uncopied branch, or bad
                branch_lists.
        """
        lists = None if branch_lists is None else list(branch_lists)
        return fork_seq(self._st, self._st.lookup(parent_id), num_branches, lists)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV block and state snapshot (running sequences keep their blocks; new
        ones prefill from scratch until the cache fills again). Returns False when prefix caching is
        off (nothing to reset)."""
        if self._st.prefix is None:
            return False
        self._st.prefix.reset()
        return True

    # ---------------------------------------------------------------- queries

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache counters (all 0 with prefix caching off)."""
        prefix = self._st.prefix
        return PrefixCacheStats() if prefix is None else prefix.stats()

    def get_seq(self, seq_id: str) -> SeqView:
        """Snapshot of a live sequence. Raises KeyError for an unknown (or finished) id."""
        return requests.view(self._st, self._st.lookup(seq_id))

    def has_unfinished(self) -> bool:
        """True while any sequence is live or an ignored one is not reported yet."""
        return bool(self._st.seqs) or bool(self._st.pending_ignored)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for prefill (the one mid-prefill included)."""
        return len(self._st.waiting) + len(self._st.prefilling)

    @property
    def num_running(self) -> int:
        """Sequences decoding or about to (prompted included)."""
        return len(self._st.running_rows) + len(self._st.prompted)

    def check_integrity(self) -> None:
        """Checks every bookkeeping invariant (O(sequences + blocks)); for tests and idle time.

        Raises:
            RuntimeError: naming the first broken invariant.
        """
        check_integrity(self._st)

    # ---------------------------------------------------------------- the step

    def schedule(self) -> SchedulerOutput:
        """Decides and reserves this rank's next step (one vote round, two if prefill is chosen).

        Returns:
            The `SchedulerOutput`. Its arrays are its own (the scheduler keeps no reference), so
            a ZOS engine may hold a step's output past the next call.
        """
        st = self._st
        st.reset_step()
        ignored = tuple(st.pending_ignored)
        st.pending_ignored.clear()
        kind, prefill, decode = self._step()
        clone_states, clone_blocks, zero_states = st.emit_lists()
        return SchedulerOutput(
            kind=kind,
            prefill=prefill,
            decode=decode,
            clone_states=clone_states,
            clone_blocks=clone_blocks,
            zero_states=zero_states,
            **st.emit_prefix_lists(),
            ignored=ignored,
            preempted_seq_ids=tuple(st.preempted),
            recomputed_seq_ids=tuple(st.recomputed),
            num_decode_steps=st.num_decode_steps,
        )

    def _step(self) -> tuple[StepKind, tuple[PrefillChunk, ...], DecodeBatch | None]:
        st = self._st
        engine_type = st.config.engine_type
        has_running = engine_type is not EngineType.PROMPT and bool(len(st.running_rows) or st.prompted)
        wants = engine_type is not EngineType.COMPLETION and admission.wants_prefill(st, has_running)
        vote = cast_vote(self._group, wants, has_running, admission.snapshot_tail_pending(st))
        if vote.prefill_chosen(attempt_point(st.config, st.num_decode_steps)):
            chunks = admission.schedule_prefill(st) if wants else ()
            if confirm_prefill(self._group, bool(chunks)):
                return (StepKind.PREFILL if chunks else StepKind.EMPTY_PROMPT), chunks, None
        if vote.none_running:
            return StepKind.IDLE, (), None
        st.num_decode_steps += 1
        batch = schedule_decode(st, self._core, self._scratch, self._verify_policy)
        return (StepKind.DECODE if batch is not None else StepKind.EMPTY_DECODE), (), batch


def _host_tier(config: SchedulerConfig, blocks: HashedBlockPool | None,
               snapshots: HashedBlockPool | None) -> HostTier | None:
    if blocks is None and snapshots is None or not config.enable_prefix_caching:
        return None
    if blocks is None or snapshots is None or not is_hashed(blocks) or not is_hashed(snapshots):
        raise ValueError("the prefix cache's host tier needs host_blocks and host_snapshots, both "
                         "deepinfer.cache.BlockManagers")
    return HostTier(blocks, snapshots)
