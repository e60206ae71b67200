"""OpenAI's Responses API (POST /v1/responses) on the chat pipeline: a request becomes a chat
request, runs as /v1/chat/completions runs it (speculation, images, reasoning, the prefix
cache), and its answer or its chunks become a Response object or Responses stream events.

Stage: the HTTP edge, beside app.py's routes. Taken: `input` as a string or as message items
(roles user / system / developer / assistant; parts input_text, input_image, output_text),
`instructions` (a system message first), max_output_tokens, temperature, top_p, stream, user,
metadata (echoed), store and `previous_response_id` (responses_store.py: the stored
conversation goes first), `background` (answered at once as "queued", run on, polled with GET
/v1/responses/{id}, ended by POST .../cancel, and kept, so it needs store; with `stream` its
events stream as they come and are kept while it runs and after, so a client that lost the
stream resumes it with GET /v1/responses/{id}?stream=true&starting_after=N),
function `tools` with `tool_choice` (the chat path's tool calls, as
function_call items; function_call and function_call_output items in `input` replay a
conversation, reasoning items there are taken and left out),
`reasoning.effort` (the chat's reasoning_effort), `text.format` (the chat's
response_format: a JSON object or a JSON schema, enforced by its grammar), `include`
"message.output_text.logprobs" with `top_logprobs` (the chat's logprobs, on the output text and
on each delta), max_tool_calls, truncation ("auto": the oldest turns dropped, a user message
at a time, while the prompt does not fit, system and developer messages kept; the stored
conversation keeps them all), and
prompt_cache_key, safety_identifier, service_tier, stream_options taken with
nothing to do. Answered: a
"message" item with one output_text part, a "reasoning" item first where the model writes
one (gpt-oss's analysis channel), "function_call" items; status "incomplete" with reason
max_output_tokens where the chat answer stopped at its length; usage in the Responses names.
A stream sends response.created, then per item output_item.added, content_part.added, the
text deltas and their done events (a function call's arguments as one delta, parsed whole at
the end), and response.completed with the usage.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from quickdraft.request import MAX_TOP_LOGPROBS
from quickdraft.server.protocol import ChatCompletionRequest, StrictBody, Text
from quickdraft.server.responses import chat_chunks, merge_call


class InputText(StrictBody):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None  # an output_text replayed from an earlier response


class InputImage(StrictBody):
    type: Literal["input_image"]
    image_url: Text
    detail: Literal["auto", "low", "high"] | None = None


class MessageItem(StrictBody):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[Annotated[InputText | InputImage, Field(discriminator="type")]]
    id: Text | None = None  # replayed output items carry their ids and status
    status: Text | None = None


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text
    id: Text | None = None
    status: Text | None = None


class ReasoningItem(StrictBody):
    """An earlier response's reasoning item, sent back: taken and left out of the prompt (the
    chat templates drop an earlier turn's reasoning)."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: Text | None = None
    status: Text | None = None


InputItem = MessageItem | FunctionCallItem | FunctionOutputItem | ReasoningItem
_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _standing(item: InputItem) -> bool:
    """A system or developer message: kept when truncation drops the turns around it."""
    return isinstance(item, MessageItem) and item.role in ("system", "developer")


def as_stored(items: Sequence[InputItem]) -> list[InputItem]:
    """`items` as a stored response lists them (OpenAI's input items): each with its type, an
    id (a new one where the client gave none) and a status, a message's text as one part."""
    out: list[InputItem] = []
    for item in items:
        kind = item.type or "message"
        update: dict[str, Any] = {"type": kind, "status": item.status or "completed"}
        if item.id is None:
            update["id"] = _new_id(_ITEM_IDS.get(kind, "item"))
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            text = InputText(type="input_text", text=item.content)
            if item.role == "assistant":
                text = InputText(type="output_text", text=item.content)
            update["content"] = [text]
        out.append(item.model_copy(update=update))
    return out


def continued(output: Sequence[dict[str, Any]]) -> list[InputItem]:
    """A response's output items as the input items of the conversation that continues it."""
    items: list[InputItem] = []
    for item in output:
        kind = item["type"]
        if kind == "message":
            parts: list[InputText | InputImage] = [
                InputText(type="output_text", text=p["text"]) for p in item["content"]
            ]
            items.append(
                MessageItem(
                    type="message",
                    role="assistant",
                    content=parts,
                    id=item["id"],
                    status=item["status"],
                )
            )
        elif kind == "function_call":
            call = ("type", "call_id", "name", "arguments", "id", "status")
            items.append(FunctionCallItem.model_validate({k: item[k] for k in call}))
        elif kind == "reasoning":
            thought = ("type", "id", "summary", "content", "status")
            items.append(ReasoningItem.model_validate({k: item[k] for k in thought}))
    return items


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(StrictBody):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; none is written


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictBody):
    format: TextFormat | None = None


INCLUDABLE = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
]


