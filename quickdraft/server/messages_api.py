"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the chat path:
what clients built on the anthropic package send (coding agents among them), as llama-server
and vLLM serve it. (Over 400 lines: its request's block and config types and both
translations, answer and stream, in one place.)

Stage: the HTTP edge, beside responses_api.py. A Messages body becomes a chat completion:
`system` a system message; text and image blocks the chat's content parts (a base64 source as
a data URL); an assistant's `tool_use` blocks its tool calls (the input as JSON arguments); a
user's `tool_result` blocks tool messages ahead of its other content; the `thinking` blocks of
earlier turns dropped (what the chat templates do with earlier reasoning); `tools` the chat's
functions (`input_schema` their parameters); `tool_choice` auto / any / tool / none as auto /
required / the named function / none; `stop_sequences` the stops; `thinking` the template's
`enable_thinking` (Qwen3's switch; a template without one ignores it); `metadata.user_id` the
request's user (the tenant within an API key); a last assistant turn a prefill the answer goes
on from (vLLM's `continue_final_message`). The chat's answer comes back as a Message: a
thinking block where the model reasoned, a text block, its tool_use blocks; stop_reason
end_turn / max_tokens / stop_sequence (with the string) / tool_use; usage in Anthropic's split
(prompt tokens the prefix cache served as `cache_read_input_tokens`). Streamed as Anthropic's
events (message_start, content_block_start / _delta / _stop, message_delta, message_stop; a
tool call's input as one input_json_delta, parsed whole at the end as on the chat path).
`cache_control` marks are accepted and change nothing: the prefix cache finds shared prefixes
by itself. Errors on these routes are Anthropic-shaped (errors.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field

from quickdraft.server.protocol import APIError, ChatCompletionRequest, StrictBody, Text
from quickdraft.server.responses import chat_chunks, merge_call


class CacheControl(StrictBody):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictBody):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # sent back as received; nothing cites here


class Base64Source(StrictBody):
    type: Literal["base64"]
    media_type: Text
    data: Text


class UrlSource(StrictBody):
    type: Literal["url"]
    url: Text


class ImageBlock(StrictBody):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def part(self) -> dict[str, Any]:
        """The chat's image_url content part."""
        src = self.source
        url = src.url if isinstance(src, UrlSource) else f"data:{src.media_type};base64,{src.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ToolUseBlock(StrictBody):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # a response's fields, sent back as received
    toolset_name: Text | None = None


class ToolResultBlock(StrictBody):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class ThinkingBlock(StrictBody):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class RedactedThinkingBlock(StrictBody):
    type: Literal["redacted_thinking"]
    data: Text


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(StrictBody):
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class ToolDef(StrictBody):
    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    # accepted, no effect: no tool is called by anything but the model, every tool is loaded,
    # a call's input streams whole at its end
    cache_control: CacheControl | None = None
    allowed_callers: list[Any] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None


class ToolChoice(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictBody):
    # enabled / between_tools: the template's enable_thinking on; disabled: off; adaptive: the
    # template's default
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)  # the answer's max_tokens bounds it
    display: Literal["summarized", "omitted"] | None = None  # reasoning is returned as written


class JsonFormat(StrictBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictBody):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # the template's
    format: JsonFormat | None = None  # the answer follows this JSON schema (a grammar)


class Diagnostics(StrictBody):
    previous_message_id: Text | None = None  # accepted: no cache-miss report here


class Metadata(StrictBody):
    user_id: Text | None = None


class MessagesInput(StrictBody):
    """What a conversation is made of (the body of /v1/messages/count_tokens)."""

    model: Text
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # accepted: the prefix cache needs no marks

    def to_chat(self, **fields: Any) -> ChatCompletionRequest:
        """The chat request this conversation is (`fields`: its sampling), checked; APIError
        400 naming the field it cannot be."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        for m in self.messages:
            messages += _chat_messages(m)
        body: dict[str, Any] = {"model": self.model, "messages": messages, **fields}
        if self.messages[-1].role == "assistant":  # a prefilled answer: the model goes on
            body["add_generation_prompt"] = False
            body["continue_final_message"] = True
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                        "strict": t.strict,
                    },
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if not choice.name:
                    raise APIError(400, "tool_choice type 'tool' needs a name", "tool_choice")
                named = {"type": "function", "function": {"name": choice.name}}
                body["tool_choice"] = named
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        variables: dict[str, Any] = {}  # the chat template's
        thinking = self.thinking.type if self.thinking is not None else "adaptive"
        if thinking != "adaptive":
            variables["enable_thinking"] = thinking != "disabled"
        out = self.output_config
        if out is not None and out.effort is not None:
            variables["reasoning_effort"] = out.effort  # Anthropic's levels, as they are
        if variables:
            body["chat_template_kwargs"] = variables
        if out is not None and out.format is not None:
            schema = {"name": "output", "schema": out.format.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        try:
            return ChatCompletionRequest.built(body, "messages")
        except APIError as exc:
            if exc.param == "stop":
                exc.param = "stop_sequences"
            raise


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    # accepted, no effect here: one tier, one speed (speculation is the server's setting),
    # one place, no cache-miss diagnostics, no workspaces or user profiles
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: Text | None = None
    diagnostics: Diagnostics | None = None
    user_profile_id: Text | None = None
    workspace_id: Text | None = None

    def chat(self) -> ChatCompletionRequest:
        fields: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences or None,
            "stream": self.stream,
            "user": self.metadata.user_id if self.metadata is not None else None,
        }
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        return self.to_chat(**fields)


def _chat_messages(m: InputMessage) -> list[dict[str, Any]]:
    """One Messages turn as chat messages (module docstring)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for b in m.content:
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            if m.role == "assistant":
                raise APIError(400, "an assistant turn cannot hold an image", "messages")
            parts.append(b.part())
        elif isinstance(b, ToolUseBlock):
            if m.role != "assistant":
                raise APIError(400, "tool_use blocks belong to assistant turns", "messages")
            args = json.dumps(b.input, ensure_ascii=False)
            calls.append(
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": args}}
            )
        elif isinstance(b, ToolResultBlock):
            if m.role != "user":
                raise APIError(400, "tool_result blocks belong to user turns", "messages")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
    if m.role == "assistant":
        text = "".join(p["text"] for p in parts)
        if text or calls:
            msg: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    elif parts:
        only_text = all(p["type"] == "text" for p in parts)
        content = "".join(p["text"] for p in parts) if only_text else parts
        out.append({"role": "user", "content": content})
    return out


def _new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _usage(chat: dict[str, Any] | None) -> dict[str, Any]:
    if not chat:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": chat["prompt_tokens"] - cached,
        "output_tokens": chat["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _stop(finish_reason: str | None, stop_reason: Any) -> tuple[str | None, str | None]:
    """The chat's finish -> Anthropic's stop_reason and stop_sequence."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"] or "{}")
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):  # Anthropic's input is an object: keep what came as text
        args = {"arguments": fn["arguments"]}
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args}


def _message(
    req: MessagesRequest,
    content: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage: dict[str, Any],
) -> dict[str, Any]:
    """A Message (a new id) with its content, (stop_reason, stop_sequence) and usage."""
    return {
        "id": _new_id(),
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def message_body(chat: dict[str, Any], req: MessagesRequest) -> dict[str, Any]:
    """A chat completion's answer as a Message."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        content.append({"type": "text", "text": msg.get("content") or ""})
    content += [_tool_use(c) for c in calls]
    stop = _stop(choice.get("finish_reason"), choice.get("stop_reason"))
    return _message(req, content, stop, _usage(chat.get("usage")))


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def message_events(chunks: AsyncIterable[Any], req: MessagesRequest) -> AsyncIterator[str]:
    """A chat stream's SSE chunks -> the Messages stream (SSE events)."""
    message = _message(req, [], (None, None), _usage(None))
    yield _event("message_start", message=message)
    index, open_kind = -1, ""
    calls: dict[int, dict[str, Any]] = {}
    finish: str | None = None
    stop_reason: Any = None
    usage: dict[str, Any] | None = None
    async for chunk in chat_chunks(chunks):
        if "error" in chunk:  # the chat stream's error event
            err = chunk["error"]
            yield _event("error", error={"type": "api_error", "message": err.get("message")})
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if choice.get("finish_reason"):
                finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
            for kind, key in (("thinking", "reasoning_content"), ("text", "content")):
                piece = delta.get(key)
                if not piece:
                    continue
                if open_kind != kind:
                    if open_kind:
                        yield _event("content_block_stop", index=index)
                    index, open_kind = index + 1, kind
                    block = {"type": "thinking", "thinking": "", "signature": ""}
                    if kind == "text":
                        block = {"type": "text", "text": ""}
                    yield _event("content_block_start", index=index, content_block=block)
                d = {"type": "thinking_delta", "thinking": piece}
                if kind == "text":
                    d = {"type": "text_delta", "text": piece}
                yield _event("content_block_delta", index=index, delta=d)
            for call in delta.get("tool_calls") or []:
                merge_call(calls, call)
    if open_kind:
        yield _event("content_block_stop", index=index)
    elif not calls:  # an empty answer is still one text block
        index += 1
        yield _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
        yield _event("content_block_stop", index=index)
    for i in sorted(calls):
        use = _tool_use(calls[i])
        index += 1
        yield _event("content_block_start", index=index, content_block={**use, "input": {}})
        partial = json.dumps(use["input"], ensure_ascii=False)
        delta = {"type": "input_json_delta", "partial_json": partial}
        yield _event("content_block_delta", index=index, delta=delta)
        yield _event("content_block_stop", index=index)
    reason, sequence = _stop(finish, stop_reason)
    yield _event(
        "message_delta",
        delta={"stop_reason": reason, "stop_sequence": sequence},
        usage=_usage(usage),
    )
    yield _event("message_stop")
