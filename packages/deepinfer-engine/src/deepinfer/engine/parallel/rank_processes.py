"""The rank processes of `dp_async.DPAsyncLLM`: watched, waited for and reaped from two threads (the
front's reader and its `shutdown`), one waitpid at a time: a second waitpid racing the first finds
the child reaped and reads its exit code as None (the race `async_process` had)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import wait as wait_ready
from multiprocessing.process import BaseProcess


class RankProcesses:
    """Started rank processes, by rank.

    Args:
        procs: one started process per rank, in rank order.
    """

    def __init__(self, procs: Sequence[BaseProcess]) -> None:
        self.procs = tuple(procs)
        self._lock = threading.Lock()

    def exited(self, *, clean_exit_expected: bool) -> str:
        """'DP rank R exited with code C; ...' for the ranks that exited ('' for none); with
        clean_exit_expected (after `Stop`), exit code 0 is not named."""
        with self._lock:
            return "; ".join(f"DP rank {rank} exited with code {proc.exitcode}" for rank, proc in enumerate(self.procs)
                             if not proc.is_alive() and not (clean_exit_expected and proc.exitcode == 0))

    def any_alive(self) -> bool:
        """Whether some rank process still runs."""
        with self._lock:
            return any(proc.is_alive() for proc in self.procs)

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for every rank to exit (on their sentinels: the reader thread reaps
        them meanwhile), then kill what is left."""
        deadline = time.monotonic() + timeout_s
        pending = [proc.sentinel for proc in self.procs]
        while pending and (left := deadline - time.monotonic()) > 0:
            ready = wait_ready(pending, left)
            pending = [sentinel for sentinel in pending if sentinel not in ready]
        self.kill()

    def kill(self) -> None:
        """Kill every rank still alive and reap them all. SIGKILL: a rank takes SIGTERM as a request
        to drain (`serve_rank`)."""
        with self._lock:
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()


__all__ = ["RankProcesses"]
