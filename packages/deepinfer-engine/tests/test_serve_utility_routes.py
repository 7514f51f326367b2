"""What a vLLM user reaches for beside the OpenAI routes: /tokenize, /detokenize, /v1/models/{id},
/openapi.json and /docs; and what a new user hits first: max_tokens beyond the context and an unknown
chat role are 400s naming the numbers / the allowed roles. One server over the embedded model in a
thread (max_model_len 48)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from serve_helpers import start_uvicorn

from deepinfer.engine import EngineArgs, LLMEngine
from deepinfer.engine.frontends.async_llm import AsyncLLM
from deepinfer.engine.serve import build_app

MODEL = "tiny"
KEY = "sekret"


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    engine = LLMEngine(EngineArgs(device="cpu", seed=0, max_model_len=48, kv_cache_memory_mb=16))
    url, server, thread = start_uvicorn(build_app(AsyncLLM(engine), served_model_name=MODEL, api_key=KEY))
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as session:
        session.tokenizer, session.root = engine.tokenizer, url
        yield session
    server.should_exit = True
    thread.join(timeout=30)


def test_tokenize_and_detokenize_round_trip(http: httpx.Client) -> None:
    text = "def fibonacci(n):"
    reply = http.post("/tokenize", json={"prompt": text, "model": MODEL})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == http.tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 48
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": text}
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert plain == http.tokenizer.encode(text, add_special_tokens=False)
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == "user: hi\n\nassistant:"


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "mood": 1}, 400, "mood"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", [1, 2], 400, None),
])
def test_bad_tokenize_requests_name_the_field(http: httpx.Client, path: str, body: object, status: int,
                                              param: str | None) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_model_by_id_openapi_and_docs(http: httpx.Client) -> None:
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card == http.get("/v1/models").json()["data"][0] and card["id"] == MODEL
    missing = http.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{http.root}/v1/models/{MODEL}").status_code == 401          # the key is checked
    assert httpx.post(f"{http.root}/tokenize", json={"prompt": "x"}).status_code == 401
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
            "/v1/models/{model_id}"} <= set(paths)
    assert "swagger" in http.get("/docs").text.lower()


def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=f"{http.root}/v1", api_key=KEY, max_retries=0)
    num_prompt = len(http.tokenizer.encode("x"))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**9)
    error = caught.value.body
    assert error["param"] == "max_tokens"
    assert error["message"] == (f"max_tokens=1000000000 exceeds the {48 - num_prompt} tokens this request has room "
                                f"for: max_model_len=48 minus its {num_prompt} prompt tokens")
    fits = client.completions.create(model=MODEL, prompt="x", max_tokens=48 - num_prompt, temperature=0)
    assert fits.usage.completion_tokens <= 48 - num_prompt
    unbounded = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert unbounded.choices[0].finish_reason in ("stop", "length")      # no max_tokens: up to the context


def test_an_unknown_chat_role_is_a_400_naming_the_allowed_roles(http: httpx.Client) -> None:
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages[0].role"
    assert error["message"] == "messages[0].role='wizard' must be one of system, developer, user, assistant, tool"
