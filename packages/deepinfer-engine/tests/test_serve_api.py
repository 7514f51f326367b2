"""`deepinfer serve` through the real `openai` client and raw HTTP: completions, chat, streaming,
structured output, logprobs, usage, models / health / version, and the 400 / 401 / 404 / 503 errors.
The server drives an engine process (`AsyncLLMProcess`, serve's default); the 503 test holds an
in-thread `AsyncLLM` over a stand-in engine."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from serve_helpers import start_uvicorn

from deepinfer.engine import EngineArgs, RequestOutput
from deepinfer.engine.core.kv_handoff import NullKVTransfer
from deepinfer.engine.core.outputs import CompletionOutput
from deepinfer.engine.frontends.async_front import EngineClient
from deepinfer.engine.frontends.async_llm import AsyncLLM
from deepinfer.engine.frontends.async_process import AsyncLLMProcess
from deepinfer.engine.serve import NOT_SUPPORTED_YET, build_app
from deepinfer.sched import PrefixCacheStats

MODEL = "tiny"


@dataclass
class Served:
    base_url: str
    llm: AsyncLLMProcess
    server: uvicorn.Server
    thread: threading.Thread


def start_server(llm: EngineClient, **app_kwargs: object) -> Served:
    """Serve `llm` on 127.0.0.1 on a free port, in a thread (the socket is bound before uvicorn starts)."""
    url, server, thread = start_uvicorn(build_app(llm, served_model_name=MODEL, **app_kwargs))
    return Served(url, llm, server, thread)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    llm = AsyncLLMProcess(EngineArgs(seed=0, stop_preempted_request=False))
    result = start_server(llm)
    yield result
    result.server.should_exit = True
    result.thread.join(timeout=30)
    assert not result.llm.is_running and result.llm.failure is None   # the app's shutdown stopped the engine
    with pytest.raises(ProcessLookupError):                          # and its process is gone, reaped
        os.kill(llm.pid, 0)


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    """Raw HTTP to the server, one connection pool for the module."""
    with httpx.Client(base_url=served.base_url, timeout=60) as session:
        yield session


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        whole.usage.prompt_tokens, 12, whole.usage.prompt_tokens + 12)
    chunks = list(client.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(client: openai.OpenAI,
                                                                      http: httpx.Client) -> None:
    prompt = list(range(10, 150))            # 140 tokens: cached up to its last 64-token block boundary
    first = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 128
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 128
    metrics = http.get("/metrics").text
    hits = next(line for line in metrics.splitlines() if line.startswith("deepinfer_prefix_cache_hits_total"))
    assert float(hits.split()[-1]) >= 256


def test_token_id_prompt_and_seeded_sampling_are_reproducible(client: openai.OpenAI, http: httpx.Client) -> None:
    text = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=6, temperature=0).choices[0].text
    ids = http.post("/v1/completions", json={"prompt": [3791, 362], "max_tokens": 4}).json()
    assert ids["usage"]["prompt_tokens"] == 2 and ids["choices"][0]["text"]
    runs = [client.completions.create(model=MODEL, prompt="import os\n", max_tokens=6, temperature=1.0, seed=7)
            .choices[0].text for _ in range(2)]
    assert runs[0] == runs[1] and text


def test_chat_uses_the_plain_template_and_streams_the_same_text(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_in_both_shapes(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x ="}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3
    for entry in entries:      # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode() == entry.token
    text = client.completions.create(model=MODEL, prompt="x =", max_tokens=3, temperature=0, logprobs=1)
    logprobs = text.choices[0].logprobs
    assert "".join(logprobs.tokens) == text.choices[0].text
    assert logprobs.text_offset == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0]) + len(logprobs.tokens[1])]
    assert all(len(top) == 1 for top in logprobs.top_logprobs)


def test_response_format_json_schema_output_validates(client: openai.OpenAI, http: httpx.Client) -> None:
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a person"}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    vllm = http.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}}).json()
    assert vllm["choices"][0]["text"] in ("yes", "no")


def test_models_health_version_metrics(http: httpx.Client) -> None:
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 4096
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    text = http.get("/metrics").text
    for name in ("deepinfer_request_success_total", "deepinfer_num_requests_running", "deepinfer_num_requests_waiting",
                 "deepinfer_kv_cache_usage_perc", "deepinfer_prompt_tokens_total", "deepinfer_generation_tokens_total",
                 "deepinfer_time_to_first_token_seconds_bucket", "deepinfer_inter_token_latency_seconds_bucket",
                 "deepinfer_e2e_request_latency_seconds_bucket", "deepinfer_prefix_cache_queries_total",
                 "deepinfer_prefix_cache_hits_total"):
        assert name in text


# A value each field would need to mean something: the server must refuse it, naming the field.
UNSUPPORTED_VALUES = {"length_penalty": 0.5, "use_beam_search": True}


@pytest.mark.parametrize("field", sorted(NOT_SUPPORTED_YET))
def test_unimplemented_fields_are_refused_not_ignored(http: httpx.Client, field: str) -> None:
    body = {"prompt": "x", "max_tokens": 1, field: UNSUPPORTED_VALUES[field]}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == field and "not supported yet" in error["message"]
    neutral = http.post("/v1/completions", json={**body, field: None})
    assert neutral.status_code == 200


@pytest.mark.parametrize(("path", "body", "param"), [
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("completions", {"prompt": "x", "typo_field": 1}, "typo_field"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [10**9]}, "prompt"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ("completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.schema"),
    ("completions", {"prompt": "x", "structured_outputs": {"json": 5}}, "structured_outputs"),
    ("completions", {"prompt": "x" * 20000}, "prompt"),
    ("completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"prompt": "x", "bad_words": "x"}, "bad_words"),
    ("completions", {"prompt": "x", "skip_special_tokens": 1}, "skip_special_tokens"),
    ("completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "echo": True}, "echo"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "mood": 1}]}, "messages[0].mood"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0].function"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],        # no --enable-auto-tool-choice
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": 1}},
     "chat_template_kwargs"),
])
def test_bad_requests_get_400_naming_the_field_and_the_server_goes_on(http: httpx.Client, path: str, body: object,
                                                                      param: str | None) -> None:
    url = f"/v1/{path}"
    reply = http.post(url, content=body) if isinstance(body, bytes) else http.post(url, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"


def test_api_key_is_checked(served: Served) -> None:
    async def run() -> tuple[int, int, int]:
        app = build_app(served.llm, served_model_name=MODEL, api_key="sesame")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            missing = await http.get("/v1/models")
            wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
            right = await http.get("/v1/models", headers={"Authorization": "Bearer sesame"})
            assert (await http.get("/health")).status_code == 200       # not under /v1: no key needed
            assert missing.json()["error"]["type"] == "authentication_error"
            return missing.status_code, wrong.status_code, right.status_code

    assert asyncio.run(run()) == (401, 401, 200)


class _HeldEngine:
    """An engine stand-in whose step blocks until released: requests stay waiting, deterministically."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.requests: list[str] = []
        self.scheduler = SimpleNamespace(num_running=0, prefix_cache_stats=PrefixCacheStats())
        self.kv_blocks = SimpleNamespace(num_free=9, num_blocks=10)
        self.tokenizer, self.model_dir, self.max_model_len = None, ".", 64
        self.args = SimpleNamespace(model=".")
        self.kv_transfer = NullKVTransfer()

    def add_request(self, request_id: str, prompt: object, params: object) -> None:
        self.requests.append(request_id)

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.release.wait()
        done, self.requests = self.requests, []
        return [RequestOutput(rid, None, [1], [CompletionOutput(0, "ok", [2], "length")], True) for rid in done]


