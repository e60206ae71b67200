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
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer
from quickdraft.server.protocol import APIError
from quickdraft.server.responses_api import (
    MessageItem,
    ResponsesRequest,
    response_body,
    response_events,
)
from quickdraft.server.responses_store import ResponseStore

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
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The tiny model with a 4k context (a tool definition takes ~600 byte tokens)."""
    from conftest import make_tiny_hf_model, write_tiny_tokenizer

    directory = tmp_path_factory.mktemp("tiny-responses")
    make_tiny_hf_model("qwen2", directory, seed=3, max_position_embeddings=4096)
    write_tiny_tokenizer(directory)
    lm = load(str(directory), "fp32", progress=False)
    engine = Engine({"tiny": ServedModel(lm, NGRAM)}, max_waiting=16)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[openai.OpenAI]:
    with BackgroundServer(create_app(engine, ServerConfig())) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


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
        ({"background": True, "stream": True, "store": False}, "background"),
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


def test_a_stored_response_is_retrieved_listed_and_deleted(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=8, temperature=0)
    assert r.store is True
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == r.status
    items = client.responses.input_items.list(r.id)
    assert len(items.data) == 1 and not items.has_more
    (item,) = items.data
    assert item.type == "message" and item.role == "user" and item.id.startswith("msg_")
    deleted = client.delete(f"/responses/{r.id}", cast_to=object)
    assert deleted == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    kept_not = client.responses.create(model="tiny", input="hi", max_output_tokens=4, store=False)
    assert kept_not.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept_not.id)


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    """A continuation equals the whole conversation sent again (the earlier instructions not
    carried over, as OpenAI's are not), streamed or not; its input items are that
    conversation, newest first unless asked otherwise, in pages."""
    args: dict[str, Any] = dict(model="tiny", max_output_tokens=8, temperature=0)
    first = client.responses.create(input="hello", instructions="be brief", **args)
    second = client.responses.create(input="and now?", previous_response_id=first.id, **args)
    assert second.previous_response_id == first.id and second.instructions is None
    turns: list[Any] = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "and now?"},
    ]
    replay = client.responses.create(input=turns, store=False, **args)
    assert second.output_text == replay.output_text
    items = client.responses.input_items.list(second.id, order="asc")
    texts = [(i.role, i.content[0].text) for i in items.data]  # type: ignore[union-attr]
    assert texts == [("user", "hello"), ("assistant", first.output_text), ("user", "and now?")]
    assert items.data[1].id == first.output[0].id  # the earlier output item, as it was
    newest = client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in newest.data] == [i.id for i in items.data[::-1][:2]]
    assert newest.has_more
    rest = client.responses.input_items.list(second.id, limit=2, after=newest.data[-1].id)
    assert [i.id for i in rest.data] == [items.data[0].id] and not rest.has_more

    events = list(
        client.responses.create(
            input="and then?", previous_response_id=second.id, stream=True, **args
        )
    )
    done = events[-1].response  # type: ignore[union-attr]
    assert done.store is True
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert client.responses.retrieve(done.id).output_text == streamed
    again = [*turns, {"role": "assistant", "content": second.output_text}]
    again.append({"role": "user", "content": "and then?"})
    assert streamed == client.responses.create(input=again, store=False, **args).output_text
    assert len(client.responses.input_items.list(done.id).data) == 5


def test_replayed_reasoning_items_are_taken_and_left_out(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model="tiny", max_output_tokens=6, temperature=0, store=False)
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": []}
    turns: list[Any] = [
        {"role": "user", "content": "hello"},
        thought,
        {"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        {"role": "user", "content": "more"},
    ]
    with_it = client.responses.create(input=turns, **args)
    without = client.responses.create(input=[t for t in turns if t is not thought], **args)
    assert with_it.output_text == without.output_text


def test_an_unknown_previous_response_is_404_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in json.dumps(err.value.body)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.input_items.list("resp_x", order="sideways")  # type: ignore[arg-type]
    assert "order" in json.dumps(bad.value.body)


def test_stored_responses_belong_to_their_api_key(engine: Engine) -> None:
    """Each API key sees only its own stored responses; a server that stores none refuses
    previous_response_id by name."""
    config = ServerConfig(api_key="key-a,key-b")
    with BackgroundServer(create_app(engine, config)) as srv:
        url = srv.url + "/v1"
        a = openai.OpenAI(base_url=url, api_key="key-a", max_retries=0)
        b = openai.OpenAI(base_url=url, api_key="key-b", max_retries=0)
        r = a.responses.create(model="tiny", input="hello", max_output_tokens=4)
        assert a.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model="tiny", input="hi", previous_response_id=r.id)
        with pytest.raises(openai.NotFoundError):
            b.delete(f"/responses/{r.id}", cast_to=object)
        assert a.responses.retrieve(r.id).id == r.id
    with BackgroundServer(create_app(engine, ServerConfig(responses_store_mb=0))) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = c.responses.create(model="tiny", input="hello", max_output_tokens=4)
        assert r.store is False
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model="tiny", input="hi", previous_response_id=r.id)
        assert "previous_response_id" in json.dumps(err.value.body)


def test_the_store_drops_the_least_recently_used_past_its_budget() -> None:
    item = MessageItem(role="user", content="x" * 100)

    def response(rid: str) -> dict[str, Any]:
        return {"id": rid, "object": "response", "output": []}

    one = len(json.dumps([[item.model_dump(exclude_none=True)], response("r1")]).replace(" ", ""))
    store = ResponseStore(3 * one)
    for rid in ("r1", "r2", "r3"):
        assert store.put(None, [item], response(rid))
    store.get("r1", None)  # used: r2 is now the oldest
    assert store.put(None, [item], response("r4"))
    assert len(store) == 3 and store.nbytes <= store.max_bytes
    with pytest.raises(APIError) as err:
        store.get("r2", None)
    assert err.value.status == 404
    assert store.get("r1", None).response["id"] == "r1"
    with pytest.raises(APIError):
        store.get("r1", 0)  # another key's
    huge = MessageItem(role="user", content="x" * (4 * one))
    assert not store.put(None, [huge], response("r5")) and len(store) == 3


def test_included_logprobs_are_the_chat_completions(client: openai.OpenAI) -> None:
    """include message.output_text.logprobs with top_logprobs: the output text's tokens with
    the chat path's logprobs and alternatives, streamed per delta the same."""
    args: dict[str, Any] = dict(model="tiny", input="count", max_output_tokens=6, temperature=0)
    logprobs: Any = ["message.output_text.logprobs"]
    r = client.responses.create(include=logprobs, top_logprobs=2, **args)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    got = r.output[0].content[0].logprobs  # type: ignore[union-attr]
    want = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert got is not None and want is not None and len(got) == len(want) > 0
    assert [g.token for g in got] == [w.token for w in want]
    # the same tokens; a logprob may differ in its last bits where one run verified a draft
    # row and the other stepped one row (fp32 torch here, not the batch-invariant kernels)
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], rel=1e-5)
    assert all(len(g.top_logprobs) == 2 for g in got) and r.top_logprobs == 2
    events = list(client.responses.create(include=logprobs, top_logprobs=2, stream=True, **args))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [s.token for s in streamed] == [g.token for g in got]
    assert [s.logprob for s in streamed] == pytest.approx([g.logprob for g in got], rel=1e-5)
    plain = client.responses.create(**args)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_the_other_request_fields_clients_send(client: openai.OpenAI) -> None:
    """What the OpenAI client may send is taken (a routing key, a tier, stream options, the
    default truncation, an include with nothing to add) or refused by name."""
    r = client.responses.create(
        model="tiny",
        input="hi",
        max_output_tokens=4,
        prompt_cache_key="session-1",
        safety_identifier="u-1",
        service_tier="auto",
        truncation="disabled",
        include=["reasoning.encrypted_content"],
        max_tool_calls=2,
        store=False,
    )
    assert r.status in ("completed", "incomplete") and r.truncation == "disabled"
    for bad, param in [
        ({"conversation": "conv_1"}, "conversation"),
        ({"include": ["nothing.we.know"]}, "include"),
    ]:
        body: dict[str, Any] = {"model": "tiny", "input": "hi", **bad}
        with pytest.raises(openai.BadRequestError) as err:
            client.post("/responses", body=body, cast_to=object)
        assert param in json.dumps(err.value.body), (bad, err.value.body)


