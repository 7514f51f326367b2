"""SIGTERM with data-parallel ranks, as with one engine process: a SIGTERM to one rank drains every
rank (the request in flight finishes, a new one is refused with a 503 saying why, the ranks exit 0 and
the front has stopped, not failed); a SIGTERM to the whole `deepinfer serve --data-parallel-size 2`
process group drains the stream in flight and exits 0, taking the ranks along."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
from serve_helpers import start_uvicorn, tcp_socket

from deepinfer.engine import EngineArgs
from deepinfer.engine.parallel import DPAsyncLLM
from deepinfer.engine.serve import build_app

SMALL = {"device": "cpu", "num_kv_blocks": 32, "max_num_seqs": 4, "stop_preempted_request": False}
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


def test_sigterm_to_one_rank_drains_every_rank_and_refuses_new_requests() -> None:
    llm = DPAsyncLLM(EngineArgs(**SMALL, data_parallel_size=2, expert_parallel=True, distributed_timeout_s=TIMEOUT_S))
    url, server, thread = start_uvicorn(build_app(llm, served_model_name="tiny"))
    refused: list[httpx.Response] = []

    def signal_rank_1() -> None:
        os.kill(llm.pids[1], signal.SIGTERM)
        deadline = time.monotonic() + TIMEOUT_S
        while llm.is_running:                       # rank 1 tells the front within its next poll
            assert time.monotonic() < deadline, "the front never heard of the SIGTERM"
            time.sleep(0.01)
        refused.append(httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30))

    try:
        events = _stream_with(url, 30, signal_rank_1)
        _assert_ran_to_the_end(events, 30)
        error = refused[0].json()["error"]
        assert refused[0].status_code == 503 and error["code"] == "shutting_down"
        assert "DP rank 1 got SIGTERM" in error["message"]
        deadline = time.monotonic() + TIMEOUT_S
        while not all(_gone(pid) for pid in llm.pids):
            assert time.monotonic() < deadline, "the ranks did not exit"
            time.sleep(0.05)
        assert [proc.exitcode for proc in llm._procs] == [0, 0]
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "engine stopped"}
        assert llm.failure is None
    finally:
        server.should_exit = True
        thread.join(timeout=TIMEOUT_S + 10)
    assert not thread.is_alive() and llm.failure is None


def test_sigterm_to_the_dp_server_drains_the_stream_and_exits_cleanly() -> None:
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
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.05)
        events = _stream_with(url, 24, lambda: os.killpg(child.pid, signal.SIGTERM))   # as a service manager
        _assert_ran_to_the_end(events, 24)
        assert child.wait(timeout=60) == 0
        assert all(_gone(pid) for pid in rank_pids)
        rest = child.stderr.read()
        assert "deepinfer serve: stopped cleanly" in rest and "Traceback" not in rest, rest
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
