"""`deepinfer serve` against hostile input (issue #36): every case gets a clear 4xx naming the field,
leaves nothing registered (no waiting entry, metrics right), and the server answers the next request
correctly. One engine process serves the module through uvicorn as `deepinfer serve` runs it
(`uvicorn_config`, with short header / keep-alive timeouts); the grammar cases drive an in-thread
engine whose compile pool has short bounds and a gated back end (deterministic, no slow compile)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from serve_helpers import tcp_socket

from deepinfer.engine import EngineArgs, SamplingParams
from deepinfer.engine.frontends.async_llm import AsyncLLM
from deepinfer.engine.frontends.async_process import AsyncLLMProcess
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sampling.grammar_backend import XGrammarBackend
from deepinfer.engine.sampling.grammar_compiler import GrammarCompilePool
from deepinfer.engine.sampling.sampling_params import StructuredOutput
from deepinfer.engine.serve import build_app
from deepinfer.engine.serve.protocol import CHAT_ONLY, COMMON, COMPLETION_ONLY, NOT_SUPPORTED_YET
from deepinfer.engine.serve.server import uvicorn_config

MODEL = "tiny"
MAX_BODY = 2 << 20
MAX_WAITING = 4
KEPT_SLACK_BYTES = 256 << 10   # Python objects made by a hostile round and still alive (the last report, ...)
RSS_SLACK_KIB = 12 << 10       # resident growth over two hostile rounds, per process: pymalloc arenas pinned by a
                               # few live objects (about 2 MiB a round measured here)


@dataclass
class Served:
    url: str
    port: int
    llm: object
    server: uvicorn.Server
    thread: threading.Thread


def serve(llm: object, **app_kwargs: object) -> Served:
    sock = tcp_socket()
    app = build_app(llm, served_model_name=MODEL, **app_kwargs)
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", header_timeout_s=0.5, keep_alive_timeout_s=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    port = sock.getsockname()[1]
    return Served(f"http://127.0.0.1:{port}", port, llm, server, thread)


def stop(served: Served) -> None:
    served.server.should_exit = True
    served.thread.join(timeout=60)
    assert not served.thread.is_alive()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    result = serve(AsyncLLMProcess(EngineArgs(seed=0), max_num_waiting=MAX_WAITING), max_body_bytes=MAX_BODY,
                   api_key="sesame")
    yield result
    stop(result)
    assert result.llm.failure is None


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60, headers={"Authorization": "Bearer sesame"}) as session:
        yield session


def post(http: httpx.Client, path: str, body: object) -> httpx.Response:
    """POST `body` as JSON text (json.dumps escapes a lone surrogate as \\udXXX, as a client would)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(f"/v1/{path}", content=raw, headers={"Content-Type": "application/json"})


