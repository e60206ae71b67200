"""Anthropic's Messages API on the chat path, through the real `anthropic` client against a real
server on loopback: an answer equals the chat completion of the same conversation (text, token
counts), with n-gram speculation on and off; the stream adds up to it; tool_use blocks carry the
chat's tool call and come back as a conversation; stop sequences, structured output,
count_tokens; `x-api-key`; errors in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import make_tiny_hf_model, write_tiny_tokenizer

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import LoadedModel, load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer

GREEDY = {"temperature": 0}  # Anthropic's default is 1; its newest client sends none
SYSTEM = "be brief"
ASK = [{"role": "user", "content": "hello there, what is 2 + 2?"}]
TOOLS = [
    {
        "name": "lookup",
        "description": "look a word up",
        "input_schema": {
            "type": "object",
            "properties": {"word": {"enum": ["cat", "dog"]}},  # a call the grammar ends soon
            "required": ["word"],
        },
    }
]


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("messages")  # a context that holds the Hermes tool prompt
    make_tiny_hf_model("qwen2", root, seed=3, max_position_embeddings=4096)
    write_tiny_tokenizer(root)
    return load(str(root), "fp32", progress=False)


@pytest.fixture(scope="module")
def url(lm: LoadedModel) -> Iterator[str]:
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    engine = Engine({"off": ServedModel(lm), "ngram": ServedModel(lm, ngram)})
    engine.start()
    with BackgroundServer(create_app(engine, ServerConfig(api_key="k1"))) as srv:
        yield srv.url
    engine.stop()


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="k1", max_retries=0)


@pytest.fixture(scope="module")
def chat(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)


def as_chat(system: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, *messages]


@pytest.mark.parametrize("model", ["off", "ngram"])
def test_answer_equals_the_chat_completion(
    client: anthropic.Anthropic, chat: openai.OpenAI, model: str
) -> None:
    got = client.messages.create(
        model=model,
        max_tokens=16,
        system=SYSTEM,
        messages=ASK,
        extra_body=GREEDY,
    )
    want = chat.chat.completions.create(
        model=model,
        messages=as_chat(SYSTEM, ASK),
        max_tokens=16,
        temperature=0,
    )
    assert got.id.startswith("msg_") and got.type == "message" and got.role == "assistant"
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want.choices[0].message.content
    assert want.usage is not None
    u = got.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == want.usage.prompt_tokens
    assert u.output_tokens == want.usage.completion_tokens
    reason = "max_tokens" if want.choices[0].finish_reason == "length" else "end_turn"
    assert got.stop_reason == reason and got.stop_sequence is None
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == want.usage.prompt_tokens
    # the stream adds up to the same message
    with client.messages.stream(
        model=model,
        max_tokens=16,
        system=SYSTEM,
        messages=ASK,
        extra_body=GREEDY,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == got.content[0].text
    assert final.stop_reason == got.stop_reason
    assert final.usage.output_tokens == u.output_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == (
        want.usage.prompt_tokens
    )


def test_tool_use_round_trip(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    forced = {"type": "tool", "name": "lookup"}
    ask: dict[str, Any] = {
        "model": "off",
        "max_tokens": 160,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": forced,
        "extra_body": GREEDY,
    }
    got = client.messages.create(**ask)
    fn = {"type": "function", "function": {"name": "lookup"}}
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in TOOLS
    ]
    want = chat.chat.completions.create(
        model="off",
        messages=ASK,
        max_tokens=160,
        temperature=0,
        tools=tools,
        tool_choice=fn,
    )
    calls = want.choices[0].message.tool_calls
    assert calls and got.stop_reason == "tool_use"
    uses = [b for b in got.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (u.name, u.input) for u in uses
    ]
    # the answer goes back as the assistant's turn, the result as the user's: the same prompt
    # as the chat's assistant tool_calls + tool message
    turn = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in got.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "four"} for u in uses
            ]
            + [{"type": "text", "text": "and 3 + 3?"}],
        },
    ]
    counted = client.messages.count_tokens(model="off", messages=turn, tools=TOOLS)
    chat_turn = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump(exclude_none=True) for c in calls],
        },
        *[{"role": "tool", "tool_call_id": u.id, "content": "four"} for u in uses],
        {"role": "user", "content": "and 3 + 3?"},
    ]
    tokenized = httpx.post(
        str(client.base_url) + "/tokenize",
        json={"model": "off", "messages": chat_turn, "tools": tools},
        headers={"Authorization": "Bearer k1"},
    ).json()
    assert counted.input_tokens == tokenized["count"]
    again = client.messages.create(model="off", max_tokens=8, messages=turn, tools=TOOLS)
    assert again.usage.output_tokens >= 1


def test_stop_sequences_and_structured_output(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model="off", max_tokens=24, messages=ASK, extra_body=GREEDY)
    text = free.content[0].text
    at = next(i for i in range(2, len(text) - 1) if text.find(text[i : i + 2]) == i)
    word = text[at : at + 2]
    cut = client.messages.create(
        model="off",
        max_tokens=24,
        messages=ASK,
        stop_sequences=[word],
        extra_body=GREEDY,
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[:at]
    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 2, 3]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    shaped = client.messages.create(
        model="ngram",
        max_tokens=48,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        thinking={"type": "disabled"},
        cache_control={"type": "ephemeral"},
        extra_body=GREEDY,
    )
    assert shaped.stop_reason == "end_turn"
    assert json.loads(shaped.content[0].text) in ({"n": 1}, {"n": 2}, {"n": 3})


def test_errors_are_anthropic_shaped(client: anthropic.Anthropic, url: str) -> None:
    def error(body: dict[str, Any], status: int = 400, key: str = "k1") -> dict[str, Any]:
        r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": key})
        assert r.status_code == status, r.text
        got: dict[str, Any] = r.json()
        assert got["type"] == "error" and set(got["error"]) == {"type", "message"}
        return got["error"]

    base = {"model": "off", "max_tokens": 4, "messages": ASK}
    err = error({k: v for k, v in base.items() if k != "max_tokens"})
    assert err["type"] == "invalid_request_error" and err["message"].startswith("max_tokens")
    assert error({**base, "model": "nope"}, 404)["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    misplaced = [
        {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}
    ]
    assert "assistant" in error({**base, "messages": misplaced})["message"]
    assert error({**base, "stop_sequences": list("abcde")})["message"].startswith("stop_sequences")
    assert error({**base, "container": "c1"})["message"].startswith("container")
    assert error({**base, "messages": [{"role": "user", "content": [image]}]})["type"] == (
        "invalid_request_error"
    )  # a text-only model
    assert error(base, 401, key="bad")["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="bad", max_retries=0).messages.create(
            model="off",
            max_tokens=4,
            messages=ASK,
        )
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="off", max_tokens=0, messages=ASK)


def test_a_prefilled_answer_is_continued(client: anthropic.Anthropic, url: str) -> None:
    """A last assistant turn is a prefill: the model goes on from it (the prompt is the chat's
    with continue_final_message) and the answer holds only what it added."""
    turns = [*ASK, {"role": "assistant", "content": "The answer is"}]
    got = client.messages.create(model="off", max_tokens=8, messages=turns, extra_body=GREEDY)
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(
        url + "/tokenize",
        json={"model": "off", "messages": turns, **flags},
        headers={"Authorization": "Bearer k1"},
    ).json()
    u = got.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == ids["count"]
    want = httpx.post(
        url + "/v1/completions",
        json={"model": "off", "prompt": ids["tokens"], "max_tokens": 8, "temperature": 0},
        headers={"Authorization": "Bearer k1"},
    ).json()
    assert got.content[0].text == want["choices"][0]["text"]
