"""SIGTERM with data-parallel ranks, as with one engine process, on `deepinfer serve
--data-parallel-size 2`: a SIGTERM to one rank drains every rank (the request in flight goes on, a new
one is refused with a 503 saying why); a SIGTERM to the whole process group then lets the stream
finish, and the server exits 0 saying it stopped cleanly (no rank failed), taking the ranks along."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
from serve_helpers import tcp_socket

TIMEOUT_S = 20


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _stream_with(url: str, max_tokens: int, on_first_event) -> list[str]:
    """Stream one completion of `max_tokens` tokens; `on_first_event()` runs once the first event came.
    The events' data, in order."""
    body = {"prompt": "def f(", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    on_first_event()
    return events


def _assert_ran_to_the_end(events: list[str], max_tokens: int) -> None:
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == max_tokens


def test_sigterm_to_a_rank_then_to_the_server_drains_and_exits_cleanly() -> None:
    sock = tcp_socket()                       # a free port for the child (released just before it binds)
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "deepinfer.engine.cli", "serve", "--port", str(port),
                              "--data-parallel-size", "2", "--expert-parallel", "--max-num-seqs", "4",
                              "--num-kv-blocks", "32", "--log-level", "warning"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stderr is not None
        line = ""
        deadline = time.monotonic() + 120
        while "DP ranks" not in line:
            line = child.stderr.readline()
            assert line or child.poll() is None, "deepinfer serve exited before its ranks started"
            assert time.monotonic() < deadline
        rank_pids = [int(pid) for pid in line.split("(pids ", 1)[1].split(")", 1)[0].split(", ")]
        url = f"http://127.0.0.1:{port}"
        while not _health_is(url, 200):
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.05)
        refused: list[httpx.Response] = []

        def signal_rank_1_then_the_server() -> None:
            os.kill(rank_pids[1], signal.SIGTERM)
            stop_by = time.monotonic() + TIMEOUT_S
            while not _health_is(url, 503):            # rank 1 told the front: it takes no new requests
                assert time.monotonic() < stop_by, "the front never heard of the SIGTERM"
                time.sleep(0.01)
            refused.append(httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30))
            os.killpg(child.pid, signal.SIGTERM)        # then, as a service manager, the whole server

        events = _stream_with(url, 40, signal_rank_1_then_the_server)
        _assert_ran_to_the_end(events, 40)
        error = refused[0].json()["error"]
        assert refused[0].status_code == 503 and error["code"] == "shutting_down"
        assert "DP rank 1 got SIGTERM" in error["message"]
        assert child.wait(timeout=60) == 0
        assert all(_gone(pid) for pid in rank_pids)
        rest = child.stderr.read()
        assert "deepinfer serve: stopped cleanly" in rest and "Traceback" not in rest, rest
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def _health_is(url: str, status: int) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == status
    except httpx.TransportError:
        return False
