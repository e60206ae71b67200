"""OpenAI wire format, the request side: bodies validated, with the rules between fields (over
400 lines: every field of both endpoints, tools and structured outputs included).

Stage: the HTTP edge. Request models are strict (no silent "0.5" -> 0.5 coercion) and forbid
unknown fields, so a typo or an unsupported option is a clear 400 naming the field instead of
being ignored. Range checks live in the field types; rules that need several fields or a clearer
message than pydantic's live in `check()` and raise `APIError` with the offending `param`.
The response bodies live in responses.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from quickdraft.config import RELAXED_DELTA, RELAXED_TOP_K
from quickdraft.grammar import Grammar
from quickdraft.request import (
    MAX_LOGIT_BIAS,
    MAX_RELAXED_TOP_K,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    RelaxedThinking,
    SamplingParams,
)

MAX_CHOICES = 16  # n (and best_of): each choice is a sequence of its own in the engine


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


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictBody):
    include_usage: bool = False


class TextPart(StrictBody):
    type: Literal["text"]
    text: Text


class ImageUrl(StrictBody):
    url: Text  # data:image/...;base64,..., or an http(s) / file URL the operator allows
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's own sizing


class ImagePart(StrictBody):
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrl(StrictBody):
    url: Text  # data:video/...;base64,..., or an http(s) / file URL the operator allows


class VideoPart(StrictBody):
    """vLLM's extension of OpenAI's content parts: a video (Gemma 4)."""

    type: Literal["video_url"]
    video_url: VideoUrl


PART_TYPES = ("text", "image_url", "video_url")


def _part_tag(value: Any) -> str | None:
    """The union member a content part is validated as (None: an unknown type, refused)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"part[{kind}]" if kind in PART_TYPES else None