class ResponsesRequest(StrictBody):
    model: Text
    input: Text | list[InputItem] = Field(min_length=1)
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = None  # default true: kept for previous_response_id (responses_store.py)
    previous_response_id: Text | None = None  # continue that stored response's conversation
    background: bool | None = None  # answer at once, run on, poll GET /v1/responses/{id}
    user: Text | None = None
    metadata: dict[str, Text] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None  # its effort goes to the template (gpt-oss)
    text: TextConfig | None = None  # the output's format: text, a JSON object or a schema
    # what else the answer holds: "message.output_text.logprobs" (the chat path's logprobs,
    # `top_logprobs` alternatives each); the other values OpenAI takes are accepted and have
    # nothing here to add (reasoning is returned as text, not encrypted)
    include: list[INCLUDABLE] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # "auto": the oldest turns dropped while the conversation does not fit the context
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)  # function_call items kept at most
    # accepted, nothing to do with them here: the prefix cache finds shared prefixes itself;
    # one tier; the stream's obfuscation padding is not sent
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    stream_options: dict[str, Any] | None = None

    def items(self) -> list[InputItem]:
        """`input` as items (a string: one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def turn_starts(self, history: Sequence[InputItem] = ()) -> list[int]:
        """Where the conversation (`history`, then `input`) may start when its oldest turns are
        dropped (truncation "auto"): at each user message that has a turn before it to drop
        (system and developer messages are kept, `to_chat`), in order."""
        items = [*history, *self.items()]
        starts, dropped = [], False
        for i, item in enumerate(items):
            if isinstance(item, MessageItem) and item.role == "user" and dropped:
                starts.append(i)
            dropped = dropped or not _standing(item)
        return starts

    def to_chat(self, history: Sequence[InputItem] = (), skip: int = 0) -> ChatCompletionRequest:
        """The chat request this one is, after the conversation `history` it continues (a
        stored response's, `previous_response_id`), its first `skip` items dropped (truncation
        "auto"); APIError 400 naming the field it cannot be."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = [*history, *self.items()]
        for item in [*(i for i in items[:skip] if _standing(i)), *items[skip:]]:
            if isinstance(item, ReasoningItem):
                continue
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _chat_content(item.content)})
            elif isinstance(item, FunctionCallItem):
                fn = {"name": item.name, "arguments": item.arguments}
                call: dict[str, Any] = {"id": item.call_id, "type": "function", "function": fn}
                last = messages[-1] if messages else {}
                if last.get("role") == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": bool(self.stream),
            "user": self.user,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type}
            if fmt.type == "json_schema":
                spec = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
                body["response_format"]["json_schema"] = spec
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True),
                }
                for t in self.tools
            ]
            body["tool_choice"] = self.tool_choice
            body["parallel_tool_calls"] = self.parallel_tool_calls
        return ChatCompletionRequest.built(body, "input")

    @property
    def logprobs(self) -> bool:
        """Whether the output text carries its tokens' logprobs (`include`)."""
        return "message.output_text.logprobs" in (self.include or [])

    def echo(self, stored: bool) -> dict[str, Any]:
        """The request fields a Response object repeats; `stored`: whether it is kept."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "metadata": self.metadata or {},
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "tool_choice": self.tool_choice or "auto",
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "store": stored,
            "background": bool(self.background),
            "previous_response_id": self.previous_response_id,
            "top_logprobs": self.top_logprobs or 0,
            "truncation": self.truncation or "disabled",
            "max_tool_calls": self.max_tool_calls,
            "service_tier": "default",
            "user": self.user,
            "reasoning": None if self.reasoning is None else self.reasoning.model_dump(),
            "text": {"format": {"type": "text"}}
            if self.text is None or self.text.format is None
            else {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)},
        }


def _chat_content(content: str | list[InputText | InputImage]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [
        {"type": "text", "text": p.text}
        if isinstance(p, InputText)
        else {"type": "image_url", "image_url": {"url": p.image_url}}
        for p in content
    ]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat:
        return None
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def _envelope(
    rid: str,
    model: str,
    req: ResponsesRequest,
    status: str,
    output: list[dict[str, Any]],
    stored: bool,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": status,
        "output": output,
        "error": None,
        "incomplete_details": None,
        "usage": None,
        **req.echo(stored),
    }


def _message(
    text: str, status: str = "completed", logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "type": "message",
        "id": _new_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def _reasoning(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": _new_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _function_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": _new_id("fc"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": "completed",
    }


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or chunk choice's) content logprobs, as output_text's: the same
    token / logprob / bytes / top_logprobs entries."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def _finish(response: dict[str, Any], finish_reason: str | None) -> None:
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def queued(req: ResponsesRequest) -> dict[str, Any]:
    """A background response as it is answered at once: its id, status "queued", no output."""
    return _envelope(_new_id("resp"), req.model, req, "queued", [], True)


def response_body(
    chat: dict[str, Any], req: ResponsesRequest, stored: bool = False, rid: str | None = None
) -> dict[str, Any]:
    """A chat completion's JSON -> the Response object (`stored`: it will be kept; `rid`: the
    id a background response was given, else a new one)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(_reasoning(message["reasoning_content"]))
    if message.get("content") or not message.get("tool_calls"):
        output.append(_message(message.get("content") or "", logprobs=_logprobs(choice)))
    calls = message.get("tool_calls") or []
    output += [_function_call(c) for c in calls[: req.max_tool_calls]]
    response = _envelope(rid or _new_id("resp"), chat["model"], req, "completed", output, stored)
    _finish(response, choice.get("finish_reason"))
    response["usage"] = _usage(chat.get("usage"))
    return response