def assert_nothing_left_and_serving(served: Served, http: httpx.Client) -> None:
    """No request registered or waiting (front, stats, /metrics), and a normal request answers."""
    llm = served.llm
    assert llm.num_unfinished == 0 and llm.stats.num_waiting == 0
    metrics = http.get("/metrics").text
    assert "deepinfer_num_requests_waiting 0.0" in metrics
    ok = post(http, "completions", {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "description": "d\udc00", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("completions", {"prompt": "\ud800"}, "prompt"),
    ("completions", {"prompt": ["ok \udfff"]}, "prompt[0]"),
    ("completions", {"prompt": "x", "stop": ["a", "\ud800b"]}, "stop[1]"),
    ("completions", {"prompt": "x", "bad_words": ["\udc00"]}, "bad_words[0]"),
    ("completions", {"prompt": "x", "structured_outputs": {"choice": ["\udc00"]}}, "structured_outputs.choice[0]"),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "a\ud800"}}, "structured_outputs.regex"),
    ("completions", {"prompt": "x", "user": "\ud800"}, "user"),
    ("completions", {"prompt": "x", "logit_bias": {"\ud800": 1}}, "logit_bias[key '\\ud800']"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\udc00"}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text"),
    ("chat/completions", {**CHAT, "tools": [TOOL]}, "tools[0].function.description"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(served: Served, http: httpx.Client, path: str,
                                                             body: dict, param: str) -> None:
    for _ in range(MAX_WAITING + 1):           # more than the waiting queue holds: none may stay registered
        reply = post(http, path, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and "lone surrogate" in error["message"]
    assert_nothing_left_and_serving(served, http)


def test_a_refused_text_prompt_leaves_nothing_registered_in_the_front(served: Served) -> None:
    llm = served.llm

    async def first(prompt: object) -> None:
        async for _ in llm.generate(prompt, SamplingParams(max_tokens=1)):
            pass

    for _ in range(MAX_WAITING + 1):
        with pytest.raises(ValueError, match="prompt: holds a lone surrogate"):
            asyncio.run(first("ok \ud800"))
        with pytest.raises(ValueError, match="more than max_model_len"):
            asyncio.run(first("x" * (llm.model.tokenizer.max_token_chars * llm.model.max_model_len + 1)))
    assert llm.num_unfinished == 0 and llm.stats.num_waiting == 0 and llm.is_running


def test_text_is_tokenized_off_the_event_loop(served: Served, http: httpx.Client,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = served.llm.model.tokenizer
    threads: list[str] = []
    encode = tokenizer.encode

    def recording(text: str, **kwargs: object) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording, raising=False)
    assert post(http, "completions", {"prompt": "def f(", "max_tokens": 1}).status_code == 200
    assert post(http, "chat/completions", CHAT).status_code == 200
    assert len(threads) == 2 and all(name != served.thread.name for name in threads)   # not uvicorn's loop


def test_oversized_bodies_and_prompts_are_refused_cheaply(served: Served, http: httpx.Client) -> None:
    big = post(http, "completions", {"prompt": "x" * (MAX_BODY + 10)})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    started = time.monotonic()
    for path, body in (("completions", {"prompt": "ab " * 330_000}),            # ~1 MB: never tokenized
                       ("chat/completions", {"messages": [{"role": "user", "content": "ab " * 330_000}]})):
        reply = post(http, path, body)
        assert reply.status_code == 400 and "more than max_model_len" in reply.json()["error"]["message"]
    assert time.monotonic() - started < 5          # tokenizing them would take far longer on this machine
    assert_nothing_left_and_serving(served, http)


@pytest.mark.parametrize(("raw", "needle"), [
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "integer of 5000 digits"),
    (b'{"prompt": "x", "max_tokens": 1, "max_tokens": 2}', "'max_tokens' appears twice"),
    (b'{"prompt": "x", "logit_bias": {"5": 1, "00005": 2}}', "'5' and '00005' are the same token id 5"),
    (b'{"prompt": "x", "logit_bias": {"' + b"1" * 30 + b'": 1}}', "must be a token id"),
    (b'{"prompt": "x"', "not valid JSON"),                                           # truncated body
    (b'{"prompt": "x\xff"}', "not valid JSON"),                                      # not UTF-8
])
def test_malformed_numbers_keys_and_bodies_are_400(served: Served, http: httpx.Client, raw: bytes,
                                                    needle: str) -> None:
    reply = post(http, "completions", raw)
    assert reply.status_code == 400 and needle in reply.json()["error"]["message"], reply.text
    assert_nothing_left_and_serving(served, http)


def _exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send one HTTP/1.1 request and read its whole (Content-Length) response; b"" when closed."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def _request(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer sesame\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_a_500_keeps_the_connection_and_half_open_connections_are_closed(served: Served,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(served.llm, "generate", broken)
    ok_body = b'{"prompt": [5, 6], "max_tokens": 1}'
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        assert _exchange(sock, _request(ok_body)).startswith(b"HTTP/1.1 500")
        monkeypatch.undo()
        assert _exchange(sock, _request(ok_body)).startswith(b"HTTP/1.1 200")     # same connection
    for opening in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"):      # silent / headers never ended
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            sock.sendall(opening)
            started = time.monotonic()
            assert sock.recv(1024) == b""                                       # closed by the server
            assert time.monotonic() - started < 5


@pytest.mark.parametrize(("headers", "query", "status"), [
    ({"Authorization": "Bearer sesame"}, "", 200),
    ({"authorization": "bearer  sesame"}, "", 200),         # header and scheme case, spaces before the key
    ({"Authorization": "Bearer sesame2"}, "", 401),
    ({"Authorization": "Basic sesame"}, "", 401),
    ({"Authorization": "Bearersesame"}, "", 401),
    ({}, "?api_key=sesame", 401),                              # a key in the query string does not count
    ({"X-Api-Key": "sesame"}, "", 401),
])
def test_api_key_variants(served: Served, headers: dict, query: str, status: int) -> None:
    reply = httpx.get(f"{served.url}/v1/models{query}", headers=headers, timeout=30)
    assert reply.status_code == status


# ---------------------------------------------------------------------------------------- grammars


class _GatedBackend:
    """The real xgrammar back end, except that a regex starting with "slow" blocks until `release`."""

    def __init__(self, real: XGrammarBackend) -> None:
        self.real, self.release = real, threading.Event()
        self.started: list[str] = []
        self.broken = False             # new_state raises

    def compile(self, spec: StructuredOutput) -> object:
        self.started.append(spec.regex or spec.kind)
        if spec.regex is not None and spec.regex.startswith("slow"):
            self.release.wait(60)
            return self.real.compile(StructuredOutput(regex="[ab]"))
        return self.real.compile(spec)

    def new_state(self, compiled: object) -> object:
        if self.broken:
            raise RuntimeError("matcher broke")
        return self.real.new_state(compiled)


@pytest.fixture(scope="module")
def grammar_served() -> Iterator[tuple[Served, _GatedBackend, GrammarCompilePool]]:
    engine = LLMEngine(EngineArgs(seed=0))
    backend = _GatedBackend(XGrammarBackend(engine.tokenizer, engine.model.cfg.vocab_size, engine.eos_token_ids))
    backend.real.compile(StructuredOutput(regex="[ab]"))      # the first compile imports xgrammar: seconds
    engine.grammars = pool = GrammarCompilePool(backend, max_workers=1, max_threads=4, timeout_s=2.0,
                                                slow_after_s=0.05)
    result = serve(AsyncLLM(engine))
    yield result, backend, pool
    backend.release.set()
    stop(result)


def _regex(regex: str) -> dict:
    return {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": regex}}


def test_slow_grammars_time_out_as_400_and_do_not_hold_back_simple_ones(grammar_served) -> None:
    served, backend, pool = grammar_served
    clients = [httpx.Client(base_url=served.url, timeout=30) for _ in range(3)]
    with clients[0] as http, clients[1] as http2, clients[2] as http3:
        results: list[httpx.Response] = []
        slow = [threading.Thread(target=lambda h=h, i=i: results.append(post(h, "completions", _regex(f"slow{i}"))))
                for i, h in enumerate((http, http2))]
        for thread in slow:
            thread.start()
        while len(backend.started) < 2:
            time.sleep(0.01)
        simple = post(http3, "completions", _regex("[ab]+"))           # one worker slot: both slow ones hold it
        assert simple.status_code == 200 and len(results) == 0
        for thread in slow:
            thread.join()
        for reply in results:
            error = reply.json()["error"]
            assert reply.status_code == 400 and error["param"] == "structured_outputs"
            assert "did not compile within 2 s" in error["message"]
        again = post(http3, "completions", _regex("slow0"))              # remembered as failed: at once
        assert again.status_code == 400 and backend.started.count("slow0") == 1
        failed = post(http3, "completions", {"prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "[a-z]{1,45000}"}}}})
        assert failed.status_code == 400 and failed.json()["error"]["param"] == "response_format"
        assert "exceeds 1000" in failed.json()["error"]["message"]
        bad = post(http3, "completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= foo"}})
        assert bad.status_code == 400 and "grammar compile failed" in bad.json()["error"]["message"]


def test_a_request_whose_client_left_stops_waiting_for_its_grammar(grammar_served) -> None:
    served, backend, pool = grammar_served
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=served.url, timeout=0.3) as http:
        post(http, "completions", _regex("slow-gone"))
    deadline = time.monotonic() + 10
    while served.llm.engine._awaiting_grammar or pool.num_waiting or served.llm.num_unfinished:
        assert time.monotonic() < deadline, "the aborted request still waits for its grammar"
        time.sleep(0.02)
    with httpx.Client(base_url=served.url, timeout=30) as http:
        assert post(http, "completions", _regex("[ab]+")).status_code == 200


def test_a_grammar_that_cannot_start_or_a_failed_request_is_an_error_to_the_client(
        grammar_served, monkeypatch: pytest.MonkeyPatch) -> None:
    served, backend, _ = grammar_served
    engine = served.llm.engine
    with httpx.Client(base_url=served.url, timeout=30) as http:
        backend.broken = True
        try:
            reply = post(http, "completions", _regex("[ab]+"))
        finally:
            backend.broken = False
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "structured_outputs"
        assert "its grammar could not start: RuntimeError: matcher broke" in error["message"]
        plain = engine.plain_step
        post_process = plain._post_process

        def failing(*args: object, **kwargs: object) -> None:
            raise RuntimeError("step broke")

        monkeypatch.setattr(plain, "_post_process", failing)        # every request of a step fails
        whole = post(http, "completions", {"prompt": [5, 6], "max_tokens": 2})
        assert whole.status_code == 500 and whole.json()["error"]["code"] == "request_failed"
        assert "RuntimeError: step broke" in whole.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", content=json.dumps(
                {"prompt": [5, 6], "max_tokens": 2, "stream": True})) as streamed:
            chunks = [json.loads(line[6:]) for line in streamed.iter_lines()
                      if line.startswith("data: {")]
        last = chunks[-1]["choices"][0]
        assert last["finish_reason"] == "error" and "step broke" in last["error_reason"]
        monkeypatch.setattr(plain, "_post_process", post_process)
        assert post(http, "completions", _regex("[ab]+")).status_code == 200


