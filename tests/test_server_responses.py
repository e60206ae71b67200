"""OpenAI's Responses API (server/responses_api.py) on a real server on loopback, driven by the
real `openai` client's `responses.create`: the text, usage and status of a response equal the
chat completion of the same conversation (n-gram speculation on), streamed events add up to
it, instructions and replayed items are the chat's system message and turns, a forced tool
call comes back as a function_call item (and its result goes back in), what the server cannot
do is refused by name. The reasoning item is checked on the adapter with a chat answer that
has one (gpt-oss's analysis channel)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer
from quickdraft.server.responses_api import ResponsesRequest, response_body, response_events

NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """The tiny model with a 4k context (a tool definition takes ~600 byte tokens)."""
    from conftest import make_tiny_hf_model, write_tiny_tokenizer

    directory = tmp_path_factory.mktemp("tiny-responses")
    make_tiny_hf_model("qwen2", directory, seed=3, max_position_embeddings=4096)
    write_tiny_tokenizer(directory)
    lm = load(str(directory), "fp32", progress=False)
    engine = Engine({"tiny": ServedModel(lm, NGRAM)}, max_waiting=16)
    engine.start()
    with BackgroundServer(create_app(engine, ServerConfig())) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    engine.stop()


def test_response_equals_the_chat_completion(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "say something"},
        ],
        max_tokens=12,
        temperature=0,
    )
    r = client.responses.create(
        model="tiny",
        instructions="be brief",
        input="say something",
        max_output_tokens=12,
        temperature=0,
        metadata={"k": "v"},
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    stopped = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if stopped == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.metadata == {"k": "v"} and r.instructions == "be brief"


def test_streamed_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model="tiny", input="count to ten", max_output_tokens=16)
    whole = client.responses.create(temperature=0, **args)
    events = list(client.responses.create(temperature=0, stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = events[-1].response  # type: ignore[union-attr]
    assert done.output_text == whole.output_text and done.status == whole.status
    assert done.usage is not None and whole.usage is not None
    assert done.usage.output_tokens == whole.usage.output_tokens
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kinds.count(kind) == 1, kind


def test_items_replay_a_conversation_as_chat_turns(client: openai.OpenAI) -> None:
    turns: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hi there"}]},
        {"role": "user", "content": "and now?"},
    ]
    r = client.responses.create(model="tiny", input=turns, max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"},
            {"role": "user", "content": "and now?"},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content


def test_a_forced_tool_call_is_a_function_call_item(client: openai.OpenAI) -> None:
    """tool_choice required: the chat path's call as a function_call item, streamed the same;
    its output goes back as a function_call_output item and the model answers."""
    args: dict[str, Any] = dict(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=120,
        temperature=0,
    )
    r = client.responses.create(**args)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    events = list(client.responses.create(stream=True, **args))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == calls[0].arguments
    streamed = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in streamed if i.type == "function_call"] == [
        (calls[0].name, calls[0].arguments)
    ]
    call = calls[0]
    follow: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'},
    ]
    final = client.responses.create(
        model="tiny", input=follow, tools=[WEATHER], max_output_tokens=16, temperature=0
    )
    assert final.status in ("completed", "incomplete") and final.output


def test_what_the_server_cannot_do_is_refused_by_name(client: openai.OpenAI) -> None:
    for bad, param in [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"input": []}, "input"),
    ]:
        body: dict[str, Any] = {"model": "tiny", "input": "hi", **bad}
        with pytest.raises(openai.BadRequestError) as err:
            client.post("/responses", body=body, cast_to=object)
        assert param in json.dumps(err.value.body), (bad, err.value.body)


def test_reasoning_and_calls_become_items() -> None:
    """A chat answer with gpt-oss's analysis channel and a tool call: a reasoning item, the
    message, the function_call, in that order; streamed, the reasoning text comes first."""
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = {
        "model": "m",
        "choices": [
            {
                "message": {
                    "content": "answer",
                    "reasoning_content": "think",
                    "tool_calls": [call],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }
    body = response_body(chat, req)
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][0]["content"][0]["text"] == "think"
    assert body["output"][2]["call_id"] == "call_1" and body["status"] == "completed"
    chunks = [
        {"choices": [{"delta": {"reasoning_content": "thi"}}]},
        {"choices": [{"delta": {"reasoning_content": "nk"}}]},
        {"choices": [{"delta": {"content": "ans"}}]},
        {"choices": [{"delta": {"content": "wer"}, "finish_reason": "length"}]},
        {"choices": [], "usage": chat["usage"]},
    ]

    async def sse() -> Any:
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    async def collect() -> list[dict[str, Any]]:
        out = []
        async for e in response_events(sse(), req):
            out.append(json.loads(e.split("data: ", 1)[1]))
        return out

    events = asyncio.run(collect())
    deltas = [(e["type"], e["delta"]) for e in events if e["type"].endswith("_text.delta")]
    assert deltas == [
        ("response.reasoning_text.delta", "thi"),
        ("response.reasoning_text.delta", "nk"),
        ("response.output_text.delta", "ans"),
        ("response.output_text.delta", "wer"),
    ]
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert [i["type"] for i in last["response"]["output"]] == ["reasoning", "message"]
    assert last["response"]["usage"]["output_tokens"] == 5


def test_text_format_json_schema_is_the_chat_response_format(client: openai.OpenAI) -> None:
    """text.format json_schema: the output validates against the schema (the chat path's
    grammar) and equals the chat completion with that response_format."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Rome", "Oslo"]}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    prompt = '{"city": "Rome", "days": 3} {"city": "Oslo", '
    spec: Any = {"name": "trip", "schema": schema, "strict": True}
    fmt: Any = {"type": "json_schema", **spec}
    r = client.responses.create(
        model="tiny", input=prompt, text={"format": fmt}, max_output_tokens=64, temperature=0
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "trip", "schema": schema, "strict": True},
        },
        max_tokens=64,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


def test_parallel_function_call_items_are_one_assistant_turn() -> None:
    """Two function_call items in a row replay as one assistant message with both calls, their
    outputs as two tool messages, in order."""
    item: Any = {"type": "function_call", "name": "f", "arguments": "{}"}
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "go"},
            {**item, "call_id": "a"},
            {**item, "call_id": "b"},
            {"type": "function_call_output", "call_id": "a", "output": "1"},
            {"type": "function_call_output", "call_id": "b", "output": "2"},
        ],
    }
    chat = ResponsesRequest.model_validate(body).to_chat()
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "tool", "tool"]
    calls = chat.messages[1].tool_calls
    assert calls is not None and [c.id for c in calls] == ["a", "b"]
    assert [m.tool_call_id for m in chat.messages[2:]] == ["a", "b"]
