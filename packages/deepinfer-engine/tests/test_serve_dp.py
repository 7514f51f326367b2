"""`deepinfer serve --data-parallel-size 2 --expert-parallel` in-process: one DP server (2 gloo rank
processes, the embedded model, EPLB re-placing experts every 3 steps) shared by every test, queried
with the real `openai` client. Greedy text, streamed and whole, equals one process's; concurrent
requests go to both ranks; a disconnect aborts on its rank; idle ranks sleep; per-rank and EPLB
metrics; a killed rank makes the server report it (last: it ends the server)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from serve_helpers import start_uvicorn

from deepinfer.engine import LLM, EngineArgs, SamplingParams
from deepinfer.engine.cli import main
from deepinfer.engine.parallel import DPAsyncLLM
from deepinfer.engine.serve import build_app

MODEL = "tiny"
PROMPTS = ["def add(a, b):", "import os", "class Stack:", "for i in range(10):"]
SMALL = {"device": "cpu", "num_kv_blocks": 32, "max_num_seqs": 4, "stop_preempted_request": False}
MAX_TOKENS = 6
TIMEOUT_S = 20


@dataclass
class Served:
    base_url: str
    llm: DPAsyncLLM
    server: uvicorn.Server
    thread: threading.Thread


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    outputs = LLM(**SMALL).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    return {prompt: out.outputs[0].text for prompt, out in zip(PROMPTS, outputs)}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    llm = DPAsyncLLM(EngineArgs(**SMALL, data_parallel_size=2, expert_parallel=True, eplb="decode",
                                eplb_redundant_experts_per_rank=1, eplb_window_steps=3, eplb_interval_steps=3,
                                distributed_timeout_s=TIMEOUT_S))
    url, server, thread = start_uvicorn(build_app(llm, served_model_name=MODEL))
    yield Served(url, llm, server, thread)
    server.should_exit = True
    thread.join(timeout=TIMEOUT_S + 10)
    assert not any(proc.is_alive() for proc in llm._procs)


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(served: Served) -> dict[str, float]:
    """/metrics as {'name{labels}': value} for the deepinfer_ samples."""
    text = httpx.get(f"{served.base_url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("deepinfer_")}


def _wait_idle(served: Served) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while served.llm.stats.num_running or served.llm.num_unfinished or served.llm._owner:
        assert time.monotonic() < deadline, "the ranks did not go idle"
        time.sleep(0.02)


def test_streamed_and_whole_completions_equal_one_process(client: openai.OpenAI, expected: dict[str, str]) -> None:
    for prompt in PROMPTS[:2]:
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert whole.choices[0].text == expected[prompt] and whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == MAX_TOKENS
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == expected[prompt]
        assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match=r"prompt_token_ids contain \[1000000000\]"):
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)     # refused by its rank's engine


def test_concurrent_requests_land_on_both_ranks(served: Served, client: openai.OpenAI,
                                                expected: dict[str, str]) -> None:
    before = served.llm.parallel_stats().num_requests

    def complete(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(complete, PROMPTS)) == [expected[p] for p in PROMPTS]
    after = served.llm.parallel_stats().num_requests
    assert sum(after) - sum(before) == len(PROMPTS)
    assert all(a > b for a, b in zip(after, before))           # each rank got some of them
    metrics = _metrics(served)
    assert [metrics[f'deepinfer_dp_rank_requests_total{{rank="{rank}"}}'] for rank in (0, 1)] == list(after)


def test_client_disconnect_aborts_its_request_on_its_rank(served: Served) -> None:
    _wait_idle(served)
    aborted = _metrics(served).get('deepinfer_request_success_total{finished_reason="abort"}', 0.0)
    body = {"model": MODEL, "prompt": "class A:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as reply:
        for number, _ in enumerate(reply.iter_lines()):
            if number == 4:
                assert served.llm.stats.num_running == 1
                break
    _wait_idle(served)                 # its rank aborted it: nothing runs, every block is free again
    stats = served.llm.parallel_stats().rank_stats
    assert [(s.num_running, s.num_free_kv_blocks) for s in stats] == [(0, s.num_kv_blocks) for s in stats]
    assert _metrics(served)['deepinfer_request_success_total{finished_reason="abort"}'] == aborted + 1


def test_idle_ranks_block_instead_of_polling(served: Served) -> None:
    _wait_idle(served)

    def cpu_ticks() -> int:
        total = 0
        for pid in served.llm.pids:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])      # utime + stime
        return total

    start = cpu_ticks()
    time.sleep(1.0)
    # clock ticks (1/100 s) over 1 s, both ranks together: a spinning or tightly polling rank takes tens
    # to a hundred; blocked ranks take 0-3 (a garbage collection or a gloo keep-alive may land here)
    assert cpu_ticks() - start <= 5


def test_metrics_per_rank_sums_and_expert_load(served: Served) -> None:
    metrics = _metrics(served)
    for name in ("num_requests_running", "num_requests_waiting"):
        per_rank = [metrics[f'deepinfer_dp_rank_{name}{{rank="{rank}"}}'] for rank in (0, 1)]
        assert metrics[f"deepinfer_{name}"] == sum(per_rank)
    rebalances = served.llm.parallel_stats().rebalances
    assert rebalances and metrics["deepinfer_eplb_rebalances_total"] == len(rebalances)
    last = rebalances[-1]
    for layer, before, after in zip(last.layer_ids, last.max_mean_before, last.max_mean_after):
        assert metrics[f'deepinfer_eplb_layer_max_mean_load{{layer="{layer}",placement="before"}}'] == before
        assert metrics[f'deepinfer_eplb_layer_max_mean_load{{layer="{layer}",placement="after"}}'] == after


def test_serve_takes_data_parallel_while_generate_refuses_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--data-parallel-size", "2", "--expert-parallel", "--port", "70000"]) == 2
    assert "port=70000" in capsys.readouterr().err                  # past the DP check, stopped at the port
    assert main(["bench", "--data-parallel-size", "2"]) == 2
    assert "not supported by the deepinfer command yet for bench" in capsys.readouterr().err


def test_killed_rank_makes_the_server_report_it(served: Served, client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="class B:", max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    started = time.monotonic()
    os.kill(served.llm.pids[1], signal.SIGKILL)
    with pytest.raises(openai.APIError, match="DP rank 1 exited with code -9"):
        for _ in stream:                                  # ends with an error event, not [DONE]
            pass
    assert time.monotonic() - started < 5
    health = httpx.get(f"{served.base_url}/health", timeout=10)
    assert health.status_code == 503 and "DP rank 1 exited with code -9" in health.json()["error"]
    with pytest.raises(openai.InternalServerError, match="DP rank 1 exited with code -9"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
