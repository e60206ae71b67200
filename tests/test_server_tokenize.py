"""vLLM's /tokenize and /detokenize on a real server on loopback (httpx): the ids a prompt or a
conversation becomes are the ids a completion of it reads (its usage counts them), ids read
back give the text, and bad bodies are 400s naming the field."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


@pytest.fixture(scope="module")
def url(lm: LoadedModel) -> Iterator[str]:
    engine = Engine({"tiny": ServedModel(lm)}, max_waiting=8)
    engine.start()
    with BackgroundServer(create_app(engine, ServerConfig())) as srv:
        yield srv.url
    engine.stop()


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=30)


def test_tokenize_a_prompt_as_completions_reads_it(url: str, lm: LoadedModel) -> None:
    text = "def f(x):\n    return x  <|im_end|>"
    got = post(url, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == lm.tokenizer.encode(text, parse_special=False)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == lm.context_length
    assert got["token_strs"] == [lm.tokenizer.vocab_entry(t) for t in got["tokens"]]
    special = post(url, "/tokenize", {"prompt": text, "parse_special_tokens": True}).json()
    assert special["count"] < got["count"]  # <|im_end|> as one token
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model="tiny", prompt=text, max_tokens=1)
    assert r.usage is not None and r.usage.prompt_tokens == got["count"]
    assert post(url, "/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": text}


def test_tokenize_a_conversation_as_chat_completions_reads_it(url: str) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]
    got = post(url, "/tokenize", {"messages": messages}).json()
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == got["count"]
    bare = post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == got["tokens"][: bare["count"]] and bare["count"] < got["count"]
    text = post(url, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"]
    assert "hello there" in text and "<|im_start|>" in text  # specials kept as text


def test_tokenize_refuses_bad_bodies(url: str) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    cases = [
        ("/tokenize", {"messages": [{"role": "user", "content": [image]}]}, "messages[0]"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, None),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
    ]
    for path, body, param in cases:
        r = post(url, path, body)
        assert r.status_code == 400, (path, body, r.text)
        if param is not None:
            assert r.json()["error"]["param"].startswith(param), r.json()
    assert post(url, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