class _Gates:
    """A pool back end whose compile of regex R blocks until gates[R] is set."""

    def __init__(self, *names: str) -> None:
        self.gates = {name: threading.Event() for name in names}
        self.started: list[str] = []

    def compile(self, spec: StructuredOutput) -> object:
        self.started.append(spec.regex)
        gate = self.gates.get(spec.regex)
        if gate is not None:
            assert gate.wait(30)
        return spec.regex


def _answers(pool: GrammarCompilePool, count: int) -> dict[str, str | None]:
    done: dict[str, str | None] = {}
    deadline = time.monotonic() + 30
    while len(done) < count:
        assert time.monotonic() < deadline
        pool.wait(0.01)
        done.update((d.request_id, d.error) for d in pool.pop_completed())
    return done


def test_pool_cancels_queued_compiles_and_frees_the_slots_of_slow_ones() -> None:
    backend = _Gates("a", "b")
    pool = GrammarCompilePool(backend, max_workers=1, max_threads=2, timeout_s=30, slow_after_s=0.05)
    pool.submit("ra", StructuredOutput(regex="a"))
    pool.submit("rb", StructuredOutput(regex="b"))       # queued: the one worker slot is a's
    pool.submit("rc", StructuredOutput(regex="c"))
    assert backend.started == ["a"]
    pool.cancel("rb")                                     # nobody else waits for b: it never runs
    time.sleep(0.06)                                      # a is slow now: its slot goes to c
    assert _answers(pool, 1) == {"rc": None} and backend.started == ["a", "c"]
    pool.cancel("ra")                                     # running: it runs on, its result dropped
    backend.gates["a"].set()
    pool.submit("rd", StructuredOutput(regex="d"))
    assert _answers(pool, 1) == {"rd": None} and pool.num_waiting == 0
    assert "b" not in backend.started
    pool.shutdown()


