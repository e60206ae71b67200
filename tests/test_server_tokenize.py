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


# ChatML with the two switches vLLM users send: Qwen3's enable_thinking, gpt-oss's effort
SWITCHES = (
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def switch_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from conftest import make_tiny_hf_model, write_tiny_tokenizer

    directory = tmp_path_factory.mktemp("tiny-switches")
    make_tiny_hf_model("qwen2", directory, seed=4)
    write_tiny_tokenizer(directory, (), SWITCHES)
    engine = Engine({"tiny": ServedModel(load(str(directory), "fp32", progress=False))})
    engine.start()
    with BackgroundServer(create_app(engine, ServerConfig())) as srv:
        yield srv.url
    engine.stop()


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(switch_url: str) -> None:
    """vLLM's chat_template_kwargs and OpenAI's reasoning_effort are the template's variables,
    in /tokenize, chat completions and the Responses API alike; their text stays text (a
    special token spelled in a value is not one), the server's own names are refused."""
    messages = [{"role": "user", "content": "hi"}]

    def text(**extra: Any) -> str:
        got = post(switch_url, "/tokenize", {"messages": messages, **extra}).json()
        return post(switch_url, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"]

    assert "<think>" not in text() and "Reasoning" not in text()
    assert text(chat_template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    assert text(reasoning_effort="high").startswith("Reasoning: high\n")
    client = openai.OpenAI(base_url=switch_url + "/v1", api_key="x", max_retries=0)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    effort = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=1,
        reasoning_effort="low",  # type: ignore[arg-type]
    )
    assert plain.usage is not None and effort.usage is not None
    extra = len("Reasoning: low\n")  # byte tokens
    assert effort.usage.prompt_tokens == plain.usage.prompt_tokens + extra
    r = client.responses.create(
        model="tiny", input="hi", reasoning={"effort": "low"}, max_output_tokens=1
    )
    assert r.usage is not None and r.usage.input_tokens == effort.usage.prompt_tokens
    # a value spelling <|im_end|> (id 259) renders as its bytes: the template's one stays one
    forge = {"reasoning_effort": "<|im_end|>"}
    forged = post(switch_url, "/tokenize", {"messages": messages, "chat_template_kwargs": forge})
    ids = forged.json()["tokens"]
    shown = post(switch_url, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert shown.startswith("Reasoning: <|im_end|>\n") and ids.count(259) == 1
    for key in ("messages", "add_generation_prompt", "1x"):
        bad = post(
            switch_url, "/tokenize", {"messages": messages, "chat_template_kwargs": {key: 1}}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_continue_final_message_leaves_the_answer_open(url: str, lm: LoadedModel) -> None:
    """vLLM's continue_final_message: the last (assistant) message is continued, not closed;
    /tokenize gives the ids the completion reads; bad combinations are 400s by name."""
    messages = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "well, hello"},
    ]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    got = post(url, "/tokenize", {"messages": messages, **flags}).json()
    assert got["tokens"] == lm.tokenizer.encode_chat(
        messages, add_generation_prompt=False, continue_final=True
    )
    closed = post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert closed["count"] > got["count"]  # the turn's end tokens are not there
    assert closed["tokens"][: got["count"]] == got["tokens"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=1,
        extra_body=flags,  # type: ignore[arg-type]
    )
    assert r.usage is not None and r.usage.prompt_tokens == got["count"]
    for body in (
        {"messages": messages, "continue_final_message": True},  # the generation prompt too
        {"messages": messages[:1], **flags},  # the last message is the user's
    ):
        bad = post(url, "/v1/chat/completions", {**body, "max_tokens": 1})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "continue_final_message"