def test_a_full_waiting_queue_answers_503_then_serves_again() -> None:
    engine = _HeldEngine()
    llm = AsyncLLM(engine, max_num_waiting=2)  # type: ignore[arg-type]
    app = build_app(llm, served_model_name=MODEL)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            post = lambda: http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})  # noqa: E731
            waiting = [asyncio.create_task(post()) for _ in range(2)]
            while llm.num_unfinished < 2:
                await asyncio.sleep(0.001)
            full = await post()
            engine.release.set()
            done = await asyncio.gather(*waiting)      # the queue empties as they finish
            return [*done, full, await post()]

    first, second, full, again = asyncio.run(run())
    assert (first.status_code, second.status_code, full.status_code, again.status_code) == (200, 200, 503, 200)
    assert full.json()["error"]["code"] == "queue_full" and full.json()["error"]["type"] == "server_error"
    asyncio.run(llm.shutdown())


def test_n_choices_greedy_identical_seeded_distinct_and_reproducible(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=8, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 24
    seeded = [client.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=8, temperature=1.0, seed=3,
                                        n=3, best_of=3) for _ in range(2)]
    texts = [[c.text for c in s.choices] for s in seeded]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3
    chunks = list(client.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=8, temperature=1.0,
                                            seed=3, n=3, stream=True))
    assert all(len(c.choices) == 1 for c in chunks)            # one choice per chunk, interleaved
    order = [c.choices[0].index for c in chunks]
    assert order != sorted(order)
    for index in range(3):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == texts[0][index]
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=4, temperature=0, n=2, stream=True))
    assert [c.choices[0].delta.role for c in chat[:2]] == ["assistant", "assistant"]
    assert sorted(c.choices[0].index for c in chat if c.choices[0].finish_reason) == [0, 1]