# Tags carry "[...]": server/errors.py drops union member names from an error's `param`
ContentPart = Annotated[
    Annotated[TextPart, Tag("part[text]")]
    | Annotated[ImagePart, Tag("part[image_url]")]
    | Annotated[VideoPart, Tag("part[video_url]")],
    Discriminator(
        _part_tag,
        custom_error_type="content_part_type",
        custom_error_message="a content part's type must be 'text', 'image_url' or 'video_url'",
    ),
]


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # extra="ignore": clients replay assistant messages as the SDK returned them (refusal,
    # audio: null, ...); those fields carry nothing a chat template uses.
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, URL) of the message's image parts."""
        return [(j, url) for j, kind, url in self.media_urls() if kind == "image"]

    def media_urls(self) -> list[tuple[int, str, str]]:
        """(part index, "image" or "video", URL) of the message's image and video parts."""
        if not isinstance(self.content, list):
            return []
        return [
            (j, "image", p.image_url.url)
            if isinstance(p, ImagePart)
            else (j, "video", p.video_url.url)
            for j, p in enumerate(self.content)
            if isinstance(p, ImagePart | VideoPart)
        ]

    def template_content(self) -> str | list[dict[str, str]]:
        """The content as chat templates read it: the text, or, where the message holds
        images or videos, its parts in order with each as `{"type": "image"}` or
        `{"type": "video"}` (the template puts the model's placeholder there)."""
        if not self.media_urls():
            return self.text()
        assert isinstance(self.content, list)
        return [
            {"type": "text", "text": p.text}
            if isinstance(p, TextPart)
            else {"type": "image" if isinstance(p, ImagePart) else "video"}
            for p in self.content
        ]

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's convention: a tool call's `arguments`
        as an object when it is JSON, so templates can `tojson` it)."""
        # "developer" is OpenAI's newer name for "system"; chat templates know "system"
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.template_content(),
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _json_or_text(c)},
                }
                for c in self.tool_calls
            ]
        return out


def _json_or_text(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class FunctionDef(StrictBody):
    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictBody):
    name: Text


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(StrictBody):
    name: Text = "response"
    description: Text | None = None
    # "schema" shadows a BaseModel attribute in pydantic, hence the alias
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictBody):
    """Extension (vLLM's `structured_outputs`): exactly one of a JSON schema, a regex, an
    EBNF grammar (xgrammar's dialect, GBNF-like), or a list of choices."""

    json_: dict[str, Any] | None = Field(default=None, alias="json")
    regex: Text | None = None
    grammar: Text | None = None
    choice: list[Text] | None = None


class RelaxedThinkingBody(StrictBody):
    """Extension `relaxed_thinking`: lossy acceptance inside a reasoning block
    (speculation/relaxed.py); top_k 0 turns it off."""

    top_k: int = Field(default=RELAXED_TOP_K, ge=0, le=MAX_RELAXED_TOP_K)
    delta: float = Field(default=RELAXED_DELTA, ge=0.0, le=1e4)


class GenerateRequest(StrictBody):
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
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    response_format: ResponseFormat | None = None
    # extensions (vLLM names), passed by the openai client through `extra_body`
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    structured_outputs: StructuredOutputs | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # vLLM's: each prompt token's logprob and its `prompt_logprobs` best alternatives
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # quickdraft extension: true / {"top_k", "delta"} / false; absent: the server's setting
    relaxed_thinking: bool | RelaxedThinkingBody | None = None

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
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            msg = "stream_options is only allowed with stream: true"
            raise APIError(400, msg, "stream_options")
        self.stop_strings()
        self.bias()
        self.grammar()

    @property
    def choices(self) -> int:
        return self.n or 1

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; 400 naming `logit_bias` when malformed."""
        out = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                msg = f"logit_bias values must be in [-100, 100], got {value} for token {key}"
                raise APIError(400, msg, "logit_bias")
            out.append((int(key), float(value)))
        return tuple(out)

    def grammar(self) -> Grammar | None:
        """The grammar `response_format` / `structured_outputs` ask for (None: free text)."""
        fmt, so = self.response_format, self.structured_outputs
        if so is not None:
            given = [
                k for k in ("json_", "regex", "grammar", "choice") if getattr(so, k) is not None
            ]
            if len(given) != 1:
                msg = "structured_outputs takes exactly one of json, regex, grammar, choice"
                raise APIError(400, msg, "structured_outputs")
            if fmt is not None and fmt.type != "text":
                msg = "give response_format or structured_outputs, not both"
                raise APIError(400, msg, "structured_outputs")
            param = "structured_outputs"
            if so.json_ is not None:
                return Grammar("json_schema", json.dumps(so.json_), param)
            if so.regex is not None:
                return Grammar("regex", so.regex, param)
            if so.grammar is not None:
                return Grammar("ebnf", so.grammar, param)
            assert so.choice is not None
            if not so.choice:
                raise APIError(400, "structured_outputs.choice is empty", param)
            return Grammar("json_schema", json.dumps({"enum": so.choice}), param)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Grammar("json_object")
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            msg = "response_format json_schema needs json_schema.schema"
            raise APIError(400, msg, "response_format")
        return Grammar("json_schema", json.dumps(fmt.json_schema.schema_))

    def logprobs_count(self) -> int | None:
        """Top alternatives to report per token (0: the chosen token only; None: none)."""
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine's params for choice `choice` of n (seeded choices get seed + choice)."""
        seed = self.seed if self.seed is None or choice == 0 else (self.seed + choice) % 2**64
        return SamplingParams(
            max_tokens=max_tokens,
            # OpenAI's defaults: temperature 1, top_p 1 (0 = greedy)
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=seed,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=self.bias(),
            logprobs=self.logprobs_count(),
            prompt_logprobs=self.prompt_logprobs,
            grammar=self.grammar(),
            relaxed_thinking=self.relaxed(),
        )

    def relaxed(self) -> RelaxedThinking | None:
        """The request's relaxed thinking acceptance (None: the server's setting)."""
        r = self.relaxed_thinking
        if r is None:
            return None
        if isinstance(r, bool):
            return RelaxedThinking(RELAXED_TOP_K, RELAXED_DELTA) if r else RelaxedThinking()
        return RelaxedThinking(r.top_k, r.delta)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


# what the server gives every chat template itself: a request cannot set these
TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}
)


