"""OpenAI wire format: request bodies (validated) and response / stream-chunk bodies.

Stage: the HTTP edge. Request models are strict (no silent "0.5" -> 0.5 coercion) and forbid
unknown fields, so a typo or an unsupported option is a clear 400 naming the field instead of
being ignored. Range checks live in the field types; rules that need several fields or a clearer
message than pydantic's live in `check()` and raise `APIError` with the offending `param`.
Response models mirror OpenAI's and add two blocks every response carries: `usage` and
`speculative` (this request's drafted / accepted counts, see request.SpecStats).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from quickdraft.request import MAX_STOP_STRINGS, SamplingParams, SpecStats


class APIError(Exception):
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": _encodable(self.message),
                "type": self.type,
                "param": None if self.param is None else _encodable(self.param),
                "code": self.code,
            }
        }


def _encodable(text: str) -> str:
    """`text` with any lone surrogate written as an escape: an error that quotes bad input
    must still encode as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


def _unicode(value: str) -> str:
    # JSON can carry lone surrogates ("\\ud800"), which are not Unicode text: refused here,
    # where the field is known, instead of failing in the tokenizer or in a response.
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            msg = "not valid Unicode (it holds a lone surrogate)"
            raise PydanticCustomError("string_unicode", msg) from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]  # every free-text field of a request


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    # extra="ignore": clients replay assistant messages as the SDK returned them (refusal,
    # tool_calls: null, ...); those fields carry nothing a plain chat template uses.
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class GenerateRequest(_Strict):
    """The sampling fields chat and completions share."""

    model: Text
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # torch's seed range
    user: Text | None = None
    # accepted at their neutral values only (clients send them explicitly); anything else is
    # unsupported and refused rather than ignored
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    # extensions (vLLM names), passed by the openai client through `extra_body`
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if not stops or len(stops) > MAX_STOP_STRINGS:
            raise APIError(
                400, f"stop must hold 1 to {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop"
            )
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", "stop")
        return tuple(stops)

    def check(self) -> None:
        """Cross-field rules pydantic's field types cannot express."""
        if self.n not in (None, 1):
            raise APIError(400, f"n must be 1 (one choice per request), got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            msg = "stream_options is only allowed with stream: true"
            raise APIError(400, msg, "stream_options")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (only 0)", name)
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        self.stop_strings()

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            # OpenAI's defaults: temperature 1, top_p 1 (0 = greedy)
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def check(self) -> None:
        super().check()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(
                400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens"
            )

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def chat(self) -> list[dict[str, Any]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know "system". A
        # message's `name` goes to the template, which uses it where it has a place for it.
        return [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
                **({} if m.name is None else {"name": m.name}),
            }
            for m in self.messages
        ]


class CompletionRequest(GenerateRequest):
    # one prompt per request: a string or token ids (a batch of prompts is a 400, like n > 1)
    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool | None = None
    suffix: Text | None = None
    # extension: read special-token text in the prompt (`<|im_start|>`) as those tokens; by
    # default a prompt is plain text, like a chat message
    parse_special_tokens: bool = False

    def check(self) -> None:
        super().check()
        if self.echo:
            raise APIError(400, "echo is not supported", "echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

    def single_prompt(self) -> str | list[int]:
        p: Any = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError(400, f"one prompt per request, got {len(p)}", "prompt")
            p = p[0]
        if not p:
            raise APIError(400, "the prompt is empty", "prompt")
        assert isinstance(p, str | list)
        return p


# ---------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
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
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: Speculative


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


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
    logprobs: None = None


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
