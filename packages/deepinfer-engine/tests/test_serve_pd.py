"""A prefill/decode pair served over HTTP (issue #33): a prefill server (PROMPT engine, /v1/pd/*) and a
decode server (COMPLETION engine, `HttpPrefillClient`) on the embedded model answer completions and
chat streams as one NORMAL server does; /metrics on both count the KV handed over; a closed stream, a
prefill cancelled while its KV is in flight, a killed and restarted prefill server, a transfer cut
mid-way and another model are handled, with nothing left held on either side. The prefill server
checks its API key (the decode side sends it; a wrong or missing one stops the decode side's start).
The last test runs the two `deepinfer serve` commands as processes on the tiny random V4.1 model, with
one API key for both."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from engine_tiny_v41 import CONFIG as V41_CONFIG
from serve_helpers import start_uvicorn, tcp_socket

from deepinfer.engine import EngineArgs, LLMEngine, SamplingParams
from deepinfer.engine.cli import main
from deepinfer.engine.core.kv_handoff import ModelFingerprint, PrefillOrder, TransferFailed
from deepinfer.engine.disagg import HttpPrefillClient, PrefillExports
from deepinfer.engine.frontends.async_llm import AsyncLLM
from deepinfer.engine.serve import build_app
from deepinfer.engine.serve.pd_routes import add_pd_routes
from deepinfer.sched import EngineType

MODEL = "pair"
KEY = "prefill-key"          # the prefill server's --api-key
AUTH = {"Authorization": f"Bearer {KEY}"}
EMBEDDED = {"device": "cpu", "max_num_seqs": 4, "kv_cache_memory_mb": 16, "max_model_len": 512, "seed": 0}


class Prefill:
    """The prefill server of the tests, which can be stopped and started again on its port."""

    def __init__(self) -> None:
        self.exports = PrefillExports()
        self.engine = LLMEngine(EngineArgs(**EMBEDDED, engine_type=EngineType.PROMPT), kv_transfer=self.exports)
        self.port = 0
        self.start()

    def start(self) -> None:
        sock = tcp_socket() if not self.port else _bound(self.port)
        self.port = sock.getsockname()[1]
        self.llm = AsyncLLM(self.engine)
        app = build_app(self.llm, served_model_name=MODEL, api_key=KEY)
        add_pd_routes(app, self.llm, self.exports)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _bound(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Prefill, LLMEngine, str, str]]:
    """(the prefill server, the decode engine, the decode server's URL, a NORMAL server's URL)."""
    prefill = Prefill()
    decode = LLMEngine(EngineArgs(**EMBEDDED, engine_type=EngineType.COMPLETION),
                       kv_transfer=HttpPrefillClient(prefill.url, timeout_s=60, api_key=KEY))
    decode_url, decode_server, decode_thread = start_uvicorn(build_app(AsyncLLM(decode), served_model_name=MODEL))
    normal_url, normal_server, normal_thread = start_uvicorn(
        build_app(AsyncLLM(LLMEngine(EngineArgs(**EMBEDDED))), served_model_name=MODEL))
    yield prefill, decode, decode_url, normal_url
    for server, thread in ((decode_server, decode_thread), (normal_server, normal_thread)):
        server.should_exit = True
        thread.join(timeout=30)
    prefill.stop()


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, headers=headers, timeout=60)


def _streamed(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={"model": MODEL, "stream": True, **body}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _joined(chunks: list[dict]) -> str:
    """The text of a completion or chat stream."""
    return "".join(choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                   for chunk in chunks for choice in chunk["choices"])


def _nothing_held(prefill: Prefill, decode: LLMEngine) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (decode.has_unfinished_requests() or
                                           prefill.engine.has_unfinished_requests() or len(prefill.exports)):
        time.sleep(0.02)
    for engine in (prefill.engine, decode):
        assert not engine.has_unfinished_requests()
        assert engine.kv_blocks.num_free == engine.runner.plan.num_kv_blocks - 1
        with engine._lock:                       # no sequence, so every state slot is free too
            engine.scheduler.check_integrity()
    assert len(prefill.exports) == 0 and not decode._pd.awaiting and not decode._pd.arrived


def test_completions_and_chat_streams_equal_a_single_server(servers) -> None:
    prefill, decode, decode_url, normal_url = servers
    body = {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0}
    got, want = (_post(u, "/v1/completions", body).json() for u in (decode_url, normal_url))
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"] == want["usage"]
    chat = {"messages": [{"role": "user", "content": "Write a loop."}], "max_tokens": 10, "temperature": 0.7,
            "seed": 5}
    for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        got, want = (_joined(_streamed(u, path, request)) for u in (decode_url, normal_url))
        assert got == want and got
    _nothing_held(prefill, decode)


def test_metrics_on_both_sides_count_the_kv_handed_over(servers) -> None:
    prefill, decode, decode_url, _ = servers
    assert _post(decode_url, "/v1/completions", {"prompt": "x = 1", "max_tokens": 2}).status_code == 200

    def counters(url: str) -> dict[str, float]:
        text = httpx.get(f"{url}/metrics").text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("deepinfer_kv_transfer")}

    sent, received = counters(prefill.url), counters(decode_url)
    for _ in range(100):            # the prefill side counts a handoff once its last frame is written
        if sent["deepinfer_kv_transfer_bytes_total"] == received["deepinfer_kv_transfer_bytes_total"]:
            break
        time.sleep(0.05)
        sent = counters(prefill.url)
    for side in (sent, received):
        assert side["deepinfer_kv_transfers_total"] >= 1 and side["deepinfer_kv_transfer_bytes_total"] > 0
        assert side["deepinfer_kv_transfer_seconds_total"] > 0
    assert sent["deepinfer_kv_transfer_bytes_total"] == received["deepinfer_kv_transfer_bytes_total"], (sent, received)


def test_closing_a_stream_frees_both_sides(servers) -> None:
    prefill, decode, decode_url, _ = servers
    body = {"model": MODEL, "prompt": "class A:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{decode_url}/v1/completions", json=body, timeout=60) as response:
        for num_lines, _ in enumerate(response.iter_lines()):
            if num_lines >= 4:
                break
    _nothing_held(prefill, decode)


def test_a_prefill_cancelled_while_in_flight_leaves_nothing(servers) -> None:
    prefill, decode, _, _ = servers
    client = HttpPrefillClient(prefill.url, api_key=KEY)
    client.connect(decode.fingerprint)
    for delay in (0.0, 0.3):             # before the prefill ran, and (likely) while its KV is on the wire
        client.request_prefill(PrefillOrder(f"c{delay}", tuple(range(5, 300)), SamplingParams(max_tokens=5)))
        time.sleep(delay)
        client.cancel(f"c{delay}")
    time.sleep(0.5)
    assert client.poll(0.0) == []
    _nothing_held(prefill, decode)


def test_a_killed_prefill_server_fails_requests_clearly_and_a_restarted_one_serves(servers) -> None:
    prefill, decode, decode_url, _ = servers
    prefill.stop()
    response = _post(decode_url, "/v1/completions", {"prompt": "def f():", "max_tokens": 3})
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert "prefill failed" in message and prefill.url in message and "Connection refused" in message
    _nothing_held(prefill, decode)
    prefill.start()                     # the same engine and port: the next request connects afresh
    assert _post(decode_url, "/v1/completions", {"prompt": "def f():", "max_tokens": 3}).status_code == 200


def test_another_model_is_refused_at_connect_naming_both(servers, tmp_path: Path) -> None:
    prefill = servers[0]
    (tmp_path / "config.json").write_text(json.dumps(V41_CONFIG))
    args = EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu", max_num_seqs=2, kv_cache_memory_mb=4,
                      max_model_len=256, engine_type=EngineType.COMPLETION)
    with pytest.raises(ValueError, match=rf"prefill server at {prefill.url} serves the embedded model .*this decode "
                                         rf"server {tmp_path}"):
        LLMEngine(args, kv_transfer=HttpPrefillClient(prefill.url, api_key=KEY))
    response = httpx.post(f"{prefill.url}/v1/pd/prefill", json={"request_id": "x", "prompt_token_ids": [1],
                                                                "params": {}, "fingerprint_key": "f00", "model": "M2"},
                          headers=AUTH)
    message = response.json()["error"]["message"]
    assert response.status_code == 409 and "serves the embedded model" in message and "decode server M2" in message


def test_the_pd_routes_want_the_api_key(servers) -> None:
    prefill = servers[0]
    order = {"request_id": "k", "prompt_token_ids": [1], "params": {}, "fingerprint_key": "f00", "model": "M2"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for response in (httpx.get(f"{prefill.url}/v1/pd/info", headers=headers),
                         httpx.post(f"{prefill.url}/v1/pd/prefill", json=order, headers=headers)):
            assert response.status_code == 401, response.text
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{prefill.url}/v1/pd/info", headers=AUTH).json()["model"] == "the embedded model"
    assert len(prefill.exports) == 0 and not prefill.engine.has_unfinished_requests()


@pytest.mark.parametrize(("api_key", "said"), [("wrong", "refused this decode server's API key"),
                                               (None, "wants an API key; none was sent")])
def test_a_decode_side_without_the_key_fails_at_connect(servers, api_key: str | None, said: str) -> None:
    prefill, decode = servers[0], servers[1]
    client = HttpPrefillClient(prefill.url, api_key=api_key)
    with pytest.raises(ConnectionError) as caught:
        client.connect(decode.fingerprint)
    message = str(caught.value)
    assert f"the prefill server at {prefill.url} {said} (401 invalid_api_key)" in message
    assert "wrong" not in message          # the key is never repeated


def test_deepinfer_serve_decode_with_a_wrong_key_refuses_to_start(servers, capsys: pytest.CaptureFixture[str]) -> None:
    prefill = servers[0]
    argv = ["serve", "--device", "cpu", "--max-num-seqs", "4", "--kv-cache-memory-mb", "16", "--max-model-len", "512",
            "--seed", "0", "--engine-in-thread", "--pd-role", "decode", "--pd-prefill-url", prefill.url]
    assert main([*argv, "--api-key", "mine", "--pd-prefill-api-key", "wrong"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"deepinfer: error: the prefill server at {prefill.url} refused this decode server's API key (401 " \
           "invalid_api_key)" in err and "wrong" not in err


def test_a_transfer_cut_mid_way_fails_the_order() -> None:
    """A fake prefill server that answers half a handoff and hangs up."""
    listener = tcp_socket()
    listener.listen(4)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    header = json.dumps({"tensors": [["blocks", "blocks", "torch.uint8", [10]]]}).encode()
    cut = struct.pack(">Q", len(header)) + header + struct.pack(">Q", 10) + b"abc"     # 3 of the tensor's 10 bytes

    def serve() -> None:
        for answer in (json.dumps({"model": "m", "fingerprint_key": "k"}).encode(), cut):
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + answer)
            # Hang up cleanly: closing with request bytes still unread would reset the connection
            # (ECONNRESET) instead of ending the answer where it was cut.
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(65536):
                pass
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = HttpPrefillClient(url)
    client.connect(ModelFingerprint("m", "k"))
    client.request_prefill(PrefillOrder("r", (1, 2), SamplingParams()))
    (failed,) = client.poll(10.0)
    assert isinstance(failed, TransferFailed) and failed.request_id == "r"
    assert "transfer was cut" in failed.reason and url in failed.reason
    thread.join(timeout=10)
    listener.close()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")


def test_deepinfer_serve_pair_as_two_processes_tiny_v41(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(V41_CONFIG))
    common = ["--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--max-num-seqs", "2",
              "--kv-cache-memory-mb", "4", "--max-model-len", "256", "--served-model-name", MODEL,
              "--log-level", "warning", "--api-key", KEY]     # one key: the decode side sends its own
    ports = [tcp_socket().getsockname()[1] for _ in range(2)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    serve = [sys.executable, "-m", "deepinfer.engine.cli", "serve", *common]
    procs = [subprocess.Popen([*serve, "--pd-role", "prefill", "--port", str(ports[0])], stderr=subprocess.PIPE,
                              text=True),       # started together: the decode side waits for the prefill side
             subprocess.Popen([*serve, "--pd-role", "decode", "--port", str(ports[1]), "--pd-prefill-url", urls[0]],
                              stderr=subprocess.PIPE, text=True)]
    try:
        _wait_healthy(urls[0], procs[0])
        _wait_healthy(urls[1], procs[1])
        prompt = [5, 17, 33, 8, 61, 2, 40, 9, 12, 77, 3]
        out = _post(urls[1], "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0,
                                                 "ignore_eos": True}, AUTH).json()
        tokens = [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]
        engine = LLMEngine(EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu", max_num_seqs=2,
                                      kv_cache_memory_mb=4, max_model_len=256))
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        want = []
        while engine.has_unfinished_requests():
            want += [o.outputs[0].token_ids for o in engine.step() if o.finished]
        assert [tokens] == want
        metrics = httpx.get(f"{urls[1]}/metrics").text
        assert "deepinfer_kv_transfers_total 1.0" in metrics
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    assert not any(os.path.exists(f"/proc/{proc.pid}") for proc in procs)
