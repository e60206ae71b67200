"""Engine outputs -> OpenAI responses: one JSON body, or Server-Sent Events in the chunk format.

Stage: the HTTP edge, after admission (app.py). A request runs as n sequences (one per choice, or
best_of candidates); `_Relay` merges their outputs, each under its choice index, and builds
message content, tool calls (tools.py), logprobs and usage. The event loop never touches
tensors: every output is text, token ids and floats the engine thread already produced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from quickdraft.engine import EngineDeadError, RequestOutput
from quickdraft.request import SpecStats, TokenLogprob
from quickdraft.server.backend import Handle, ReplicaLostError
from quickdraft.server.metrics import RequestTrack, now
from quickdraft.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from quickdraft.server.reasoning import HarmonyStream, is_harmony, parse_harmony
from quickdraft.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    Speculative,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
)
from quickdraft.server.state import Slot
from quickdraft.server.tools import ToolCallStream, parse_tool_calls
from quickdraft.tokenizer import Tokenizer

log = logging.getLogger("quickdraft.server")


@dataclass
class _Choice:
    """One sequence's accumulated output."""

    handle: Handle
    track: RequestTrack
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # echo: the prompt's (first output's)
    last: RequestOutput | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def mean_logprob(self) -> float:
        lps = self.logprobs
        return sum(lp.logprob for lp in lps) / len(lps) if lps else 0.0


