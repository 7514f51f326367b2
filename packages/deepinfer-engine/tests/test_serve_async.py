"""AsyncLLM: delta and cumulative outputs agree, closing a stream aborts its request, the engine
thread sleeps when idle; and `deepinfer serve` itself: its flags, SIGTERM draining a stream, and the
drain's bound (--shutdown-timeout-s) cutting a stream nobody reads and a request still running."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from serve_helpers import (
    assert_closing_a_stream_frees_its_blocks,
    assert_refused_requests_raise_from_the_first_iteration,
    tcp_socket,
)

from deepinfer.engine import EngineArgs, LLMEngine, SamplingParams
from deepinfer.engine.cli import main
from deepinfer.engine.core.kv_handoff import NullKVTransfer
from deepinfer.engine.frontends.async_llm import AsyncLLM, EngineQueueFull, EngineStopped
from deepinfer.engine.serve import build_app
from deepinfer.engine.serve.server import uvicorn_config
from deepinfer.sched import PrefixCacheStats


@pytest.fixture(scope="module")
def llm() -> AsyncLLM:
    return AsyncLLM(LLMEngine(EngineArgs(seed=0)), max_num_waiting=64)


def test_delta_outputs_add_up_to_the_cumulative_ones(llm: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=1)

    async def run() -> tuple[list, list]:
        cumulative = [out async for out in llm.generate("def main(", params)]
        delta = [out async for out in llm.generate("def main(", params, delta=True)]
        return cumulative, delta

    cumulative, delta = asyncio.run(run())
    whole = cumulative[-1].outputs[0]
    assert cumulative[-1].finished and delta[-1].finished and not any(o.finished for o in delta[:-1])
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == whole.token_ids
    assert [lp for o in delta for lp in o.outputs[0].logprobs] == whole.logprobs
    assert delta[-1].outputs[0].finish_reason == "length" and len(whole.token_ids) == 10


def test_closing_a_stream_aborts_it_and_frees_its_blocks(llm: AsyncLLM) -> None:
    assert_closing_a_stream_frees_its_blocks(llm, llm.engine.kv_blocks.num_free)


def test_refused_requests_raise_from_the_first_iteration(llm: AsyncLLM) -> None:
    assert_refused_requests_raise_from_the_first_iteration(llm)


class _CountingEngine:
    """Counts how often the engine thread looks for work."""

    def __init__(self) -> None:
        self.num_polls = 0
        self.scheduler = type("S", (), {"num_running": 0, "prefix_cache_stats": PrefixCacheStats()})()
        self.kv_blocks = type("K", (), {"num_free": 1, "num_blocks": 2})()
        self.kv_transfer = NullKVTransfer()

    def has_unfinished_requests(self) -> bool:
        self.num_polls += 1
        return False


def test_the_idle_engine_thread_sleeps_and_shutdown_refuses_new_requests() -> None:
    engine = _CountingEngine()
    idle = AsyncLLM(engine, max_num_waiting=1)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while engine.num_polls == 0:                        # the thread's first look for work (slow on a busy machine)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    assert engine.num_polls == 1                        # then asleep on its event, not spinning
    asyncio.run(idle.shutdown())
    assert not idle.is_running

    async def late() -> None:
        async for _ in idle.generate("x"):
            pass

    with pytest.raises(EngineStopped):
        asyncio.run(late())
    assert issubclass(EngineQueueFull, RuntimeError)


def test_serve_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--chat-template", "--max-num-waiting",
                 "--model", "--max-num-seqs", "--dtype"):
        assert flag in text
    assert main(["serve", "--port", "70000"]) == 2
    assert "port=70000 must be an int in [0, 65535]" in capsys.readouterr().err
    assert main(["serve", "--max-num-seqs", "0"]) == 2


def _start_serve(*flags: str) -> tuple[subprocess.Popen, int]:
    """`deepinfer serve` on the embedded model and a free port, once /health answers; (process, port)."""
    with socket.socket() as sock:           # a free port for the child (released just before it binds)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "deepinfer.engine.cli", "serve", "--port", str(port),
                              "--max-num-seqs", "4", "--log-level", "warning", *flags], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return child, port
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


def test_sigterm_drains_the_stream_in_flight_then_exits() -> None:
    child, port = _start_serve()
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"prompt": "def f(", "max_tokens": 24, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "model": "deepinfer-embedded"}
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 1:
                        threading.Thread(target=child.send_signal, args=(signal.SIGTERM,)).start()
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 24       # it ran to the end
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_sigterm_cuts_a_stream_nobody_reads_after_the_shutdown_timeout() -> None:
    """A client that opens a long stream and stops reading holds a drain until its generation ends (tens
    of seconds here; and, beyond what the socket buffers take, until it reads); with
    --shutdown-timeout-s 1 the server cuts it and exits 0, saying so."""
    child, port = _start_serve("--shutdown-timeout-s", "1")
    try:
        with socket.create_connection(("127.0.0.1", port)) as client:
            # 4,000 tokens: a CPU engine decodes them for tens of seconds (each step attends to more).
            body = json.dumps({"prompt": "def f(", "max_tokens": 4000, "ignore_eos": True, "stream": True,
                               "model": "deepinfer-embedded"}).encode()
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert client.recv(15) == b"HTTP/1.1 200 OK"           # the stream is open; never read again
            signalled = time.monotonic()
            child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=30) == 0
            # The margin covers the engine's stop and the interpreter's exit on a busy machine; without
            # the bound the drain would last until the 4,000 tokens are generated.
            assert time.monotonic() - signalled < 1 + 10, "the drain was not cut at --shutdown-timeout-s"
        err = " ".join(child.stderr.read().split()) if child.stderr else ""
        assert "deepinfer serve: stopped after --shutdown-timeout-s 1: cut 1 request(s) still running" in err, err
        assert "Traceback" not in err, err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


class _StuckClient:
    """An EngineClient whose requests never produce an output; records how it was shut down."""

    is_running, failure = True, None
    model = type("M", (), {"max_model_len": 64, "tokenizer": None})()

    def __init__(self) -> None:
        self.drained: list[bool] = []

    async def generate(self, prompt, params=None, request_id=None, *, delta=False):
        await asyncio.Event().wait()
        yield

    def parallel_stats(self) -> None:
        return None

    async def shutdown(self, *, drain: bool = True) -> None:
        self.drained.append(drain)


@pytest.mark.parametrize("stuck", [True, False])
def test_a_request_cut_before_its_response_gets_a_503_and_no_drain(stuck: bool) -> None:
    """In process, uvicorn as `deepinfer serve` runs it: a request still waiting for its first output
    when the shutdown timeout ends gets a 503 `shutting_down`, and the engine is shut down without
    draining; with no request in flight, the shutdown drains as before."""
    llm = _StuckClient()
    app = build_app(llm, served_model_name="m")
    sock = tcp_socket()
    server = uvicorn.Server(uvicorn_config(app, log_level="critical", shutdown_timeout_s=0.5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    answers: list[httpx.Response] = []
    if stuck:
        asker = threading.Thread(target=lambda: answers.append(httpx.post(url, json={"prompt": [1, 2]}, timeout=30)))
        asker.start()
        while app.state.server.requests.num_open == 0:
            time.sleep(0.01)
    server.should_exit = True                     # what uvicorn's SIGTERM handler does
    thread.join(timeout=10)
    assert not thread.is_alive()
    if stuck:
        asker.join(timeout=10)
        assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "shutting_down"
    assert llm.drained == [not stuck] and app.state.server.requests.num_cut == int(stuck)