async def response_events(
    chunks: AsyncIterable[Any],
    req: ResponsesRequest,
    keep: Callable[[dict[str, Any]], object] | None = None,
    queued: dict[str, Any] | None = None,
) -> AsyncGenerator[str, None]:
    """A chat stream's SSE chunks -> Responses stream events (SSE); `keep` is given the final
    Response object (the store's put) before its last event goes out; `queued`: the background
    response these events answer (its id and creation time)."""
    stream = _Events(req, keep is not None)
    if queued is not None:
        stream.response.update(id=queued["id"], created_at=queued["created_at"])
    yield stream.event("response.created", response=stream.response)
    yield stream.event("response.in_progress", response=stream.response)
    async for chunk in chat_chunks(chunks):
        for event in stream.feed(chunk):
            yield event
    last = stream.end()
    if keep is not None:
        keep(stream.response)
    for event in last:
        yield event


class _Events:
    """The Responses events of one chat stream, item by item: the reasoning text and the
    message text as they stream, function calls whole at the end."""

    def __init__(self, req: ResponsesRequest, stored: bool) -> None:
        self.response = _envelope(_new_id("resp"), req.model, req, "in_progress", [], stored)
        self.output: list[dict[str, Any]] = self.response["output"]
        self.open: dict[str, Any] | None = None  # the item whose text is streaming
        self.kind = ""  # its kind: "reasoning" or "message"
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.seq = 0
        self.max_calls = req.max_tool_calls

    def event(self, kind: str, **data: Any) -> str:
        body = json.dumps({"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1
        return f"event: {kind}\ndata: {body}\n\n"

    def _at(self) -> dict[str, Any]:
        """The open item's place, as its events name it."""
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        if "error" in chunk:  # the chat stream's error event: the response failed
            self.response.update(status="failed", error=chunk["error"])
            return [self.event("response.failed", response=self.response)]
        out: list[str] = []
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            self.finish = choice.get("finish_reason") or self.finish
            for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
                piece = delta.get(key)
                if not piece:
                    continue
                if self.kind != kind:
                    out += self._start(kind)
                assert self.open is not None
                self.open["content"][0]["text"] += piece
                extra: dict[str, Any] = {}
                if kind == "message":
                    extra["logprobs"] = _logprobs(choice)
                    self.open["content"][0]["logprobs"] += extra["logprobs"]
                name = f"response.{'output' if kind == 'message' else 'reasoning'}_text.delta"
                out.append(self.event(name, **self._at(), content_index=0, delta=piece, **extra))
            for call in delta.get("tool_calls") or []:
                merge_call(self.calls, call)
        return out

    def _start(self, kind: str) -> list[str]:
        out = self._close()
        item = _message("", "in_progress") if kind == "message" else _reasoning("")
        part = item["content"][0]
        item.update(status="in_progress", content=[])
        self.output.append(item)
        index = len(self.output) - 1
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        item["content"] = [part]
        self.open, self.kind = item, kind
        out.append(
            self.event("response.content_part.added", **self._at(), content_index=0, part=part)
        )
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        part = self.open["content"][0]
        at = {**self._at(), "content_index": 0}
        if self.kind == "message":
            logprobs = part["logprobs"]
            done = self.event(
                "response.output_text.done", **at, text=part["text"], logprobs=logprobs
            )
        else:
            done = self.event("response.reasoning_text.done", **at, text=part["text"])
        self.open["status"] = "completed"
        item = self.open
        out = [done, self.event("response.content_part.done", **at, part=part)]
        out.append(
            self.event("response.output_item.done", output_index=at["output_index"], item=item)
        )
        self.open, self.kind = None, ""
        return out

    def end(self) -> list[str]:
        out = self._close()
        if not self.output and not self.calls:  # an empty answer is still one message
            out += self._start("message") + self._close()
        for i in sorted(self.calls)[: self.max_calls]:
            item = _function_call(self.calls[i])
            self.output.append(item)
            index = len(self.output) - 1
            added = {**item, "status": "in_progress"}
            out.append(self.event("response.output_item.added", output_index=index, item=added))
            args = {"arguments": item["arguments"], "name": item["name"]}
            at = {"item_id": item["id"], "output_index": index}
            arguments = item["arguments"]  # one delta: the call is parsed whole at the end
            out.append(self.event("response.function_call_arguments.delta", **at, delta=arguments))
            out.append(self.event("response.function_call_arguments.done", **at, **args))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        _finish(self.response, self.finish)
        self.response["usage"] = _usage(self.usage)
        done = (
            "response.completed"
            if self.response["status"] == "completed"
            else "response.incomplete"
        )
        out.append(self.event(done, response=self.response))
        return out
