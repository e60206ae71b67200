"""vLLM's /tokenize and /detokenize bodies: a client counts or inspects the ids the model will
see, or reads ids back as text, without generating.

Stage: the HTTP edge, beside protocol.py (requests) and responses.py. /tokenize takes either a
plain prompt (as /v1/completions tokenizes it: special-token text plain unless
`parse_special_tokens`, the tokenizer's own BOS with `add_special_tokens`) or a conversation
(as /v1/chat/completions renders it: its template, tools, the generation prompt unless
`add_generation_prompt` is false); image and video parts are refused there (their rows are
counted in a completion's `usage.prompt_tokens`). /detokenize decodes ids with special tokens
kept as text.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from quickdraft.server.protocol import ChatCompletionRequest, StrictBody, Text


class TokenizeCompletionRequest(StrictBody):
    model: Text
    prompt: Text
    add_special_tokens: bool = True
    parse_special_tokens: bool = False  # as /v1/completions
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """A chat body (its sampling fields are accepted and unused) with vLLM's tokenize fields."""

    add_special_tokens: bool = False  # the template writes its own BOS
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictBody):
    model: Text
    tokens: list[int] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str
