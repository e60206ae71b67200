"""llama-server's native completion endpoints: /completion (a prompt, text or token ids) and
/infill (code between a prefix and a suffix), in its request and response shapes, so that
scripts and editor plugins written for it (llama.vscode, llama.vim) run here.

Stage: the HTTP edge, beside protocol.py. A body becomes a completion (/infill: over the infill
prompt, infill.py `infill_ids`, llama-server's layout and cuts, with the model's FIM end tokens
as stop tokens); the engine's outputs come back as llama-server's body (`content`, `stop_type`,
`timings`, with `completion_probabilities` for `n_probs`), or as its stream (`data: {...}`
events, the last one with `stop: true`, no [DONE]). llama-server's two code-completion stop
rules run on the text as it comes: `n_indent` (a line after the first indented less than that
ends the answer before its first character) and `t_max_predict_ms` (past that long since the
first token, a new line ends it). `grammar` (GBNF, read by xgrammar's EBNF parser) and
`json_schema` constrain the answer as the OpenAI routes' structured outputs do.

Sampling fields and their defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95,
min_p 0.05, seed -1 random, `repeat_penalty`, `n_predict` -1: the server's default length).
Accepted with no effect, so that llama-server's clients run unchanged: `id_slot` and
`cache_prompt` (no slots here; the prefix cache always serves), `t_max_prompt_ms` (llama-server
ignores it as well) and `samplers` (the sampler order here is fixed: penalties, top-k, top-p,
min-p, then temperature).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from pydantic import Field

from quickdraft.engine import RequestOutput
from quickdraft.infill import Chunk, FimTokens, infill_ids
from quickdraft.request import FinishReason, TokenLogprob
from quickdraft.server.protocol import (
    MAX_TOP_LOGPROBS,
    APIError,
    CompletionRequest,
    StrictBody,
    StructuredOutputs,
    Text,
)
from quickdraft.server.relay import Relay, cancel_on_disconnect
from quickdraft.tokenizer import Tokenizer


class LlamaRequest(StrictBody):
    """The fields llama-server's completion endpoints share."""

    model: Text | None = None  # default: the one model served
    n_predict: int = Field(default=-1, ge=-1)
    max_tokens: int | None = Field(default=None, ge=-1)  # llama-server's alias of n_predict
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    seed: int = Field(default=-1, ge=-1, lt=2**64)
    stop: list[Text] = Field(default_factory=list)
    stream: bool = False
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = False
    n_probs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    grammar: Text | None = None
    json_schema: dict[str, Any] | None = None
    n_indent: int = Field(default=0, ge=0)
    t_max_predict_ms: int = Field(default=0, ge=0)
    response_fields: list[Text] = Field(default_factory=list)
    # accepted, no effect (module docstring)
    id_slot: int = -1
    cache_prompt: bool = True
    t_max_prompt_ms: int = -1
    samplers: list[Text] | None = None

    @property
    def length(self) -> int:
        """n_predict (max_tokens where given): -1 for the server's default."""
        return self.n_predict if self.max_tokens is None else self.max_tokens

    def completion(
        self, model: str, prompt_ids: list[int], stops: tuple[int, ...] = ()
    ) -> CompletionRequest:
        """The completion this body runs as (llama-server's fields under OpenAI's names);
        APIError 400 naming the field it cannot be."""
        if self.grammar is not None and self.json_schema is not None:
            raise APIError(400, "give grammar or json_schema, not both", "grammar")
        structured: StructuredOutputs | None = None
        if self.grammar is not None:
            structured = StructuredOutputs(grammar=self.grammar)
        elif self.json_schema is not None:
            structured = StructuredOutputs.model_validate({"json": self.json_schema})
        body = CompletionRequest(
            model=model,
            prompt=prompt_ids,
            max_tokens=None if self.length < 0 else max(self.length, 1),
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=None if self.seed < 0 else self.seed,
            stop=self.stop or None,
            stream=self.stream,
            repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(stops),
            logprobs=self.n_probs or None,
            structured_outputs=structured,
        )
        try:
            body.check()
        except APIError as exc:
            raise self.renamed(exc) from None
        return body

    def renamed(self, exc: APIError) -> APIError:
        """`exc` naming this body's field where it names the completion's."""
        if exc.param == "structured_outputs":
            exc.param = "grammar" if self.grammar is not None else "json_schema"
        return exc

    def settings(self, model: str) -> dict[str, Any]:
        """llama-server's `generation_settings`: what this request sampled with."""
        return {
            "model": model,
            "n_predict": self.length,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "repeat_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos,
            "n_probs": self.n_probs,
            "n_indent": self.n_indent,
            "t_max_predict_ms": self.t_max_predict_ms,
            "stream": self.stream,
        }


