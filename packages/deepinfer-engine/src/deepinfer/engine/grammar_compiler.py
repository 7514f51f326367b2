"""GrammarCompilePool: compiles constraints off the step loop, caches them by key, queues completions.

docs/design.md §11: a constrained request waits outside the scheduler while its grammar compiles on a
thread pool owned by the engine; the completion callback (on the pool thread) only puts the result
in a thread-safe queue, and the engine pumps that queue once per step (`pre_sampler_sync`), where it
hands the request to the scheduler. One request's slow compile therefore never holds back a step.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .grammar_backend import GrammarBackend, GrammarCompileError
from .sampling_params import StructuredOutput


@dataclass(frozen=True, slots=True)
class GrammarCompiled:
    """A finished compile for one request, as handed from the pool to the engine."""

    request_id: str
    key: tuple[str, str]          # StructuredOutput.key
    compiled: object | None       # the backend's compiled grammar; None when error is set
    error: str | None             # why the compile failed (names the field), else None


class GrammarCompilePool:
    """Compiles on `max_workers` threads; one compile per distinct key, reused by later requests.

    Args:
        backend: the `GrammarBackend` that compiles and makes grammar states.
        max_workers: >= 1 compile threads.
        max_cached: >= 1 finished compiles kept (least recently used dropped first); failures are
            cached too, so a bad schema sent again fails at once. Compiles still running are
            never dropped.
    """

    def __init__(self, backend: GrammarBackend, *, max_workers: int = 2, max_cached: int = 256) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers} must be >= 1")
        if max_cached < 1:
            raise ValueError(f"max_cached={max_cached} must be >= 1")
        self.backend = backend
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="deepinfer-grammar")
        self._max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str], Future[object]] = OrderedDict()
        self._lock = threading.Lock()
        self._completed: queue.SimpleQueue[GrammarCompiled] = queue.SimpleQueue()
        self._ready: deque[GrammarCompiled] = deque()
        self.num_compiles = 0          # compiles started (cache misses)
        self.num_cache_hits = 0

    def submit(self, request_id: str, spec: StructuredOutput) -> None:
        """Start compiling `spec` for `request_id` (or reuse the cached / running compile of its key).

        The result arrives in `pop_completed`, even when the key was already compiled.
        """
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._executor.submit(self.backend.compile, spec)
                self._cache[key] = future
                self.num_compiles += 1
                self._evict()
            else:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
        future.add_done_callback(lambda done: self._completed.put(_result(request_id, key, done)))

    def pop_completed(self) -> list[GrammarCompiled]:
        """Every completion since the last call, oldest first (never blocks)."""
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
            return False
        return True

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        """Stop accepting compiles; running ones finish on their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _evict(self) -> None:
        excess = len(self._cache) - self._max_cached
        for key in [k for k, f in self._cache.items() if f.done()][:max(0, excess)]:
            del self._cache[key]


def _result(request_id: str, key: tuple[str, str], future: Future[object]) -> GrammarCompiled:
    if future.cancelled():
        return GrammarCompiled(request_id, key, None, "grammar compile was cancelled (engine shut down)")
    error = future.exception()
    if error is None:
        return GrammarCompiled(request_id, key, future.result(), None)
    reason = str(error) if isinstance(error, GrammarCompileError) else f"{type(error).__name__}: {error}"
    return GrammarCompiled(request_id, key, None, reason)
