"""AsyncLLMProcess, `deepinfer serve`'s default front: outputs and aborts across the process
boundary, a refused request, an engine that fails to start, an engine process killed while serving
(requests fail with a clear error, /health answers 503), SIGTERM (the requests held finish, later ones
are refused), and a shutdown that leaves no process."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import (
    assert_closing_a_stream_frees_its_blocks,
    assert_refused_requests_raise_from_the_first_iteration,
    start_uvicorn,
)

from deepinfer.engine import EngineArgs, SamplingParams
from deepinfer.engine.cli import main
from deepinfer.engine.frontends.async_front import EngineDead, EngineStopped
from deepinfer.engine.frontends.async_llm import AsyncLLM
from deepinfer.engine.frontends.async_process import AsyncLLMProcess, EngineStartFailed
from deepinfer.engine.frontends.engine_process import EngineLoop, StepReport, SubmitRequest, receive, send
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.serve import build_app


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def llm() -> AsyncLLMProcess:
    return AsyncLLMProcess(EngineArgs(seed=0), max_num_waiting=64)


def test_outputs_match_the_engine_in_a_thread(llm: AsyncLLMProcess) -> None:
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=1), SamplingParams(temperature=0, max_tokens=7),
              SamplingParams(temperature=1.0, seed=3, max_tokens=6, n=3)]

    async def run(front: AsyncLLM | AsyncLLMProcess) -> list[tuple[list, list]]:
        runs = []
        for p in params:
            cumulative = [out async for out in front.generate("def main(", p)]
            delta = [out async for out in front.generate("def main(", p, delta=True)]
            runs.append((cumulative, delta))
        return runs

    in_thread = AsyncLLM(LLMEngine(EngineArgs(seed=0)))
    expected = asyncio.run(run(in_thread))
    asyncio.run(in_thread.shutdown())
    for (cumulative, delta), (want, _) in zip(asyncio.run(run(llm)), expected):
        last = cumulative[-1]
        assert last.finished and delta[-1].finished and not any(o.finished for o in delta[:-1])
        assert last.outputs == want[-1].outputs and last.prompt_token_ids == want[-1].prompt_token_ids
        assert last.prompt == "def main("
        assert all(o.prompt_token_ids == last.prompt_token_ids for o in delta)     # every delta has its prompt
        for index, whole in enumerate(last.outputs):
            assert "".join(o.outputs[index].text for o in delta) == whole.text
            assert [t for o in delta for t in o.outputs[index].token_ids] == whole.token_ids


def test_closing_a_stream_aborts_it_and_frees_its_blocks(llm: AsyncLLMProcess) -> None:
    assert_closing_a_stream_frees_its_blocks(llm, llm.ready.load.num_free_kv_blocks)


def test_refused_requests_raise_from_the_first_iteration(llm: AsyncLLMProcess) -> None:
    assert_refused_requests_raise_from_the_first_iteration(llm)
    assert llm.is_running and llm.stats.num_waiting == 0


def test_clean_shutdown_leaves_no_process(llm: AsyncLLMProcess) -> None:
    pid = llm.pid
    asyncio.run(llm.shutdown())
    assert not llm.is_running and llm.failure is None
    assert _gone(pid) and all(child.pid != pid for child in multiprocessing.active_children())


def test_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    with pytest.raises(EngineStartFailed, match=str(tmp_path)):
        AsyncLLMProcess(EngineArgs(model=str(tmp_path)))
    assert not multiprocessing.active_children()


def test_a_killed_engine_process_fails_requests_and_health() -> None:
    llm = AsyncLLMProcess(EngineArgs(seed=0))
    url, server, thread = start_uvicorn(build_app(llm, served_model_name="tiny"))
    try:
        body = {"prompt": "class B:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:
                        os.kill(llm.pid, signal.SIGKILL)
        error = json.loads(events[-1])["error"]
        assert error["code"] == "engine_dead" and "exited with code -9" in error["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "engine failed"
        assert "the engine process exited with code -9" in health.json()["error"]
        again = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert again.status_code == 500 and again.json()["error"]["code"] == "engine_dead"
        with pytest.raises(EngineDead):
            asyncio.run(anext(llm.generate("x")))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert _gone(llm.pid)


def test_sigterm_to_the_engine_process_finishes_its_requests_and_refuses_new_ones() -> None:
    """As when a service manager signals every process of the server: the request in flight still
    runs to its end, a request arriving meanwhile is refused with a 503 saying why, then the engine
    exits, the front says it stopped (not failed) and takes no more requests."""
    llm = AsyncLLMProcess(EngineArgs(seed=0))
    url, server, thread = start_uvicorn(build_app(llm, served_model_name="tiny"))
    try:
        body = {"prompt": "def f(", "max_tokens": 40, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events: list[str] = []
        refused = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    os.kill(llm.pid, signal.SIGTERM)
                    deadline = time.monotonic() + 30
                    while llm.is_running:                  # the engine's next report says it is stopping
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 40
        assert refused is not None and refused.status_code == 503
        error = refused.json()["error"]
        assert error["code"] == "shutting_down" and "the engine process got SIGTERM" in error["message"]
        deadline = time.monotonic() + 30
        while not _gone(llm.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json() == {"status": "engine stopped"}
        assert llm.failure is None                          # a clean stop, not a failure
        with pytest.raises(EngineStopped, match="got SIGTERM"):
            asyncio.run(anext(llm.generate("x")))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive() and llm.failure is None


def test_the_engine_loop_refuses_requests_that_reach_it_after_sigterm() -> None:
    """The engine process's side, in this process: a request that was on its way when SIGTERM came
    is refused (`EngineStopped`); the one taken before runs to its end; the report says the engine
    is stopping, and the loop ends once the engine has no work."""
    engine = LLMEngine(EngineArgs(seed=0))
    inbox, front_out = multiprocessing.Pipe(duplex=False)
    front_in, outbox = multiprocessing.Pipe(duplex=False)
    loop = EngineLoop(engine, inbox, outbox)
    send(front_out, SubmitRequest("taken", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True)))
    loop.poll()
    loop.on_sigterm(signal.SIGTERM, None)
    send(front_out, SubmitRequest("late", [5, 6], SamplingParams(max_tokens=5)))
    loop.run()                                              # returns: no work left after SIGTERM
    reports = []
    while front_in.poll():
        reports.append(receive(front_in))
    assert all(isinstance(r, StepReport) and r.stopping for r in reports)
    refusals = [refusal for r in reports for refusal in r.refusals]
    assert [r.request_id for r in refusals] == ["late"] and isinstance(refusals[0].error, EngineStopped)
    assert "got SIGTERM" in str(refusals[0].error)
    finished = [out for r in reports for out in r.outputs if out.finished]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finished] == [("taken", "length")]
    num_tokens = sum(len(o.outputs[0].token_ids) for r in reports for o in r.outputs) + \
        sum(len(ids) for r in reports for ids in r.token_ids)
    assert num_tokens == 5 and not engine.has_unfinished_requests()


def test_sigterm_leaves_no_engine_process() -> None:
    """`deepinfer serve` (the engine process by default), idle, exits 0 on a SIGTERM to its whole process
    group (as a service manager sends it) and takes its engine along, saying it stopped cleanly."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "deepinfer.engine.cli", "serve", "--port", "0",
                              "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert child.stderr is not None
        line = ""
        deadline = time.monotonic() + 120
        while "engine process, pid" not in line:
            line = child.stderr.readline()
            assert line or child.poll() is None, "deepinfer serve exited before its engine was loaded"
            assert time.monotonic() < deadline
        engine_pid = int(line.rsplit("pid ", 1)[1].rstrip(")\n"))
        assert not _gone(engine_pid)
        time.sleep(1.0)                          # uvicorn up (port 0: nothing to poll)
        os.killpg(child.pid, signal.SIGTERM)
        assert child.wait(timeout=60) == 0
        assert _gone(engine_pid)
        rest = child.stderr.read()
        assert "deepinfer serve: stopped cleanly" in rest and "fail" not in rest and "Traceback" not in rest
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_engine_in_thread_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    assert "--engine-in-thread" in capsys.readouterr().out
    assert main(["serve", "--engine-in-thread", "--data-parallel-size", "2"]) == 2
    assert "--engine-in-thread: not with --data-parallel-size > 1" in capsys.readouterr().err
