"""quickdraft.server: bad input never hurts the server (over 400 lines: one row per bad input).

Every case gets its OpenAI-shaped error with the right status (400 not 422, 401, 404, 413, 503 +
Retry-After), and after every one the next valid request is served correctly. Real server on
loopback, real `openai` client (max_retries=0); raw httpx only where the client cannot produce
the bad input (broken JSON, a body that is not an object, a chunked body).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import LoadedModel, load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer

KEY = "sk-test-key"
BODY_LIMIT = 64 * 1024
JSON_HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


@pytest.fixture(scope="module")
def srv(lm: LoadedModel) -> Iterator[BackgroundServer]:
    engine = Engine({"tiny": ServedModel(lm)}, max_waiting=8)
    engine.start()
    config = ServerConfig(api_key=KEY, max_concurrency=1, max_body_bytes=BODY_LIMIT)
    with BackgroundServer(create_app(engine, config)) as server:
        yield server
    engine.stop()


@pytest.fixture(scope="module")
def client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def assert_served(client: openai.OpenAI) -> None:
    """The next valid request is served correctly."""
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length" and r.usage is not None
    assert r.usage.completion_tokens == 3


def msgs(text: str = "hi") -> list[Any]:
    return [{"role": "user", "content": text}]


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def part(text: Any) -> dict[str, Any]:
    return user([{"type": "text", "text": text}])


CONTENT = "messages[0].content"
# a 1 x 1 PNG as a data: URL
IMAGE = {
    "type": "image_url",
    "image_url": {
        "url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4"
        "nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    },
}
TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
}


# (id, endpoint, request kwargs, expected param): each must be a 400 naming `param`
BAD_REQUESTS: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("missing-messages", "chat", {}, "messages"),
    ("empty-messages", "chat", {"messages": []}, "messages"),
    ("messages-not-a-list", "chat", {"messages": "hi"}, "messages"),
    ("bad-role", "chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("content-wrong-type", "chat", {"messages": [{"role": "user", "content": 5}]}, CONTENT),
    # wrong shapes inside valid JSON name the field, not "the body must be a JSON object"
    ("message-not-an-object", "chat", {"messages": [123]}, "messages[0]"),
    ("message-a-list", "chat", {"messages": [msgs(), msgs()]}, "messages[0]"),
    ("content-part-text-not-string", "chat", {"messages": [part(5)]}, CONTENT + "[0].text"),
    ("content-part-not-object", "chat", {"messages": [user(["x"])]}, CONTENT + "[0]"),
    (
        "content-part-unknown-type",
        "chat",
        {"messages": [user([{"type": "audio"}])]},
        CONTENT + "[0]",
    ),
    # OpenAI answers these 400 naming the field; they were once answered 200
    ("user-without-content", "chat", {"messages": [{"role": "user"}]}, CONTENT),
    (
        "assistant-null-content-no-tool-calls",
        "chat",
        {
            "messages": [
                *msgs(),
                {"role": "assistant", "content": None, "tool_calls": []},
                *msgs(),
            ]
        },
        "messages[1].content",
    ),
    ("image-to-text-model", "chat", {"messages": [user([IMAGE])]}, CONTENT + "[0].image_url"),
    ("stop-object", "chat", {"messages": msgs(), "stop": {"a": 1}}, "stop"),
    ("stop-list-of-ints", "chat", {"messages": msgs(), "stop": [1]}, "stop[0]"),
    ("prompt-object", "completion", {"prompt": {"a": 1}}, "prompt"),
    ("temperature-list", "chat", {"messages": msgs(), "temperature": [1]}, "temperature"),
    (
        "stream-options-not-object",
        "chat",
        {"messages": msgs(), "stream": True, "stream_options": 5},
        "stream_options",
    ),
    ("temperature-string", "chat", {"messages": msgs(), "temperature": "0.5"}, "temperature"),
    ("temperature-negative", "chat", {"messages": msgs(), "temperature": -0.1}, "temperature"),
    ("temperature-above-2", "chat", {"messages": msgs(), "temperature": 2.5}, "temperature"),
    ("top-p-zero", "chat", {"messages": msgs(), "top_p": 0}, "top_p"),
    ("top-p-above-1", "chat", {"messages": msgs(), "top_p": 1.5}, "top_p"),
    ("max-tokens-zero", "chat", {"messages": msgs(), "max_tokens": 0}, "max_tokens"),
    ("max-tokens-string", "chat", {"messages": msgs(), "max_tokens": "10"}, "max_tokens"),
    ("max-tokens-beyond-context", "chat", {"messages": msgs(), "max_tokens": 600}, "max_tokens"),
    ("prompt-beyond-context", "completion", {"prompt": "x" * 600}, "prompt"),
    ("stop-empty-list", "chat", {"messages": msgs(), "stop": []}, "stop"),
    ("stop-five-strings", "chat", {"messages": msgs(), "stop": list("abcde")}, "stop"),
    ("stop-empty-string", "chat", {"messages": msgs(), "stop": [""]}, "stop"),
    ("n-17", "chat", {"messages": msgs(), "n": 17}, "n"),
    ("n-beyond-concurrency", "chat", {"messages": msgs(), "n": 2}, "n"),
    ("best-of-below-n", "completion", {"prompt": "a", "n": 2, "best_of": 1}, "best_of"),
    ("stream-options-without-stream", "chat", {"messages": msgs(), "stream_options": {}}, None),
    ("stream-not-bool", "chat", {"messages": msgs(), "stream": "yes"}, "stream"),
    ("unknown-field", "chat", {"messages": msgs(), "frobnicate": 1}, "frobnicate"),
    (
        "presence-penalty-above-2",
        "chat",
        {"messages": msgs(), "presence_penalty": 2.5},
        "presence_penalty",
    ),
    (
        "frequency-penalty-below-2",
        "chat",
        {"messages": msgs(), "frequency_penalty": -3},
        "frequency_penalty",
    ),
    (
        "repetition-penalty-zero",
        "chat",
        {"messages": msgs(), "repetition_penalty": 0},
        "repetition_penalty",
    ),
    (
        "logit-bias-out-of-range",
        "chat",
        {"messages": msgs(), "logit_bias": {"5": 101}},
        "logit_bias",
    ),
    ("logit-bias-not-an-id", "chat", {"messages": msgs(), "logit_bias": {"a": 1}}, "logit_bias"),
    (
        "logit-bias-beyond-vocab",
        "chat",
        {"messages": msgs(), "logit_bias": {"99999": 1}},
        "logit_bias",
    ),
    (
        "top-logprobs-21",
        "chat",
        {"messages": msgs(), "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    (
        "top-logprobs-without-logprobs",
        "chat",
        {"messages": msgs(), "top_logprobs": 2},
        "top_logprobs",
    ),
    ("completion-logprobs-21", "completion", {"prompt": "a", "logprobs": 21}, "logprobs"),
    (
        "schema-invalid",
        "chat",
        {
            "messages": msgs(),
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}},
            },
        },
        "response_format",
    ),
    (
        "schema-missing",
        "chat",
        {
            "messages": msgs(),
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        "response_format",
    ),
    (
        "format-unknown-type",
        "chat",
        {"messages": msgs(), "response_format": {"type": "yaml"}},
        "response_format.type",
    ),
    (
        "regex-invalid",
        "chat",
        {"messages": msgs(), "structured_outputs": {"regex": "a(b"}},
        "structured_outputs",
    ),
    (
        "structured-two-kinds",
        "chat",
        {"messages": msgs(), "structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}},
        "structured_outputs",
    ),
    (
        "tool-choice-unknown-name",
        "chat",
        {
            "messages": msgs(),
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "tool_choice",
    ),
    (
        "tool-choice-without-tools",
        "chat",
        {"messages": msgs(), "tool_choice": "required"},
        "tool_choice",
    ),
    (
        "tool-name-invalid",
        "chat",
        {"messages": msgs(), "tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
    ),
    (
        "tool-message-without-id",
        "chat",
        {"messages": [*msgs(), {"role": "tool", "content": "1"}]},
        "messages[1].tool_call_id",
    ),
    ("completion-empty-prompt", "completion", {"prompt": ""}, "prompt"),
    ("completion-two-prompts", "completion", {"prompt": ["a", "b"]}, "prompt"),
    ("completion-token-out-of-vocab", "completion", {"prompt": [1, 99999]}, "prompt"),
]


@pytest.mark.parametrize(
    ("endpoint", "kwargs", "param"),
    [pytest.param(e, k, p, id=i) for i, e, k, p in BAD_REQUESTS],
)
def test_server_bad_request_is_400_then_serves(
    client: openai.OpenAI, endpoint: str, kwargs: dict[str, Any], param: str | None
) -> None:
    body = {"model": "tiny", **kwargs}
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    with pytest.raises(openai.BadRequestError) as exc:
        client.post(path, body=body, cast_to=httpx.Response)
    err = exc.value
    assert err.status_code == 400 and err.type == "invalid_request_error"
    assert isinstance(err.body, dict) and set(err.body) == {"message", "type", "param", "code"}
    assert err.body["message"]
    if param is not None:
        assert err.param == param and param in err.body["message"]
    assert_served(client)


# Lone surrogates (valid JSON, not valid Unicode) in string fields: a 400 naming the field, never
# a 500. Sent as raw bytes (the openai client cannot encode them) both ways JSON can carry them.
S = "\ud800"
SURROGATES: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("content", "chat", {"messages": msgs("a" + S)}, CONTENT),
    ("content-part", "chat", {"messages": [part(S + "b")]}, CONTENT + "[0].text"),
    ("name", "chat", {"messages": [{**user("x"), "name": S}]}, "messages[0].name"),
    ("role", "chat", {"messages": [user("x") | {"role": S}]}, "messages[0].role"),
    ("stop", "chat", {"messages": msgs(), "stop": S}, "stop"),
    ("stop-list", "chat", {"messages": msgs(), "stop": ["a", "\udfff"]}, "stop[1]"),
    ("user", "chat", {"messages": msgs(), "user": S}, "user"),
    ("model", "chat", {"messages": msgs(), "model": S}, "model"),
    ("unknown-key", "chat", {"messages": msgs(), S: 1}, None),
    ("prompt", "completion", {"prompt": S}, "prompt"),
    ("prompt-list", "completion", {"prompt": [S]}, "prompt[0]"),
]


@pytest.mark.parametrize(
    ("endpoint", "body", "param"), [pytest.param(e, b, p, id=i) for i, e, b, p in SURROGATES]
)
@pytest.mark.parametrize("encoding", ["escaped", "utf8-bytes"])
def test_server_lone_surrogate_is_400_naming_the_field(
    srv: BackgroundServer,
    client: openai.OpenAI,
    endpoint: str,
    body: dict[str, Any],
    param: str | None,
    encoding: str,
) -> None:
    data = {"model": "tiny", "max_tokens": 2, **body}
    if encoding == "escaped":  # json.dumps' default: ASCII, "\\ud800"
        content = json.dumps(data).encode()
    else:  # the surrogate itself, UTF-8 encoded (ED A0 80)
        content = json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass")
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(srv.url + path, content=content, headers=JSON_HEADERS)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "Unicode" in err["message"]
    assert err["param"] == param
    assert_served(client)


def test_server_internal_error_carries_no_exception_text(lm: LoadedModel) -> None:
    """A bug in a route is a 500 saying so, without the exception's text (which can hold paths,
    data or internals); the log keeps it. The bug: a route added to the real app for this."""
    engine = Engine({"tiny": ServedModel(lm)})
    app = create_app(engine)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret /srv/models/key.txt")

    with BackgroundServer(app) as server:
        r = httpx.get(server.url + "/boom")
    assert r.status_code == 500
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "secret" not in r.text and "RuntimeError" not in r.text


def test_server_stream_options_error_names_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="tiny", messages=msgs(), stream_options={"include_usage": True}
        )
    assert exc.value.param == "stream_options"
    assert_served(client)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param(b'{"model": "tiny", "messages": [', "invalid JSON", id="broken-json"),
        pytest.param(b'["a", "b"]', "JSON object", id="not-an-object"),
        pytest.param(b"", "", id="empty-body"),
    ],
)
def test_server_unparseable_body_is_400(
    srv: BackgroundServer, client: openai.OpenAI, content: bytes, expected: str
) -> None:
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        content=content,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert expected in r.json()["error"]["message"]
    assert_served(client)


def test_server_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-9", messages=msgs())
    assert exc.value.code == "model_not_found" and exc.value.param == "model"
    assert_served(client)


@pytest.mark.parametrize("key", [None, "wrong"], ids=["no-key", "wrong-key"])
def test_server_api_key_required(
    srv: BackgroundServer, client: openai.OpenAI, key: str | None
) -> None:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    for path in ("/v1/models", "/v1/chat/completions"):
        r = httpx.post(srv.url + path, json={}, headers=headers)
        if path == "/v1/models":
            r = httpx.get(srv.url + path, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    if key is not None:  # the client itself refuses to send without a key
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="tiny", messages=msgs())
    assert httpx.get(srv.url + "/health").status_code == 200  # not behind the key
    assert_served(client)


def test_server_body_over_limit_is_413(srv: BackgroundServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model="tiny", messages=msgs("x" * BODY_LIMIT))
    assert exc.value.status_code == 413 and exc.value.code == "request_too_large"
    assert_served(client)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 4096 + 1):
            yield b"y" * 4096
        yield b'"}]}'

    r = httpx.post(
        srv.url + "/v1/chat/completions",
        content=chunks(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert_served(client)


def test_server_over_concurrency_limit_is_503_with_retry_after(
    srv: BackgroundServer, client: openai.OpenAI
) -> None:
    # max_concurrency=1: a stream in progress holds the only slot
    stream = client.chat.completions.create(
        model="tiny",
        messages=msgs(),
        max_tokens=400,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # admitted and running
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            client.chat.completions.create(model="tiny", messages=msgs(), max_tokens=2)
        assert exc.value.status_code == 503 and exc.value.code == "server_busy"
        assert exc.value.response.headers["retry-after"] == "1"
    finally:
        stream.close()
    for _ in range(200):  # the slot comes back once the server has seen the disconnect
        try:
            assert_served(client)
            break
        except openai.InternalServerError:
            time.sleep(0.02)
    else:
        pytest.fail("the slot of the cancelled stream was never released")


def test_server_engine_queue_full_is_503_with_retry_after(lm: LoadedModel) -> None:
    engine = Engine({"tiny": ServedModel(lm)}, max_waiting=0)  # every submit finds it full
    engine.start()
    try:
        with BackgroundServer(create_app(engine)) as server:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.InternalServerError) as exc:
                c.completions.create(model="tiny", prompt="hi", max_tokens=2)
            assert exc.value.status_code == 503 and exc.value.code == "queue_full"
            assert exc.value.response.headers["retry-after"] == "1"
    finally:
        engine.stop()
