"""OpenAI wire format, the response side: bodies and stream chunks (requests: protocol.py).

Response models mirror OpenAI's and add two blocks every response carries: `usage` and
`speculative` (this request's drafted / accepted counts, see request.SpecStats). A chat
stream's chunks are read back here too (`chat_chunks`, `merge_call`) by the APIs that reshape
them (responses_api.py, messages_api.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, Field

from quickdraft.request import SpecStats
from quickdraft.server.protocol import FunctionCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class Speculative(BaseModel):
    """Per-request speculation telemetry (vLLM's counting: accepted excludes the bonus)."""

    method: str
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_acceptance_length: float  # tokens per target forward: 1 + accepted / cycles
    cycles: int  # target forwards after prefill
    accepted_per_position: list[int]
    # accepted drafts that strict verification would have rejected (relaxed thinking-phase
    # acceptance, opt-in; counted within `accepted`)
    relaxed_accepted: int = 0
    # method "adaptive": drafter -> [cycles it drafted in, drafted, accepted]
    drafters: dict[str, list[int]] | None = None

    @classmethod
    def of(cls, spec: SpecStats) -> Speculative:
        return cls(
            method=spec.method,
            drafted=spec.drafted,
            accepted=spec.accepted,
            acceptance_rate=round(spec.acceptance_rate, 4),
            mean_acceptance_length=round(spec.mean_acceptance_length, 4),
            cycles=spec.cycles,
            accepted_per_position=list(spec.accepted_per_position),
            relaxed_accepted=spec.relaxed,
            drafters={k: list(v) for k, v in spec.drafters.items()} or None,
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class OutputToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[OutputToolCall] | None = None
    reasoning_content: str | None = None  # gpt-oss's analysis channel (dropped when None)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: Speculative


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | None = None  # on the last chunk only (relay.py)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    speculative: Speculative | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    stop_reason: int | str | None = None  # vLLM's (ChatChoice); in a stream, on the last chunk


class Completion(BaseModel):
    """Both the non-stream body and each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative: Speculative | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "quickdraft"
    max_model_len: int
    speculative_method: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


async def chat_chunks(events: AsyncIterable[Any]) -> AsyncIterator[dict[str, Any]]:
    """A chat stream's SSE events (relay.py `Relay.events`, as a response body yields them)
    read back as chunk objects, for the APIs whose streams are reshaped chat streams."""
    async for raw in events:
        text = bytes(raw).decode() if isinstance(raw, bytes | memoryview) else str(raw)
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def merge_call(calls: dict[int, dict[str, Any]], call: dict[str, Any]) -> None:
    """A streamed `delta.tool_calls` entry added to the calls read so far, by its index."""
    got = calls.setdefault(call["index"], {"id": "", "function": {"name": "", "arguments": ""}})
    got["id"] = call.get("id") or got["id"]
    fn = call.get("function") or {}
    got["function"]["name"] += fn.get("name") or ""
    got["function"]["arguments"] += fn.get("arguments") or ""
