"""Load on localhost, bounded in count and time: 200 concurrent streams all complete, well formed,
none lost or mixed up, and leave nothing behind (no request registered, every KV block free, no
thread kept beyond the tokenizer's worker pool); 50 streams dropped mid-way (and a dropped
non-streamed request) are aborted and give their KV blocks back."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from serve_helpers import start_uvicorn

from deepinfer.engine import EngineArgs
from deepinfer.engine.frontends.async_process import AsyncLLMProcess
from deepinfer.engine.serve import build_app

NUM_STREAMS = 200
NUM_DROPPED = 50


@dataclass
class Served:
    base_url: str
    llm: AsyncLLMProcess
    server: uvicorn.Server
    thread: threading.Thread


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    llm = AsyncLLMProcess(EngineArgs(seed=0, stop_preempted_request=False))      # serve's default front
    url, server, thread = start_uvicorn(build_app(llm, served_model_name="tiny"))
    yield Served(url, llm, server, thread)
    server.should_exit = True
    thread.join(timeout=30)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _events(body: str) -> list[str]:
    """The data of each server-sent event; asserts the framing (`data: ...` + blank line, nothing else)."""
    assert body.endswith("\n\n"), body[-80:]
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events[:3]
    return [e.removeprefix("data: ") for e in events]


def _check_stream(body: str, max_tokens: int) -> tuple[str, dict[str, int]]:
    """Asserts a well-formed completion stream; returns (response id, usage)."""
    events = _events(body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    *choice_chunks, usage_chunk = chunks
    reasons = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == max_tokens
    assert 1 <= len(choice_chunks) <= max_tokens
    return ids.pop(), usage_chunk["usage"]


def _num_threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("Threads:")).split()[1])


def test_200_concurrent_streams_complete_well_formed_none_lost_nothing_left(served: Served) -> None:
    llm = served.llm
    tokenizer = llm.model.tokenizer
    free_at_start = llm.stats.num_free_kv_blocks
    threads_at_start = {pid: _num_threads(pid) for pid in (os.getpid(), llm.pid)}
    prompts = [f"def f{i}(" + "x, " * (i % 11) for i in range(NUM_STREAMS)]
    max_tokens = [1 + i % 5 for i in range(NUM_STREAMS)]

    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, dict[str, int]]:
        body = {"prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
            return _check_stream((await reply.aread()).decode(), max_tokens[i])

    async def run() -> list[tuple[str, dict[str, int]]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(base_url=served.base_url, limits=limits, timeout=60) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(NUM_STREAMS))), 45)

    started = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - started < 45
    assert len({rid for rid, _ in results}) == NUM_STREAMS            # no stream answered twice
    for i, (_, usage) in enumerate(results):                          # each got its own request's answer
        assert usage["prompt_tokens"] == len(tokenizer.encode(prompts[i]))
        assert usage["completion_tokens"] == max_tokens[i]
    deadline = time.monotonic() + 10           # the engine's report after the last step may still be on its way
    while llm.stats.num_free_kv_blocks != free_at_start:
        assert time.monotonic() < deadline, "KV blocks still held after every stream ended"
        time.sleep(0.01)
    assert (llm.num_unfinished, llm.stats.num_running, llm.stats.num_waiting) == (0, 0, 0)
    assert not llm._prompts and llm._num_unfinished == 0         # the reader's bookkeeping too
    # The engine process starts no thread per request; this one may have grown asyncio's default
    # executor (the tokenizer's worker threads, idle ones kept) up to its bound, and no further.
    assert _num_threads(llm.pid) == threads_at_start[llm.pid]
    assert _num_threads(os.getpid()) <= threads_at_start[os.getpid()] + min(32, (os.cpu_count() or 1) + 4)


def test_dropped_streams_are_aborted_and_free_their_blocks(served: Served) -> None:
    url = served.base_url
    before = httpx.get(f"{url}/metrics").text
    free_at_start = _metric(before, "deepinfer_kv_cache_free_blocks")
    aborts_before = _metric(before, 'deepinfer_request_success_total{finished_reason="abort"}') \
        if 'finished_reason="abort"' in before else 0.0

    async def drop(http: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"class C{i}:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            num_events = 0
            async for line in reply.aiter_lines():
                num_events += line.startswith("data: ")
                if num_events == 3:
                    return num_events                 # leaving the block closes the connection mid-stream
        return num_events

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=NUM_DROPPED, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
            return await asyncio.wait_for(asyncio.gather(*(drop(http, i) for i in range(NUM_DROPPED))), 30)

    assert asyncio.run(run()) == [3] * NUM_DROPPED
    deadline = time.monotonic() + 15            # 2000 tokens each would take minutes: only aborts end them this fast
    while True:
        text = httpx.get(f"{url}/metrics").text
        settled = (_metric(text, "deepinfer_num_requests_running"), _metric(text, "deepinfer_num_requests_waiting"),
                   _metric(text, "deepinfer_kv_cache_free_blocks"))
        if settled == (0, 0, free_at_start) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert settled == (0, 0, free_at_start)
    assert _metric(text, 'deepinfer_request_success_total{finished_reason="abort"}') == aborts_before + NUM_DROPPED
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_dropped_whole_request_is_aborted(served: Served) -> None:
    url = served.base_url
    before = httpx.get(f"{url}/metrics").text
    free_at_start = _metric(before, "deepinfer_kv_cache_free_blocks")
    aborts_before = _metric(before, 'deepinfer_request_success_total{finished_reason="abort"}') \
        if 'finished_reason="abort"' in before else 0.0
    with pytest.raises(httpx.ReadTimeout):         # the client gives up and closes the connection
        httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2000, "ignore_eos": True}, timeout=1.0)
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{url}/metrics").text
        done = _metric(text, 'deepinfer_request_success_total{finished_reason="abort"}') == aborts_before + 1
        if done and _metric(text, "deepinfer_kv_cache_free_blocks") == free_at_start or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert done and _metric(text, "deepinfer_num_requests_running") == 0
    assert _metric(text, "deepinfer_kv_cache_free_blocks") == free_at_start