class ChatCompletionRequest(GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's; the chat template reads it (gpt-oss's harmony writes "Reasoning: <effort>")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's: more variables for the chat template (Qwen3's `enable_thinking`, ...)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: no assistant turn opened after the messages; or the last (assistant) message
    # left open for the model to go on with (a prefilled answer)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @classmethod
    def built(cls, body: dict[str, Any], param: str) -> ChatCompletionRequest:
        """The checked chat request another API's body became (the Responses and Messages
        APIs); a body it cannot be is a 400 naming that API's field `param`."""
        try:
            chat = cls.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise APIError(400, f"{param}: {where}: {first['msg']}", param) from None
        chat.check()
        return chat

    def check(self) -> None:
        super().check()
        if self.continue_final_message:
            if self.add_generation_prompt:
                msg = "continue_final_message needs add_generation_prompt: false"
                raise APIError(400, msg, "continue_final_message")
            last = self.messages[-1]
            if last.role != "assistant" or not last.text():
                msg = "continue_final_message: the last message must be an assistant's, with text"
                raise APIError(400, msg, "continue_final_message")
        for key in self.chat_template_kwargs or {}:
            if not key.isidentifier() or key in TEMPLATE_NAMES:
                msg = f"chat_template_kwargs: {key!r} is not a variable a request may set"
                raise APIError(400, msg, "chat_template_kwargs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(
                400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: function names must be unique", "tools")
        if choice is not None and choice != "none" and not names:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            msg = f"tool_choice names {choice.function.name!r}, which is not in tools"
            raise APIError(400, msg, "tool_choice")
        if self.tool_grammar() is not None and self.grammar() is not None:
            msg = "a forced tool call (tool_choice) cannot also follow response_format"
            raise APIError(400, msg, "tool_choice")
        for i, m in enumerate(self.messages):
            if m.role == "tool" and m.tool_call_id is None:
                msg = f"messages[{i}].tool_call_id is required in a tool message"
                raise APIError(400, msg, f"messages[{i}].tool_call_id")
            # as OpenAI's API: content is required, except in an assistant turn that calls tools
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                why = " (or tool_calls in an assistant message)" if m.role == "assistant" else ""
                msg = f"messages[{i}].content is required{why}"
                raise APIError(400, msg, f"messages[{i}].content")
            if m.media_urls() and m.role != "user":
                msg = f"messages[{i}]: image and video parts are allowed in user messages only"
                raise APIError(400, msg, f"messages[{i}].content")

    def media_parts(self) -> list[tuple[str, str, str]]:
        """(param, "image" or "video", URL) of every image and video part of the conversation,
        in prompt order."""
        return [
            (f"messages[{i}].content[{j}].{kind}_url", kind, url)
            for i, m in enumerate(self.messages)
            for j, kind, url in m.media_urls()
        ]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def calls_tools(self) -> bool:
        """Whether tools are offered: the output is then parsed for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_defs(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates read them (None: none offered)."""
        if not self.calls_tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_grammar(self) -> Grammar | None:
        """A forced call (`required` or a named function) is enforced by a grammar."""
        choice = self.tool_choice
        if not self.tools or choice in (None, "none", "auto"):
            return None
        tools = self.tool_defs() or []
        wire = choice if isinstance(choice, str) else choice.model_dump()
        return Grammar.tool_calls(tools, wire, self.parallel_tool_calls is not False)

    def chat(self) -> list[dict[str, Any]]:
        # A message's `name` goes to the template, which uses it where it has a place for it.
        return [m.for_template() for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables beyond the messages and tools."""
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return out

    def sampling(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        params = super().sampling(max_tokens, choice)
        grammar = self.tool_grammar()
        if grammar is None:
            return params
        return dataclasses.replace(params, grammar=grammar)


class CompletionRequest(GenerateRequest):
    # one prompt per request: a string or token ids (a batch of prompts is a 400)
    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool | None = None
    suffix: Text | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    # extension: read special-token text in the prompt (`<|im_start|>`) as those tokens; by
    # default a prompt is plain text, like a chat message
    parse_special_tokens: bool = False

    def check(self) -> None:
        super().check()
        if self.suffix and self.echo:
            raise APIError(400, "echo cannot show a prompt with a suffix: give one of them", "echo")
        if self.best_of is not None:
            if self.best_of < self.choices:
                msg = f"best_of ({self.best_of}) must be >= n ({self.choices})"
                raise APIError(400, msg, "best_of")
            if self.stream and self.best_of > self.choices:
                raise APIError(400, "best_of > n cannot stream", "best_of")

    def sampling(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        params = super().sampling(max_tokens, choice)
        if self.echo and self.logprobs is not None:  # the prompt's tokens are scored too
            top = max(self.logprobs, self.prompt_logprobs or 0)
            return dataclasses.replace(params, prompt_logprobs=top)
        return params

    @property
    def candidates(self) -> int:
        """Sequences to run: best_of (the n with the highest mean logprob are returned)."""
        return max(self.best_of or 1, self.choices)

    def logprobs_count(self) -> int | None:
        if self.logprobs is None and self.candidates > self.choices:
            return 0  # best_of ranks by logprob
        return self.logprobs

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
