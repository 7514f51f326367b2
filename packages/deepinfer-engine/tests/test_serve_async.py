"""AsyncLLM: delta and cumulative outputs agree, closing a stream aborts its request, the engine
thread sleeps when idle; and `deepinfer serve` itself: its flags, and SIGTERM draining a stream."""

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
from serve_helpers import (
    assert_closing_a_stream_frees_its_blocks,
    assert_refused_requests_raise_from_the_first_iteration,
)

from deepinfer.engine import EngineArgs, LLMEngine, SamplingParams
from deepinfer.engine.cli import main
from deepinfer.engine.core.kv_handoff import NullKVTransfer
from deepinfer.engine.frontends.async_llm import AsyncLLM, EngineQueueFull, EngineStopped
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


def test_sigterm_drains_the_stream_in_flight_then_exits() -> None:
    with socket.socket() as sock:           # a free port for the child (released just before it binds)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "deepinfer.engine.cli", "serve", "--port", str(port),
                              "--max-num-seqs", "4", "--log-level", "warning"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert child.poll() is None, child.stderr.read() if child.stderr else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
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
