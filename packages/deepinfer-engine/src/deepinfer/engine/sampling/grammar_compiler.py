"""GrammarCompilePool: compiles constraints off the step loop, caches them by key, queues completions.

docs/design.md §11: a constrained request waits outside the scheduler while its grammar compiles on a
thread owned by the pool; the compiling thread only puts the result in a thread-safe queue, and the
engine pumps that queue once per step (`pre_sampler_sync`), where it hands the request to the
scheduler. One request's slow compile therefore never holds back a step.

Hostile grammars (a schema whose pattern repeats 45,000 times compiles for minutes) are bounded:

- every request gets its answer within `timeout_s` of `submit`: past it, the request fails with an
  error saying so, and a key that had compiled for half that long by then is remembered as failed
  (sent again, it fails at once);
- a compile takes one of `max_workers` slots only while it is young (`slow_after_s`) and
  someone waits for it, so simple grammars do not queue behind slow ones; at most `max_threads`
  compiles run at once;
- `cancel` (the request was aborted: its client left) drops a compile nobody else waits for: one
  not started never runs, a running one gives up its slot.

xgrammar's compile cannot be interrupted: a compile that timed out or was cancelled runs on to its
end on its thread, its result dropped (it still counts towards `max_threads`). The threads are
daemons, so a process that exits does not wait for them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .grammar_backend import GrammarBackend, GrammarCompileError
from .sampling_params import StructuredOutput

GRAMMAR_COMPILE_TIMEOUT_S = 30.0   # a request's grammar compiles within this (queueing included), or it fails
SLOW_COMPILE_S = 1.0               # a compile running longer gives up its worker slot (it keeps its thread)


@dataclass(frozen=True, slots=True)
class GrammarCompiled:
    """A finished compile for one request, as handed from the pool to the engine."""

    request_id: str
    key: tuple[str, str]          # StructuredOutput.key
    compiled: object | None       # the backend's compiled grammar; None when error is set
    error: str | None             # why the compile failed (names the field), else None


@dataclass(eq=False, slots=True)
class _Compile:
    """One key's compile: queued (started None), running, or done; the requests waiting for it."""

    key: tuple[str, str]
    spec: StructuredOutput
    waiters: dict[str, float] = field(default_factory=dict)    # request id -> its submit time (monotonic)
    started: float | None = None
    done: bool = False
    compiled: object | None = None
    error: str | None = None