class Relay:
    def __init__(
        self,
        slots: list[Slot],
        body: GenerateRequest,
        rid: str,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.choices = [_Choice(s.handle, s.track) for s in slots]
        self.body = body
        self.rid = rid
        self.tok = tokenizer
        self.chat = isinstance(body, ChatCompletionRequest)
        self.prompt_ids = prompt_ids  # echo: the completion's prompt
        # gpt-oss: the text keeps its harmony markers (app.py), split into channels here
        self.harmony = self.chat and is_harmony(tokenizer)
        self.created = int(time.time())

    # ------------------------------------------------------------------ engine side

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs as they come, tagged with the choice index."""
        if len(self.choices) == 1:  # the common case needs no tasks
            async for out in self._one(0):
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in self._one(i):
                    queue.put_nowait((i, out))
            except Exception as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.choices))]
        try:
            open_ = len(tasks)
            while open_:
                item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _one(self, i: int) -> AsyncIterator[RequestOutput]:
        choice = self.choices[i]
        async for out in choice.handle:
            choice.track.output(out, now())
            if out.finished:
                choice.track.finish(out, now())
            choice.parts.append(out.text)
            choice.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                choice.prompt_logprobs = out.prompt_logprobs
            choice.last = out
            yield out

    # ------------------------------------------------------------------ one JSON body

    async def collect(self, request: Request) -> dict[str, Any]:
        watcher = asyncio.create_task(cancel_on_disconnect(request, self.choices))
        try:
            async for _ in self.outputs():
                pass
        except Exception as exc:  # the request failed inside the engine; the engine lives on
            raise self.failed(exc) from None
        finally:
            watcher.cancel()
        ran = self.choices
        for c in ran:
            assert c.last is not None and c.last.finished, "every stream ends with a reason"
        kept = ran
        if len(ran) > self.body.choices:  # best_of: the most likely candidates, in run order
            best = sorted(range(len(ran)), key=lambda i: -ran[i].mean_logprob)[: self.body.choices]
            kept = [ran[i] for i in sorted(best)]
        usage, spec = self._usage(ran), Speculative.of(_merged(ran))
        result: BaseModel
        if self.chat:
            result = ChatCompletion(
                id=self.rid,
                created=self.created,
                model=self.body.model,
                choices=[self._chat_choice(i, c) for i, c in enumerate(kept)],
                usage=usage,
                speculative=spec,
            )
        else:
            result = Completion(
                id=self.rid,
                created=self.created,
                model=self.body.model,
                choices=[self._completion_choice(i, c) for i, c in enumerate(kept)],
                usage=usage,
                speculative=spec,
            )
        data = result.model_dump()
        for choice in data["choices"]:  # reasoning_content only where a model reasons
            if choice.get("message", {}).get("reasoning_content", "") is None:
                del choice["message"]["reasoning_content"]
        if self.body.prompt_logprobs is not None:  # vLLM's extension, where asked
            for choice, c in zip(data["choices"], kept, strict=True):
                choice["prompt_logprobs"] = self._prompt_logprobs(c.prompt_logprobs)
        return data

    @property
    def _tools(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest) and self.body.calls_tools

    def _chat_choice(self, index: int, c: _Choice) -> ChatChoice:
        assert c.last is not None
        reason = str(c.last.finish_reason)
        content: str | None = c.text
        calls, reasoning = None, None
        if self.harmony:
            parsed = parse_harmony(c.text)
            content, reasoning = parsed.content, parsed.reasoning
            if parsed.calls:
                calls, reason = parsed.calls, "tool_calls"
        elif self._tools:
            content, found = parse_tool_calls(c.text)
            if found:  # vLLM's rule: a response that called tools ends with "tool_calls"
                calls, reason = found, "tool_calls"
        return ChatChoice(
            index=index,
            message=AssistantMessage(
                content=content, tool_calls=calls, reasoning_content=reasoning
            ),
            finish_reason=reason,
            logprobs=self._chat_logprobs(c.logprobs),
            stop_reason=c.last.stop_reason,
        )

    def _completion_choice(self, index: int, c: _Choice) -> CompletionChoice:
        assert c.last is not None
        logprobs = self._completion_logprobs(c.logprobs)
        text = c.text
        if isinstance(self.body, CompletionRequest) and self.body.echo:  # the prompt first
            text = self._echo_text() + text
            if logprobs is not None:
                logprobs = self._echoed(c.prompt_logprobs or [], logprobs)
        return CompletionChoice(
            index=index,
            text=text,
            finish_reason=str(c.last.finish_reason),
            logprobs=logprobs,
            stop_reason=c.last.stop_reason,
        )

    def _echo_text(self) -> str:
        """The completion's prompt as text (as sent, or its ids decoded, specials kept)."""
        assert isinstance(self.body, CompletionRequest)
        prompt = self.body.single_prompt()
        return prompt if isinstance(prompt, str) else self.tok.decode(prompt, False)

    def _echo_part(self, scored: list[TokenLogprob]) -> tuple[str, CompletionLogprobs | None]:
        """An echoed prompt's text, and its logprobs where the request asks for them."""
        assert isinstance(self.body, CompletionRequest)
        text = self._echo_text()
        if self.body.logprobs is None:
            return text, None
        tops: list[dict[str, float] | None] | None = [] if self.body.logprobs > 0 else None
        empty = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=tops, text_offset=[])
        return text, self._echoed(scored, empty)

    def _echoed(self, scored: list[TokenLogprob], out: CompletionLogprobs) -> CompletionLogprobs:
        """`out` with the prompt's tokens in front: the first without a logprob (nothing
        precedes it), the others with the prefill's; offsets over the prompt's text."""
        assert self.prompt_ids is not None
        tokens = [self.tok.token_text(t) for t in self.prompt_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        k = self.body.logprobs if isinstance(self.body, CompletionRequest) else None
        top: list[dict[str, float] | None] = [None]
        top += [{self.tok.token_text(t): v for t, v in lp.top[:k]} for lp in scored]
        return CompletionLogprobs(
            tokens=tokens + out.tokens,
            token_logprobs=[None, *(lp.logprob for lp in scored), *out.token_logprobs],
            top_logprobs=None if out.top_logprobs is None else top + list(out.top_logprobs),
            text_offset=offsets + [at + o for o in out.text_offset],
        )

    def _prompt_logprobs(self, scored: list[TokenLogprob] | None) -> list[Any] | None:
        """vLLM's `prompt_logprobs` of a choice: None for the first prompt token, then per
        token {id: {logprob, rank, decoded_token}} of it and its best alternatives."""
        k = self.body.prompt_logprobs
        if k is None or scored is None:
            return None

        def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.tok.token_text(token)}

        out: list[Any] = [None]
        for lp in scored:
            row = {str(t): entry(t, v, r + 1) for r, (t, v) in enumerate(lp.top[:k])}
            row.setdefault(str(lp.token), entry(lp.token, lp.logprob, lp.rank))
            out.append(row)
        return out

    def _usage(self, ran: list[_Choice]) -> Usage:
        last = [c.last for c in ran if c.last is not None]
        completion = sum(o.completion_tokens for o in last)
        cached = max((o.cached_tokens for o in last), default=0)
        return Usage.of(last[0].prompt_tokens if last else 0, completion, cached)

    # ------------------------------------------------------------------ logprobs

    def _entry(self, token: int, logprob: float) -> TopLogprob:
        return TopLogprob(
            token=self.tok.token_text(token),
            logprob=logprob,
            bytes=list(self.tok.token_bytes(token)),
        )

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs | None:
        if not (isinstance(self.body, ChatCompletionRequest) and self.body.logprobs):
            return None
        content = []
        for lp in lps:
            e = self._entry(lp.token, lp.logprob)
            top = [self._entry(t, v) for t, v in lp.top]
            content.append(TokenLogprobEntry(**e.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _completion_logprobs(
        self, lps: list[TokenLogprob], offset: int = 0
    ) -> CompletionLogprobs | None:
        if not (isinstance(self.body, CompletionRequest) and self.body.logprobs is not None):
            return None
        tokens = [self.tok.token_text(lp.token) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        tops: list[dict[str, float] | None] = [
            {self.tok.token_text(t): v for t, v in lp.top} for lp in lps
        ]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in lps],
            top_logprobs=tops if self.body.logprobs > 0 else None,
            text_offset=offsets,
        )

    # ------------------------------------------------------------------ SSE

    async def events(self) -> AsyncIterator[str]:
        n = len(self.choices)
        streams = [ToolCallStream() for _ in range(n)]
        channels = [HarmonyStream() for _ in range(n)]
        offsets = [0] * n
        finished = 0
        echo = isinstance(self.body, CompletionRequest) and bool(self.body.echo)
        echoed = [False] * n
        try:
            if self.chat:  # OpenAI opens with the role (lets clients render before token 1)
                for i in range(n):
                    yield self._chunk(i, Delta(role="assistant", content=""))
            async for i, out in self.outputs():
                if echo and not echoed[i]:  # the prompt first, as one chunk
                    echoed[i] = True
                    prompt, scored = self._echo_part(out.prompt_logprobs or [])
                    yield self._chunk(
                        i, Delta(), text=prompt, ready=scored, prompt=out.prompt_logprobs
                    )
                    offsets[i] = len(prompt) if scored is None else sum(map(len, scored.tokens))
                elif out.prompt_logprobs is not None and self.body.prompt_logprobs is not None:
                    yield self._chunk(i, Delta(), prompt=out.prompt_logprobs)  # vLLM's, first
                text, calls, reasoning = out.text, None, ""
                if self.harmony:
                    reasoning, text, found = channels[i].push(text)
                    if out.finished:
                        r, t, more = channels[i].flush()
                        reasoning, text, found = reasoning + r, text + t, found + more
                    calls = found or None
                elif self._tools:
                    text, found = streams[i].push(text)
                    if out.finished:
                        text += streams[i].flush()
                    calls = found or None
                if text or reasoning or calls or out.logprobs:
                    yield self._chunk(
                        i,
                        Delta(
                            content=text if text or not (calls or reasoning) else None,
                            reasoning_content=reasoning or None,
                            tool_calls=calls,
                        ),
                        text=text,
                        logprobs=out.logprobs,
                        offset=offsets[i],
                    )
                    offsets[i] += sum(len(self.tok.token_text(lp.token)) for lp in out.logprobs)
                if out.finished:
                    reason = str(out.finish_reason)
                    if streams[i].calls or channels[i].done:
                        reason = "tool_calls"
                    finished += 1  # the last choice to finish carries the telemetry
                    spec = Speculative.of(_merged(self.choices)) if finished == n else None
                    yield self._chunk(
                        i, Delta(), reason=reason, spec=spec, stop_reason=out.stop_reason
                    )
            if self.body.include_usage:
                spec = Speculative.of(_merged(self.choices))
                yield self._chunk(None, None, usage=self._usage(self.choices), spec=spec)
        except Exception as exc:  # as in collect(), but in-band: the stream has started
            yield _sse(self.failed(exc).body())
        yield "data: [DONE]\n\n"

    def failed(self, exc: Exception) -> APIError:
        for c in self.choices:
            if not c.track.done:
                c.track.abort(c.handle.id, now(), reason="error")
        if isinstance(exc, ReplicaLostError):  # the other replicas serve: worth a retry
            retry = {"Retry-After": "1"}
            return APIError(503, f"{exc}; retry", code="replica_lost", headers=retry)
        if isinstance(exc, EngineDeadError):
            return APIError(503, str(exc), code="engine_dead")
        log.error("request %s failed: %r", self.rid, exc)  # the reply does not quote it
        return APIError(500, "generation failed (logged)", code="generation_failed")

    def _chunk(
        self,
        index: int | None,
        delta: Delta | None,
        text: str = "",
        reason: str | None = None,
        usage: Usage | None = None,
        spec: Speculative | None = None,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
        ready: CompletionLogprobs | None = None,
        prompt: list[TokenLogprob] | None = None,
        stop_reason: int | str | None = None,
    ) -> str:
        """One SSE event. `delta` None = the closing chunk (`choices: []`: usage, speculation);
        `ready`: a completion chunk's logprobs as they are (an echoed prompt's)."""
        chunk: BaseModel
        lps = logprobs or []
        if self.chat:
            choices = []
            if delta is not None and index is not None:
                chat_lps = self._chat_logprobs(lps) if logprobs is not None else None
                choices = [
                    ChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=chat_lps)
                ]
            chunk = ChatCompletionChunk(
                id=self.rid, created=self.created, model=self.body.model, choices=choices
            )
        else:
            c_choices = []
            if delta is not None and index is not None:
                c_lps = ready
                if logprobs is not None:
                    c_lps = self._completion_logprobs(lps, offset)
                c_choices = [
                    CompletionChoice(index=index, text=text, finish_reason=reason, logprobs=c_lps)
                ]
            chunk = Completion(
                id=self.rid, created=self.created, model=self.body.model, choices=c_choices
            )
        data = chunk.model_dump()
        for choice in data["choices"]:
            if reason is None:  # vLLM's stop_reason: on the chunk that finishes the choice
                choice.pop("stop_reason", None)
            else:
                choice["stop_reason"] = stop_reason
            if "delta" in choice:  # OpenAI sends only the delta fields that are set
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            if prompt is not None and self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(prompt)
        # with include_usage every chunk carries "usage" (null until the last); otherwise none
        if self.body.include_usage:
            data["usage"] = None if usage is None else usage.model_dump()
        else:
            data.pop("usage")
        if spec is None:
            data.pop("speculative")
        else:
            data["speculative"] = spec.model_dump()
        return _sse(data)


def _merged(choices: list[_Choice]) -> SpecStats:
    """One telemetry block for all of a request's sequences (sums)."""
    stats = [c.last.spec for c in choices if c.last is not None]
    if len(stats) == 1:
        return stats[0]
    out = SpecStats(method=stats[0].method if stats else "none")
    for s in stats:
        out.cycles += s.cycles
        out.drafted += s.drafted
        out.accepted += s.accepted
        for name in ("accepted_per_position", "drafted_per_position"):
            mine, theirs = getattr(out, name), getattr(s, name)
            mine += [0] * (len(theirs) - len(mine))
            for j, v in enumerate(theirs):
                mine[j] += v
    return out


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def cancel_on_disconnect(request: Request, choices: list[_Choice]) -> None:
    """For non-stream requests: the body has been read, so the next ASGI message is the
    client going away (or the server finishing the response); cancel the request then."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for c in choices:
                c.handle.cancel()
            return