def test_pool_times_out_requests_and_remembers_a_key_that_compiled_too_long() -> None:
    backend = _Gates("slow")
    pool = GrammarCompilePool(backend, max_workers=1, max_threads=1, timeout_s=0.2, slow_after_s=0.05)
    pool.submit("r1", StructuredOutput(regex="slow"))
    pool.submit("r2", StructuredOutput(regex="never"))   # no thread left: it times out queued
    done = _answers(pool, 2)
    assert all("did not compile within 0.2 s" in done[r] for r in ("r1", "r2"))
    pool.submit("r3", StructuredOutput(regex="slow"))    # remembered as failed: answered at once
    assert "did not compile within" in pool.pop_completed()[0].error
    assert backend.started == ["slow"] and pool.num_running == 1
    compiling = [t for t in threading.enumerate() if t.name == "deepinfer-grammar"]
    assert compiling and all(t.daemon for t in compiling)     # an exiting engine process does not wait for them
    backend.gates["slow"].set()
    pool.shutdown()
    with pytest.raises(ValueError, match="must be >= max_workers"):
        GrammarCompilePool(backend, max_workers=2, max_threads=1)


# ------------------------------------------------------------------------------ the #35 sweep

WRONG_TYPES = [[], {}, "s", 1.5, True]      # ranges (-1, 10**30, ...) are checked field by field elsewhere


def _fields(chat: bool) -> list[str]:
    if chat:
        return sorted(CHAT_ONLY)
    return sorted(COMMON | set(COMPLETION_ONLY) | set(NOT_SUPPORTED_YET))


def _root(param: str) -> str:
    return param.split(".")[0].split("[")[0]