def test_penalties_bias_and_bans_change_the_tokens(served: Served, client: openai.OpenAI) -> None:
    tokenizer = served.llm.model.tokenizer

    def ids(**kwargs: object) -> list[int]:
        reply = client.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=16, temperature=0,
                                          logprobs=0, **kwargs)
        return [tokenizer.token_to_id(t) if tokenizer.token_to_id(t) is not None else tokenizer.encode(
            t, add_special_tokens=False)[0] for t in reply.choices[0].logprobs.tokens]

    plain = ids()
    assert ids(logit_bias={"270": 100}) == [270] * 16
    assert ids(logit_bias={str(t): -100 for t in set(plain)})[0] not in plain
    penalised = ids(frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised != plain and len(set(penalised)) > len(set(plain))
    assert ids(extra_body={"repetition_penalty": 2.0}) != plain
    allowed = ids(extra_body={"allowed_token_ids": [83, 314]})
    assert set(allowed) <= {83, 314}
    single = tokenizer.decode([plain[0]])
    assert ids(extra_body={"bad_words": [single]})[0] != plain[0]


def test_prompt_logprobs_whole_and_streamed(served: Served, http: httpx.Client) -> None:
    body = {"prompt": [3791, 362, 1589, 314], "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2, "n": 2}
    whole = http.post("/v1/completions", json=body).json()
    for choice in whole["choices"]:
        entries = choice["prompt_logprobs"]
        assert len(entries) == 4 and entries[0] is None
        for token_id, entry in zip(body["prompt"][1:], entries[1:]):
            mine = entry[str(token_id)]
            assert mine["logprob"] <= 0 and mine["rank"] >= 1
            assert mine["decoded_token"] == served.llm.model.tokenizer.decode([token_id], skip_special_tokens=False)
            assert min(e["rank"] for e in entry.values()) == 1 and len(entry) in (2, 3)
    lines = http.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    firsts = {}
    for chunk in chunks:
        firsts.setdefault(chunk["choices"][0]["index"], chunk["choices"][0])
    assert sorted(firsts) == [0, 1]
    assert all(first["prompt_logprobs"] == whole["choices"][0]["prompt_logprobs"] for first in firsts.values())
    assert sum("prompt_logprobs" in c["choices"][0] for c in chunks) == 2


def test_the_common_chunk_is_written_as_the_general_path_writes_it() -> None:
    from deepinfer.engine.core.outputs import running_output
    from deepinfer.engine.serve.protocol import parse_chat, parse_completion
    from deepinfer.engine.serve.responses import ResponseWriter, sse

    for chat, req in ((False, parse_completion({"prompt": [1], "stream": True})),
                      (True, parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True}))):
        writer = ResponseWriter("cmpl-1", MODEL, chat, req, None)
        for text in (" foo", 'a"b\\c\n\u00e9\u4e2d \U0001F600', "</s>"):
            choice: dict[str, object] = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            choice.update(logprobs=None, finish_reason=None)
            assert list(writer.delta(running_output("r", None, [1], text, [5], None))) == [sse(writer._chunk(choice))]