def test_max_tool_calls_keeps_the_first_calls() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "max_tool_calls": 1})
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for i in range(3)
    ]
    chat = {
        "model": "m",
        "choices": [
            {"message": {"content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }
    body = response_body(chat, req)
    assert [i["call_id"] for i in body["output"]] == ["call_0"] and body["max_tool_calls"] == 1


def test_a_background_response_is_polled_and_cancelled(client: openai.OpenAI) -> None:
    """background: answered at once (queued, no output), run on, and found by GET with the
    answer a foreground request gets; a long one cancelled stays cancelled; what cannot run in
    the background is refused by name."""
    args: dict[str, Any] = dict(model="tiny", input="hello", max_output_tokens=8, temperature=0)
    fg = client.responses.create(**args)
    bg = client.responses.create(background=True, **args)
    assert bg.background is True and bg.status in ("queued", "in_progress") and not bg.output
    deadline = time.monotonic() + 60
    got = client.responses.retrieve(bg.id)
    while got.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
        got = client.responses.retrieve(bg.id)
    assert (got.id, got.status, got.output_text) == (bg.id, fg.status, fg.output_text)
    assert got.created_at == bg.created_at and got.usage is not None
    assert client.responses.cancel(bg.id).status == got.status  # it has ended: as it ended

    long = client.responses.create(
        model="tiny", input="count", max_output_tokens=3000, background=True
    )
    assert client.responses.cancel(long.id).status == "cancelled"
    time.sleep(0.2)
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(fg.id)  # not a background response
    for bad in ({"store": False}, {"store": False, "stream": True}):
        body: dict[str, Any] = {"model": "tiny", "input": "hi", "background": True, **bad}
        with pytest.raises(openai.BadRequestError) as err:
            client.post("/responses", body=body, cast_to=object)
        assert "background" in json.dumps(err.value.body), (bad, err.value.body)


def test_a_streamed_background_response_is_resumed(client: openai.OpenAI) -> None:
    """background + stream: the events stream as they come (the foreground stream's, under
    the queued response's id), are kept, and GET ?stream=true&starting_after=N replays them
    from N on, also after the response ended; a response that was not streamed in the
    background has nothing to resume."""
    args: dict[str, Any] = dict(model="tiny", input="hello", max_output_tokens=12, temperature=0)
    fg = client.responses.create(**args)
    events = list(client.responses.create(background=True, stream=True, **args))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == fg_done(fg)
    final = events[-1].response
    assert final.output_text == fg.output_text and final.background is True
    rid = final.id
    assert all(getattr(e, "response", final).id == rid for e in events)
    stored = client.responses.retrieve(rid)
    assert (stored.status, stored.output_text) == (final.status, fg.output_text)
    assert stored.created_at == events[0].response.created_at
    tail = list(client.responses.retrieve(rid, stream=True, starting_after=2))
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in events[3:]]
    every = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in every] == list(range(len(events)))
    with pytest.raises(openai.BadRequestError):
        list(client.responses.retrieve(fg.id, stream=True))
    # a long one resumed while it runs, then cancelled: the stream ends, the status stays
    long = client.responses.create(
        model="tiny", input="count", max_output_tokens=3000, background=True, stream=True
    )
    first = next(iter(long))
    lid = first.response.id
    follower = client.responses.retrieve(lid, stream=True, starting_after=0)
    assert next(iter(follower)).sequence_number == 1
    assert client.responses.cancel(lid).status == "cancelled"
    rest = list(follower)  # ends: the response was cancelled
    assert all(e.sequence_number > 1 for e in rest)
    long.close()
    assert client.responses.retrieve(lid).status == "cancelled"


def fg_done(fg: Any) -> str:
    return "response.completed" if fg.status == "completed" else "response.incomplete"


def test_truncation_auto_drops_the_oldest_turns(client: openai.OpenAI) -> None:
    """A conversation past the 4k context: refused by default (context_length_exceeded), and
    with truncation "auto" answered from its newest turns that fit, a user message first,
    as if only those had been sent."""
    long = "lorem ipsum " * 150  # 1,800 bytes: tokens of the byte-level tiny tokenizer
    turns: list[Any] = [
        {"role": "user", "content": long},
        {"role": "assistant", "content": long},
        {"role": "user", "content": long},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and now?"},
    ]
    args: dict[str, Any] = dict(model="tiny", max_output_tokens=8, temperature=0, store=False)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(input=turns, **args)
    assert "context_length_exceeded" in json.dumps(err.value.body)
    r = client.responses.create(input=turns, truncation="auto", **args)
    assert r.truncation == "auto"
    assert r.output_text == client.responses.create(input=turns[2:], **args).output_text
    rule = {"role": "developer", "content": "answer in French"}  # kept while turns go
    r = client.responses.create(input=[rule, *turns], truncation="auto", **args)
    assert r.output_text == client.responses.create(input=[rule, *turns[2:]], **args).output_text
    with pytest.raises(openai.BadRequestError):  # nothing left to drop
        client.responses.create(
            input=[{"role": "user", "content": long * 3}], truncation="auto", **args
        )