class NativeCompletion(LlamaRequest):
    """/completion: `prompt` text (special-token text read as those tokens, the tokenizer's
    BOS in front, as llama-server tokenizes it) or token ids."""

    prompt: Text | list[int]

    def prompt_ids(self, tok: Tokenizer, vocab: int) -> list[int]:
        if isinstance(self.prompt, str):
            ids = tok.encode(self.prompt, add_special_tokens=True, parse_special=True)
        else:
            if any(not 0 <= t < vocab for t in self.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
            ids = list(self.prompt)
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        return ids


class ExtraChunk(StrictBody):
    text: Text
    filename: Text = "tmp"


class InfillRequest(LlamaRequest):
    input_prefix: Text
    input_suffix: Text
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: Text = ""

    def prompt_ids(
        self, tok: Tokenizer, fim: FimTokens, context: int, spm: bool = False
    ) -> list[int]:
        extra = [Chunk(c.text, c.filename) for c in self.input_extra]
        return infill_ids(
            tok,
            fim,
            self.input_prefix,
            self.input_suffix,
            extra,
            self.prompt,
            context,
            self.length,
            spm,
        )


class _Rules:
    """llama-server's code-completion stop rules over the answer's text (module docstring)."""

    def __init__(self, body: LlamaRequest) -> None:
        self.n_indent, self.t_max = body.n_indent, body.t_max_predict_ms / 1000.0
        self.scan = 0  # where the next line break to check may be
        self.first: float | None = None  # the first token's arrival

    def cut(self, text: str, new: int) -> int | None:
        """Where the answer `text` ends by a rule, given its text from `new` on just arrived
        (None: it goes on)."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        if self.n_indent > 0:
            while (nl := text.find("\n", self.scan)) >= 0:
                start = nl + 1
                indent = 0
                while start + indent < len(text) and text[start + indent] in " \t":
                    indent += 1
                if start + indent == len(text):  # the line's first character is still to come
                    break
                if indent < self.n_indent:
                    return start + indent
                self.scan = start
        if self.t_max > 0 and "\n" in text[new:] and now - self.first > self.t_max:
            return len(text)
        return None


class NativeRun:
    """One /completion or /infill through its relay: the text as the rules leave it, and the
    final body."""

    def __init__(self, relay: Relay, body: LlamaRequest, model: str, tok: Tokenizer) -> None:
        self.relay, self.body, self.model, self.tok = relay, body, model, tok
        self.rules = _Rules(body)
        self.text = ""
        self.last: RequestOutput | None = None
        self.limited = False  # ended by n_indent or t_max_predict_ms
        self.predicted = 0
        self.probs: list[TokenLogprob] = []  # n_probs: each output token's
        self.new_probs: list[TokenLogprob] = []  # ... of the latest output

    async def pieces(self) -> AsyncIterator[str]:
        """The answer's text as it comes (cut where a rule ends it)."""
        async for _, out in self._outputs():
            self.last = out
            if self.limited:
                continue  # cancelled: its last outputs are dropped
            old = len(self.text)
            self.text += out.text
            self.predicted = out.completion_tokens
            self.new_probs = out.logprobs
            self.probs += out.logprobs
            at = self.rules.cut(self.text, old)
            if at is not None:
                self.text, self.limited = self.text[:at], True
                for c in self.relay.choices:
                    c.handle.cancel()
            if len(self.text) > old:
                yield self.text[old:]

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            async for item in self.relay.outputs():
                yield item
        except Exception as exc:  # the request failed inside the engine; the engine lives on
            raise self.relay.failed(exc) from None

    def partial(self, piece: str) -> dict[str, Any]:
        last = self.last
        assert last is not None
        out = {
            "index": 0,
            "content": piece,
            "tokens": [],
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": last.completion_tokens,
            "tokens_evaluated": last.prompt_tokens,
        }
        if self.body.n_probs:
            out["completion_probabilities"] = self._probs(self.new_probs)
        return out

    def _probs(self, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
        """llama-server's `completion_probabilities`: each token's logprob and its best
        alternatives' (the raw distribution's, as its default `post_sampling_probs` false)."""
        return [
            {
                **self._entry(lp.token, lp.logprob),
                "top_logprobs": [self._entry(t, v) for t, v in lp.top],
            }
            for lp in logprobs
        ]

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text, raw = self.tok.token_text(token), self.tok.token_bytes(token)
        return {"id": token, "token": text, "bytes": list(raw), "logprob": logprob}

    def final(self, content: str) -> dict[str, Any]:
        """llama-server's closing body (`content`: all of the text, or "" after a stream)."""
        last = self.last
        assert last is not None and last.finished
        if self.limited or last.finish_reason == FinishReason.LENGTH:
            stop_type, word = "limit", ""
        elif isinstance(last.stop_reason, str):
            stop_type, word = "word", last.stop_reason
        else:
            stop_type, word = "eos", ""
        predicted = self.predicted if self.limited else last.completion_tokens
        t = last.timing
        first = t.first_token if t.first_token is not None else t.created
        end = t.finished if t.finished is not None else first
        prompt_ms, predicted_ms = (first - t.created) * 1e3, (end - first) * 1e3
        processed = last.prompt_tokens - last.cached_tokens
        timings: dict[str, Any] = {
            "cache_n": last.cached_tokens,
            "prompt_n": processed,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(processed, 1),
            "prompt_per_second": processed / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": predicted,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(predicted, 1),
            "predicted_per_second": predicted / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
        }
        if last.spec.drafted > 0:
            timings["draft_n"] = last.spec.drafted
            timings["draft_n_accepted"] = last.spec.accepted
        out: dict[str, Any] = {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": -1,
            "stop": True,
            "model": self.model,
            "tokens_predicted": predicted,
            "tokens_evaluated": last.prompt_tokens,
            "generation_settings": self.body.settings(self.model),
            "prompt": self.tok.decode(self.relay.prompt_ids or [], skip_special_tokens=False),
            "has_new_line": "\n" in self.text,
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": last.prompt_tokens + predicted,
            "timings": timings,
        }
        if self.body.n_probs and content:
            out["completion_probabilities"] = self._probs(self.probs[:predicted])
        return _fields(out, self.body.response_fields)

    async def body_json(self, request: Request) -> dict[str, Any]:
        watcher = asyncio.create_task(cancel_on_disconnect(request, self.relay.choices))
        try:
            async for _ in self.pieces():
                pass
        finally:
            watcher.cancel()
        return self.final(self.text)

    async def events(self) -> AsyncIterator[str]:
        """llama-server's stream; a failure mid-way is its last event (the error body)."""
        try:
            async for piece in self.pieces():
                yield f"data: {json.dumps(self.partial(piece))}\n\n"
        except APIError as exc:
            yield f"error: {json.dumps(exc.body())}\n\n"
            return
        yield f"data: {json.dumps(self.final(''))}\n\n"


def _fields(body: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: only these ("a/b" reads body["a"]["b"]), each under its
    path; all of `body` when none are named."""
    if not paths:
        return body
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out