# A wrong value of these fields is charged to the field it conflicts with.
_CHARGED_TO = {"best_of": {"best_of", "n"}, "tools": {"tools", "tool_choice"},
               "parallel_tool_calls": {"parallel_tool_calls", "tool_choice", "tools"},
               "max_completion_tokens": {"max_completion_tokens", "max_tokens"},
               "top_logprobs": {"top_logprobs", "logprobs"}, "logprobs": {"logprobs", "top_logprobs"}}


@pytest.mark.parametrize("chat", [False, True])
def test_wrong_json_types_for_every_field_are_refused_naming_it(served: Served, http: httpx.Client,
                                                                 chat: bool) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [5, 6]}
    path = "chat/completions" if chat else "completions"
    threads = threading.active_count()
    for field in _fields(chat):
        for value in WRONG_TYPES:
            reply = post(http, path, {"max_tokens": 1, **base, field: value})
            if reply.status_code == 200:                        # a value that happens to be valid
                continue
            error = reply.json()["error"]
            assert reply.status_code in (400, 404), (field, value, reply.text)
            assert _root(error["param"] or "?") in _CHARGED_TO.get(field, {field}), (field, value, error)
    assert threading.active_count() <= threads + 2            # the tokenizer worker threads at most
    assert_nothing_left_and_serving(served, http)


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"prompt": [-1]}, "prompt", "must be in [0, "),
    ({"prompt": [4096]}, "prompt", "must be in [0, 4096)"),
    ({"prompt": [10**18]}, "prompt", "must be in [0, "),
    ({"prompt": "x", "stop": ["s"] * 1000}, "stop", "at most 64"),
    ({"prompt": "x", "stop": ["s" * 10_000]}, "stop", "at most 1024"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(100_000)}}, "logit_bias", "at most 1024"),
    ({"prompt": "x", "allowed_token_ids": [-5]}, "allowed_token_ids", ""),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": json.loads(
        '{"type": "array", "items": ' * 300 + '{"type": "string"}' + "}" * 300)}}}, "response_format",
     "nested more than 100 levels"),
    ({"prompt": "x", "structured_outputs": {"regex": "(" * 3000 + "a" + ")" * 3000}}, "structured_outputs",
     "parentheses nest 3000 deep"),
])
def test_out_of_range_ids_and_oversized_controls_are_400(served: Served, http: httpx.Client, body: dict,
                                                          param: str, needle: str) -> None:
    reply = post(http, "completions", {"max_tokens": 1, **body})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and needle in error["message"], reply.text
    assert served.llm.num_unfinished == 0 and served.llm.stats.num_waiting == 0


def test_nul_bytes_and_catastrophic_regexes_are_just_text(http: httpx.Client) -> None:
    for body in ({"prompt": "a\x00b", "stop": ["\x00"]},
                 {"prompt": "x", "structured_outputs": {"regex": "(a|aa)*b"}}):
        reply = post(http, "completions", {"max_tokens": 2, **body})
        assert reply.status_code == 200, reply.text


def test_a_client_that_leaves_mid_stream_aborts_its_request_and_frees_its_cache(served: Served) -> None:
    llm = served.llm
    free = llm.stats.num_free_kv_blocks
    body = json.dumps({"prompt": "class A:", "max_tokens": 3000, "ignore_eos": True, "stream": True})
    with httpx.Client(base_url=served.url, timeout=30, headers={"Authorization": "Bearer sesame"}) as http, \
            http.stream("POST", "/v1/completions", content=body) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))          # it runs
    deadline = time.monotonic() + 30
    while llm.num_unfinished or llm.stats.num_running or llm.stats.num_free_kv_blocks != free:
        assert time.monotonic() < deadline, "the left request still runs or holds cache blocks"
        time.sleep(0.02)


# ------------------------------------------------------------------ memory and threads over the sweep


def _raw(body: object) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


_DEEP_SCHEMA = {"type": "json_schema", "json_schema": {"schema": json.loads(
    '{"type": "array", "items": ' * 300 + '{"type": "string"}' + "}" * 300)}}
