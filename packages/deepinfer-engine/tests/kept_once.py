"""`KeptOnce`: watches an engine's scheduler calls and checks, after each one that reads or counts
the token history, that every live scheduler sequence reads its request's own `token_ids` list (the
same object: the history is kept once, issue #17) and that every list holds exactly the tokens the
scheduler has counted (`check_integrity`: a token appended twice or lost shows there)."""

from __future__ import annotations

from collections import Counter

from deepinfer.engine import LLMEngine

# After these calls every token the engine kept is in its list and counted by the scheduler. Not
# after append_tokens, finish_seq or abort_seq: the engine calls them row by row while later rows of
# the same step are taken (their tokens in the lists, the scheduler told by one call at the end).
CHECKED_AFTER = ("schedule", "append_decode_tokens", "fork_seq")
COUNTED = CHECKED_AFTER + ("append_tokens",)


class KeptOnce:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler     # (a scheduling fault replaces the engine's)
        self.calls: Counter[str] = Counter()
        self.num_recomputed = 0
        self.last_decode_ids: tuple[str, ...] | None = None
        self.max_kept = 0                 # the most tokens one row kept in one append_decode_tokens
        self.num_bulk_appends = 0         # append_decode_tokens calls with the last decode batch's own ids
        scheduler = engine.scheduler
        for name in COUNTED:
            setattr(scheduler, name, self._watched(name, getattr(scheduler, name)))

    def _watched(self, name, call):
        def watched(*args, **kwargs):
            result = call(*args, **kwargs)
            self.calls[name] += 1
            if name == "schedule":
                self.num_recomputed += len(result.recomputed_seq_ids)
                self.last_decode_ids = result.decode.seq_ids if result.decode is not None else None
            if name == "append_decode_tokens":
                self.max_kept = max(self.max_kept, int(args[2].max()) if len(args[2]) else 0)
                self.num_bulk_appends += args[0] is self.last_decode_ids
            if name in CHECKED_AFTER:
                self.check()
            return result
        return watched

    def check(self) -> None:
        engine = self.engine
        for key, seq in engine.scheduler._st.seqs.items():     # test-only peek at what the scheduler reads
            req = engine._seqs[key]
            assert seq.shared_list and seq.token_ids is req.token_ids, key
            assert req.detok is None or req.detok._ids is req.token_ids, key
        engine.scheduler.check_integrity()

    def close(self) -> None:
        for name in COUNTED:
            delattr(self.scheduler, name)
