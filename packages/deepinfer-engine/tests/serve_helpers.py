"""What the server tests share: serving an app on 127.0.0.1, and checks that hold for every front."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from deepinfer.engine import SamplingParams


def start_uvicorn(app: object, timeout_s: float = 30.0) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Serve `app` on a free port of 127.0.0.1 in a daemon thread (the socket is bound before uvicorn
    starts); returns (base URL, server, thread) once the server accepts requests."""
    sock = tcp_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def tcp_socket() -> socket.socket:
    """A TCP socket bound to a free port of 127.0.0.1. Its protocol is named (IPPROTO_TCP): asyncio sets
    TCP_NODELAY on accepted connections only then, and without it every response after a
    connection's first waits ~40 ms for the client's delayed ACK."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    return sock


def assert_closing_a_stream_frees_its_blocks(llm, free_at_start: int) -> None:
    """Close a long stream of `llm` (an AsyncLLM or AsyncLLMProcess) after two tokens: the request
    leaves the front, and its stats come back to nothing running or waiting and `free_at_start` free
    cache blocks."""

    async def run() -> int:
        stream = llm.generate("class A:", SamplingParams(max_tokens=4000, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await stream.aclose()
        for _ in range(500):
            if llm.stats.num_running == 0 and llm.stats.num_free_kv_blocks == free_at_start:
                break
            await asyncio.sleep(0.01)
        return llm.num_unfinished

    assert asyncio.run(run()) == 0
    assert (llm.stats.num_running, llm.stats.num_waiting, llm.stats.num_free_kv_blocks) == (0, 0, free_at_start)


def assert_refused_requests_raise_from_the_first_iteration(llm) -> None:
    """A request the engine refuses (a token id past the vocabulary, a reserved request id) raises
    ValueError from the first iteration of `llm.generate` (`AsyncLLM` or `AsyncLLMProcess`)."""
    async def first(prompt: object, request_id: str | None = None) -> None:
        async for _ in llm.generate(prompt, SamplingParams(max_tokens=1), request_id):
            pass

    with pytest.raises(ValueError, match="must be in"):
        asyncio.run(first([10**9]))
    with pytest.raises(ValueError, match="must not start with '_'"):
        asyncio.run(first("x", "_mine"))