# (path, body, status): one of each kind of hostile request above, built once (the server shares this process)
_SWEEP = [(path, _raw(body), status) for path, body, status in [
    ("completions", {"prompt": "ok \ud800"}, 400),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("chat/completions", {**CHAT, "tools": [TOOL]}, 400),
    ("completions", {"prompt": [5], "max_tokens": "s"}, 400),
    ("completions", {"prompt": [5], "temperature": []}, 400),
    ("completions", {"prompt": [5], "stop": 1.5}, 400),
    ("completions", {"prompt": [-1]}, 400),
    ("completions", {"prompt": [10**18]}, 400),
    ("completions", {"prompt": "x", "max_tokens": 10**9}, 400),
    ("completions", {"prompt": "ab " * 330_000}, 400),                                   # 1 MB of text
    ("chat/completions", {"messages": [{"role": "user", "content": "ab " * 330_000}]}, 400),
    ("completions", {"prompt": "x", "stop": ["s"] * 1000}, 400),
    ("completions", {"prompt": "x", "stop": ["s" * 10_000]}, 400),
    ("completions", {"prompt": "x", "response_format": _DEEP_SCHEMA}, 400),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "(" * 3000 + "a" + ")" * 3000}}, 400),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "[a-z]{1,45000}"}}, 400),
    ("completions", {"prompt": "x" * (MAX_BODY + 10)}, 413),
    ("completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400),
    ("completions", b'{"prompt": "x", "max_tokens": 1, "max_tokens": 2}', 400),
    ("completions", b'{"prompt": "x"', 400),
    ("completions", b'{"prompt": "x\xff"}', 400),
    ("completions", {"prompt": "a\x00b", "stop": ["\x00"], "max_tokens": 2}, 200),
    ("completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "(a|aa)*b"}}, 200),
]]
# 10^5 logit_bias entries: 1.4 MB of JSON parsed into 10^5 objects (slow under tracemalloc, so kept apart)
_BIG_LOGIT_BIAS = ("completions", _raw({"prompt": "x", "logit_bias": {str(i): 1 for i in range(100_000)}}), 400)


def _hostile_round(served: Served, http: httpx.Client, *, big_logit_bias: bool = True) -> None:
    """Every case of `_SWEEP` (and `_BIG_LOGIT_BIAS`), a request without the key, and a stream the
    client leaves after its first event; each answered as the tests above check, nothing left registered."""
    for path, raw, status in _SWEEP + ([_BIG_LOGIT_BIAS] if big_logit_bias else []):
        reply = http.post(f"/v1/{path}", content=raw, headers={"Content-Type": "application/json"})
        assert reply.status_code == status, (path, raw[:80], reply.text[:200])
    assert httpx.get(f"{served.url}/v1/models", timeout=30).status_code == 401
    with http.stream("POST", "/v1/completions", content=_raw({"prompt": "class A:", "max_tokens": 3000,
                                                              "ignore_eos": True, "stream": True})) as reply:
        assert next(line for line in reply.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while served.llm.num_unfinished or served.llm.stats.num_running:
        assert time.monotonic() < deadline, "the left stream still runs"
        time.sleep(0.01)


def _rss_and_threads(pid: int) -> tuple[int, int]:
    """(resident memory in KiB, OS threads) of process `pid`."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmRSS"].split()[0]), int(fields["Threads"])


def test_memory_and_threads_come_back_after_the_hostile_sweep(served: Served, http: httpx.Client) -> None:
    """Over rounds of the hostile cases (about 6 MB of bodies a round, and megabytes of parsed JSON),
    neither the server's process (this one: HTTP, front, tokenizer) nor the engine process keeps
    threads or memory: the resident memory of each comes back within the allocators' slack (a
    request that held on to its parsed JSON would add tens of megabytes), and no Python object made
    during a round outlives it (tracemalloc, exact: a body held on to would keep a megabyte)."""
    pids = {"server": os.getpid(), "engine": served.llm.pid}
    _hostile_round(served, http)              # the first round pays for what is built once (caches, worker threads)
    gc.collect()
    baseline = {name: _rss_and_threads(pid) for name, pid in pids.items()}
    for _ in range(2):
        _hostile_round(served, http)
    gc.collect()
    for name, pid in pids.items():
        (rss_before, threads_before), (rss_after, threads_after) = baseline[name], _rss_and_threads(pid)
        assert threads_after <= threads_before, (name, threads_before, threads_after)
        assert rss_after - rss_before < RSS_SLACK_KIB, (name, rss_before, rss_after)
    tracemalloc.start()                       # last: its own tables take resident memory
    try:
        _hostile_round(served, http, big_logit_bias=False)
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < KEPT_SLACK_BYTES, kept
    assert_nothing_left_and_serving(served, http)