class GrammarCompilePool:
    """Compiles on up to `max_threads` daemon threads; one compile per distinct key, reused by later requests.

    Args:
        backend: the `GrammarBackend` that compiles and makes grammar states.
        max_workers: >= 1 compiles that run at once while young (see the module docstring).
        max_cached: >= 1 finished compiles kept (least recently used dropped first); failures are
            cached too, so a bad schema sent again fails at once. Compiles still running are
            never dropped.
        timeout_s: > 0 seconds from `submit` within which a request gets its compiled grammar or
            fails (GRAMMAR_COMPILE_TIMEOUT_S by default).
        max_threads: >= max_workers compiles running at once, slow and cancelled ones included.
        slow_after_s: > 0 seconds after which a running compile gives up its worker slot.
    """

    def __init__(self, backend: GrammarBackend, *, max_workers: int = 2, max_cached: int = 256,
                 timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S, max_threads: int = 8,
                 slow_after_s: float = SLOW_COMPILE_S) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers} must be >= 1")
        if max_cached < 1:
            raise ValueError(f"max_cached={max_cached} must be >= 1")
        if not timeout_s > 0 or not slow_after_s > 0:
            raise ValueError(f"timeout_s={timeout_s} and slow_after_s={slow_after_s} must be > 0")
        if max_threads < max_workers:
            raise ValueError(f"max_threads={max_threads} must be >= max_workers={max_workers}")
        self.backend = backend
        self.timeout_s, self._slow_after_s = timeout_s, slow_after_s
        self._max_workers, self._max_threads, self._max_cached = max_workers, max_threads, max_cached
        self._cache: OrderedDict[tuple[str, str], _Compile] = OrderedDict()
        self._queued: deque[_Compile] = deque()
        self._running: set[_Compile] = set()
        self._waiting: dict[str, _Compile] = {}        # request id -> the compile it waits for
        self._lock = threading.Lock()
        self._closed = False
        self._completed: queue.SimpleQueue[GrammarCompiled] = queue.SimpleQueue()
        self._ready: deque[GrammarCompiled] = deque()
        self.num_compiles = 0          # compiles started (cache misses)
        self.num_cache_hits = 0

    def submit(self, request_id: str, spec: StructuredOutput) -> None:
        """Start compiling `spec` for `request_id` (or reuse the cached / running compile of its key).

        The result arrives in `pop_completed`, even when the key was already compiled.
        """
        key, now = spec.key, time.monotonic()
        with self._lock:
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                if job.done:
                    self._completed.put(GrammarCompiled(request_id, key, job.compiled, job.error))
                    return
            else:
                job = self._cache[key] = _Compile(key, spec)
                self._queued.append(job)
                self.num_compiles += 1
                self._evict()
            job.waiters[request_id] = now
            self._waiting[request_id] = job
            self._start_compiles(now)

    def cancel(self, request_id: str) -> None:
        """`request_id` no longer waits (it was aborted); its compile is dropped when nobody else
        waits for it: never started if still queued, its slot given up if running. Unknown or
        answered ids are ignored."""
        with self._lock:
            job = self._waiting.pop(request_id, None)
            if job is None:
                return
            job.waiters.pop(request_id, None)
            if not job.waiters and job.started is None:
                self._queued.remove(job)
                self._cache.pop(job.key, None)
            self._start_compiles(time.monotonic())

    def pop_completed(self) -> list[GrammarCompiled]:
        """Every completion since the last call, oldest first, and a failure for each request that
        has waited past timeout_s (never blocks)."""
        self._expire()
        out = list(self._ready)
        self._ready.clear()
        while True:
            try:
                out.append(self._completed.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until a completion is queued; True if one is."""
        if self._ready:
            return True
        try:
            self._ready.append(self._completed.get(timeout=timeout))
        except queue.Empty:
            self._expire()
            return not self._completed.empty()
        return True

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not answered yet."""
        with self._lock:
            return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Compiles running on a thread now (slow and cancelled ones included)."""
        with self._lock:
            return len(self._running)

    def shutdown(self) -> None:
        """Start no more compiles; running ones finish on their (daemon) threads, results dropped."""
        with self._lock:
            self._closed = True
            self._queued.clear()

    # ------------------------------------------------------------------ under the lock

    def _start_compiles(self, now: float) -> None:
        """Start queued compiles while a worker slot and a thread are free (lock held)."""
        while self._queued and not self._closed and len(self._running) < self._max_threads:
            busy = sum(1 for job in self._running
                       if job.waiters and job.started is not None and now - job.started < self._slow_after_s)
            if busy >= self._max_workers:
                return
            job = self._queued.popleft()
            job.started = now
            self._running.add(job)
            threading.Thread(target=self._compile, args=(job,), name="deepinfer-grammar", daemon=True).start()

    def _expire(self) -> None:
        """Fail every request that has waited past timeout_s; a key that compiled that long is
        remembered as failed; give freed slots to queued compiles."""
        now = time.monotonic()
        with self._lock:
            late = [(rid, job) for rid, job in self._waiting.items() if now - job.waiters[rid] > self.timeout_s]
            for request_id, job in late:
                del self._waiting[request_id], job.waiters[request_id]
                reason = (f"invalid structured.{job.key[0]}: the grammar did not compile within {self.timeout_s:g} s "
                          "(too complex: e.g. a large repetition count)")
                self._completed.put(GrammarCompiled(request_id, job.key, None, reason))
                if job.waiters:
                    continue
                if job.started is None:               # never ran (the threads were busy): forget it
                    self._queued.remove(job)
                    self._cache.pop(job.key, None)
                elif now - job.started >= self.timeout_s / 2 and self._cache.get(job.key) is job:
                    self._cache[job.key] = _Compile(job.key, job.spec, done=True, error=reason)
            self._start_compiles(now)

    def _evict(self) -> None:
        excess = len(self._cache) - self._max_cached
        for key in [k for k, job in self._cache.items() if job.done][:max(0, excess)]:
            del self._cache[key]

    # ------------------------------------------------------------------ compile threads

    def _compile(self, job: _Compile) -> None:
        compiled, error = None, None
        try:
            compiled = self.backend.compile(job.spec)
        except GrammarCompileError as err:
            error = str(err)
        except Exception as err:          # a backend bug: the request fails, naming it
            error = f"{type(err).__name__}: {err}"
        with self._lock:
            job.compiled, job.error, job.done = compiled, error, True
            self._running.discard(job)
            for request_id in job.waiters:
                self._waiting.pop(request_id, None)
                self._completed.put(GrammarCompiled(request_id, job.key, compiled, error))
            job.waiters.clear()
            self._start_compiles(time.monotonic())


__all__ = ["GRAMMAR_COMPILE_TIMEOUT_S", "SLOW_COMPILE_S", "GrammarCompilePool", "GrammarCompiled"]
