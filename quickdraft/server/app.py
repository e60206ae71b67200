"""The OpenAI-compatible HTTP server: `create_app(engine, config)` -> a FastAPI app.
(Over 400 lines: every route shares one admission path and one closure over the server state;
each API's own shapes live in its module: responses_api, messages_api, llama_api, tokens.)

Stage: the HTTP edge. Routes turn a validated request into token ids (chat through the model's
own chat template), submit it to the engine, and relay the engine's outputs either as one JSON
body or as Server-Sent Events in OpenAI's chunk format. The event loop never touches tensors:
the engine thread owns the models and hands back text deltas through each request's handle.
/v1/responses runs as a chat request whose answer responses_api.py reshapes, after the stored
conversation it continues (responses_store.py keeps them); Anthropic's /v1/messages runs as a
chat request too (messages_api.py); llama-server's /completion and /infill run as completions
answered in its shapes (llama_api.py); /tokenize and /detokenize (tokens.py) use the same
rendering and generate nothing.

The routes talk to a `Backend` (backend.py): the one in-process engine, or engine replicas
behind Ray (quickdraft/cluster/). Each request carries a route key, the prefix it shares with
other requests (chat: the tools and the turns up to the first user message; completions: the
first `ROUTE_PREFIX_TOKENS` prompt tokens; both per tenant), so a cluster runs it where that
prefix is cached.

Lifetime of a request: admit (a concurrency slot; 503 + Retry-After when full or shutting
down) -> submit -> relay outputs -> release the slot. Release cancels the handle, so a client
that disconnects (or any failure on our side) frees its sequence at the engine's next step.
Who may call at all is decided before any route, in access.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from quickdraft import __version__
from quickdraft.engine import Engine, EngineDeadError, QueueFullError
from quickdraft.grammar import GrammarError
from quickdraft.images import ImageError, ImageInput
from quickdraft.infill import FimTokens, InfillError, completion_ids
from quickdraft.loading import ContextLengthError
from quickdraft.request import SamplingParams
from quickdraft.server import admin
from quickdraft.server.access import (
    ApiKeyMiddleware,
    HostCheckMiddleware,
    credentials,
    key_index,
    tenant_of,
)
from quickdraft.server.backend import Backend, LocalBackend, ModelFront, ReplicaLostError
from quickdraft.server.embeddings import EmbeddingRequest, declared_pooling, embedding_body
from quickdraft.server.errors import BodyLimitMiddleware, error_response, install_error_handlers
from quickdraft.server.llama_api import InfillRequest, LlamaRequest, NativeCompletion, NativeRun
from quickdraft.server.media import read_media
from quickdraft.server.messages_api import (
    MessagesInput,
    MessagesRequest,
    message_body,
    message_events,
)
from quickdraft.server.metrics import now
from quickdraft.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from quickdraft.server.reasoning import is_harmony
from quickdraft.server.relay import Relay
from quickdraft.server.responses import (
    ModelCard,
    ModelList,
)
from quickdraft.server.responses_api import (
    InputItem,
    ResponsesRequest,
    as_stored,
    continued,
    queued,
    response_body,
    response_events,
)
from quickdraft.server.responses_store import LIST_LIMIT, EventLog
from quickdraft.server.settings import SpeculationSettings
from quickdraft.server.state import ServerConfig, ServerState, Slot
from quickdraft.server.tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from quickdraft.server.tools import hermes_messages
from quickdraft.videos import VideoInput, expand_videos

log = logging.getLogger("quickdraft.server")
# a completion prompt's route key covers this many leading tokens (a system prompt's worth)
ROUTE_PREFIX_TOKENS = 64


def create_app(
    engine: Engine | Backend,
    config: ServerConfig | None = None,
    settings: dict[str, SpeculationSettings] | None = None,
) -> FastAPI:
    """`engine`: a started quickdraft.engine.Engine (or a Backend); `settings`: the speculation
    settings the engine was configured with (from the settings file), if any."""
    backend = LocalBackend(engine) if isinstance(engine, Engine) else engine
    state = ServerState.create(backend, config or ServerConfig(), settings)
    app = FastAPI(title="quickdraft", docs_url=None, redoc_url=None)
    app.state.qd = state
    install_error_handlers(app, state.metrics.error)
    # the last added runs first: Host / Origin, then the key, before any body byte is read
    on_error = state.metrics.error
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=state.config.max_body_bytes, on_error=on_error
    )
    app.add_middleware(ApiKeyMiddleware, api_keys=state.config.api_keys, on_error=on_error)
    hosts = state.config.allowed_hosts
    app.add_middleware(HostCheckMiddleware, allowed_hosts=hosts, on_error=on_error)
    app.include_router(admin.router(state))

    @app.get("/health")
    async def health() -> JSONResponse:
        eng = state.engine
        if not eng.alive:
            # what killed it is in the server log (the engine logs it), not in this reply
            why = " (it failed: see the server log)" if eng.error is not None else ""
            err = APIError(503, f"the engine thread is not running{why}", code="engine_dead")
            return error_response(err)
        devices = {name: served.lm.device for name, served in eng.models.items()}
        return JSONResponse(
            {
                "status": "ok",
                "running": eng.num_running,
                "waiting": eng.num_waiting,
                "devices": devices,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.scrape(state.engine.num_running, state.engine.num_waiting)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def card(name: str) -> ModelCard:
        served = state.engine.models[name]
        return ModelCard(
            id=name,
            created=state.started,
            max_model_len=served.lm.context_length,
            speculative_method=served.spec_config.method,
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in state.engine.models])

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> ModelCard:
        _model(state, name)  # 404 naming the served models
        return card(name)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.check()
        return await _chat(state, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        store, owner = state.responses, _owner(state, request)
        history: list[InputItem] = []
        if body.previous_response_id is not None:
            if not store.enabled:
                why = "this server stores no responses (--responses-store-mb 0)"
                msg = f"previous_response_id: {why}; send the conversation in `input`"
                raise APIError(400, msg, "previous_response_id")
            earlier = store.get(body.previous_response_id, owner, "previous_response_id")
            history = earlier.items + continued(earlier.response["output"])
        keep = store.enabled and body.store is not False
        items = history + as_stored(body.items())  # what a stored response answered
        body.to_chat(history)  # its 400s before anything runs
        if body.background:
            if not keep:
                msg = "background: a background response is kept to be polled; it needs store"
                raise APIError(400, msg, "background")
            response = queued(body)
            store.put(owner, items, response)
            log = state.streams.open(response["id"]) if body.stream else None
            state.background[response["id"]] = asyncio.create_task(
                _background(state, body, history, request, owner, items, response, log)
            )
            if log is not None:  # its events as they come; it runs on if this client leaves
                return StreamingResponse(
                    log.follow(), media_type="text/event-stream", headers=_SSE_HEADERS
                )
            return JSONResponse(response)
        answer = await _respond(state, body, history, request)
        if isinstance(answer, StreamingResponse):  # the chat chunks become response events
            put = (lambda response: store.put(owner, items, response)) if keep else None
            answer.body_iterator = response_events(answer.body_iterator, body, put)
            return answer
        chat = json.loads(bytes(answer.body))
        response = response_body(chat, body, keep)
        if keep and not store.put(owner, items, response):
            response["store"] = False  # larger than the whole store
        return JSONResponse(response, headers=_placement_headers(answer))

    @app.get("/v1/responses/{rid}")
    async def stored_response(
        rid: str, request: Request, stream: bool = False, starting_after: int = -1
    ) -> Response:
        stored = state.responses.get(rid, _owner(state, request))
        if not stream:
            return JSONResponse(stored.response)
        log = state.streams.get(rid)
        if log is None:
            why = "only a background response created with stream: true streams again"
            raise APIError(400, f"response {rid!r} has no events to stream: {why}", "stream")
        if starting_after < -1:
            msg = f"starting_after must be >= -1, got {starting_after}"
            raise APIError(400, msg, "starting_after")
        return StreamingResponse(
            log.follow(starting_after), media_type="text/event-stream", headers=_SSE_HEADERS
        )

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request) -> dict[str, Any]:
        state.responses.delete(rid, _owner(state, request))
        return {"id": rid, "object": "response", "deleted": True}

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel_response(rid: str, request: Request) -> JSONResponse:
        stored = state.responses.get(rid, _owner(state, request))
        task = state.background.get(rid)
        if task is None:
            if not stored.response.get("background"):
                msg = f"response {rid!r} was not created in the background: nothing to cancel"
                raise APIError(400, msg, code="not_background")
            return JSONResponse(stored.response)  # it has already ended
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        state.background.pop(rid, None)
        now = state.responses.get(rid, stored.owner)
        if now.response["status"] in ("queued", "in_progress"):  # cancelled before it ran
            state.responses.put(now.owner, now.items, {**now.response, "status": "cancelled"})
            now = state.responses.get(rid, stored.owner)
        return JSONResponse(now.response)

    @app.get("/v1/responses/{rid}/input_items")
    async def input_items(
        rid: str,
        request: Request,
        limit: int = LIST_LIMIT,
        order: str = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be in [1, 100], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", "order")
        stored = state.responses.get(rid, _owner(state, request))
        return stored.input_items(limit, order, after)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrived = now()
        body.check()
        lm = _model(state, body.model)
        prompt = body.single_prompt()
        fim = _fim(lm, "suffix") if body.suffix else None
        if isinstance(prompt, str):
            prompt_ids = lm.tokenizer.encode(
                prompt, add_special_tokens=fim is None, parse_special=body.parse_special_tokens
            )
        else:
            vocab = lm.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
            prompt_ids = list(prompt)
        if fim is not None:  # the prompt is the text before the gap, `suffix` the text after
            assert body.suffix is not None
            prompt_ids = completion_ids(lm.tokenizer, fim, prompt_ids, body.suffix)
            body.stop_token_ids = [*(body.stop_token_ids or ()), *fim.stops]
        shared = prompt_ids[:ROUTE_PREFIX_TOKENS]
        return await _generate(state, request, body, prompt_ids, "completion", arrived, shared)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        arrived = now()
        lm = _model(state, body.model)
        inputs = body.token_lists(lm.tokenizer, lm.vocab_size, lm.context_length)
        pooling = state.config.pooling or declared_pooling(lm.path) or "last"
        vectors = await _embed(state, request, body, inputs, pooling, arrived)
        return JSONResponse(embedding_body(body, vectors, sum(map(len, inputs))))

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        answer = await _chat(state, body.chat(), request)
        if isinstance(answer, StreamingResponse):  # the chat chunks become Messages events
            answer.body_iterator = message_events(answer.body_iterator, body)
            return answer
        chat = json.loads(bytes(answer.body))
        return JSONResponse(message_body(chat, body), headers=_placement_headers(answer))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesInput) -> dict[str, int]:
        chat = body.to_chat()
        media, prompt_ids, _, _ = await _chat_prompt(state, chat)
        lm = _model(state, body.model)
        return {"input_tokens": _prompt_tokens(lm, prompt_ids, _frames(media))}

    @app.post("/completion")
    @app.post("/completions")
    async def native_completion(body: NativeCompletion, request: Request) -> Response:
        arrived = now()
        name = _native_model(state, body.model)
        lm = _model(state, name)
        prompt_ids = body.prompt_ids(lm.tokenizer, lm.vocab_size)
        return await _native(state, request, body, name, prompt_ids, (), arrived)

    @app.post("/infill")
    async def infill(body: InfillRequest, request: Request) -> Response:
        arrived = now()
        name = _native_model(state, body.model)
        lm = _model(state, name)
        fim = _fim(lm, "input_prefix")
        prompt_ids = body.prompt_ids(lm.tokenizer, fim, lm.context_length, state.config.spm_infill)
        return await _native(state, request, body, name, prompt_ids, fim.stops, arrived)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        lm = _model(state, body.model)
        if isinstance(body, TokenizeChatRequest):
            body.check()
            if body.media_parts():
                param = body.media_parts()[0][0]
                msg = "/tokenize takes text: image and video rows count in a completion's usage"
                raise APIError(400, f"{param}: {msg}", param)
            ids, _, _ = _chat_ids(lm, body, [])
            if body.add_special_tokens:  # the tokenizer's own additions (a BOS) in front
                ids = lm.tokenizer.encode("", add_special_tokens=True) + ids
        else:
            text = body.prompt
            ids = lm.tokenizer.encode(
                text, body.add_special_tokens, parse_special=body.parse_special_tokens
            )
        strs = None
        if body.return_token_strs:
            strs = [lm.tokenizer.vocab_entry(t) or "" for t in ids]
        return TokenizeResponse(
            count=len(ids), max_model_len=lm.context_length, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        lm = _model(state, body.model)
        vocab = lm.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=lm.tokenizer.decode(body.tokens, False))

    return app


def _native_model(state: ServerState, name: str | None) -> str:
    """The model a llama-server body names, or the one served (it may name none)."""
    if name is not None:
        return name
    if len(state.engine.models) != 1:
        raise APIError(400, "several models are served: name one in `model`", "model")
    (only,) = state.engine.models
    return only


async def _native(
    state: ServerState,
    request: Request,
    body: LlamaRequest,
    name: str,
    prompt_ids: list[int],
    stops: tuple[int, ...],
    arrived: float,
) -> Response:
    """A llama-server body run as a completion of `prompt_ids` and answered in its shapes."""
    completion = body.completion(name, prompt_ids, stops)
    shared = prompt_ids[:ROUTE_PREFIX_TOKENS]
    try:
        relay, slots, where = await _start(
            state, request, completion, prompt_ids, "completion", arrived, shared
        )
    except APIError as exc:  # a grammar that does not compile: the body's field
        raise body.renamed(exc) from None
    run = NativeRun(relay, body, name, _model(state, name).tokenizer)
    return await _reply(slots, where, body.stream, run.events, partial(run.body_json, request))


def _credentials(request: Request) -> str:
    return credentials(request.headers.get("authorization"), request.headers.get("x-api-key"))


def _fim(lm: ModelFront, param: str) -> FimTokens:
    """The served model's fill-in-the-middle tokens; a 400 naming `param` where it has none."""
    try:
        return FimTokens.of(lm.tokenizer, param)
    except InfillError as exc:
        raise APIError(400, str(exc), exc.param) from None


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    """A checked chat request run: its media read, its prompt rendered, then `_generate`."""
    arrived = now()
    media, prompt_ids, messages, tools = await _chat_prompt(state, body)
    root = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    # the conversation's start (stays as it grows), its images and videos by content
    early = sum(len(m.media_urls()) for m in body.messages[: root + 1])
    shared = [tools, messages[: root + 1], [m.digest for m in media[:early]]]
    images = _frames(media)
    return await _generate(state, request, body, prompt_ids, "chat", arrived, shared, images)


async def _chat_prompt(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[list[ImageInput | VideoInput], list[int], list[dict[str, Any]], Any]:
    """A chat request's media (read under the operator's policy), prompt ids, rendered
    messages and tools."""
    lm = _model(state, body.model)
    media = await read_media(
        body.media_parts(),
        lm.image_processing,
        lm.video_processing,
        state.config.media,
        body.model,
    )
    prompt_ids, messages, tools = _chat_ids(lm, body, media)
    return media, prompt_ids, messages, tools


def _frames(media: list[ImageInput | VideoInput]) -> list[ImageInput]:
    """The images a prompt holds: each image, each video's frames."""
    return [f for m in media for f in (m.frames if isinstance(m, VideoInput) else (m,))]


def _prompt_tokens(lm: ModelFront, prompt_ids: list[int], images: list[ImageInput]) -> int:
    """The prompt as the model sees it: each image placeholder becomes the image's rows."""
    merge = lm.image_processing.merge_size if lm.image_processing is not None else 1
    return len(prompt_ids) + sum(im.num_tokens(merge) - 1 for im in images)


def _placement_headers(response: Response) -> dict[str, str]:
    """The placement headers `_generate` set on a response (which replica ran it)."""
    return {k: v for k, v in response.headers.items() if k.lower().startswith("x-")}


def _model(state: ServerState, name: str) -> ModelFront:
    served = state.engine.models.get(name)
    if served is None:
        raise APIError(
            404,
            f"model {name!r} does not exist; this server serves {sorted(state.engine.models)}",
            "model",
            "model_not_found",
        )
    return served.lm


async def _generate(
    state: ServerState,
    request: Request,
    body: GenerateRequest,
    prompt_ids: list[int],
    kind: str,
    arrived: float,
    shared: list[Any],
    images: list[ImageInput] | None = None,
) -> Response:
    """`_start`'s run answered: one JSON body, or its events."""
    relay, slots, where = await _start(
        state, request, body, prompt_ids, kind, arrived, shared, images
    )
    return await _reply(
        slots, where, bool(body.stream), relay.events, partial(relay.collect, request)
    )


async def _reply(
    slots: list[Slot],
    where: dict[str, str],
    stream: bool,
    events: Callable[[], AsyncIterator[str]],
    collect: Callable[[], Awaitable[dict[str, Any]]],
) -> Response:
    """An admitted run's answer: its `events` streamed, or the body `collect` returns; either
    way its slots are released when it ends."""
    if stream:
        headers = {**_SSE_HEADERS, **where}
        return _SlotStreamingResponse(
            slots, events(), media_type="text/event-stream", headers=headers
        )
    try:
        return JSONResponse(await collect(), headers=where)
    finally:
        for slot in slots:
            slot.release()


async def _start(
    state: ServerState,
    request: Request,
    body: GenerateRequest,
    prompt_ids: list[int],
    kind: str,
    arrived: float,
    shared: list[Any],
    images: list[ImageInput] | None = None,
) -> tuple[Relay, list[Slot], dict[str, str]]:
    """A checked request admitted: its relay, its slots (the caller releases them) and the
    headers naming where it runs. `shared`: the part of the request other requests may share
    (its route key); `images`: one per image placeholder of `prompt_ids`."""
    lm = _model(state, body.model)
    requested = body.requested_max_tokens()
    images = images or []
    prompt_tokens = _prompt_tokens(lm, prompt_ids, images)
    try:
        room = lm.room(prompt_tokens, requested)
    except ContextLengthError as exc:
        param = exc.param if exc.param != "prompt" else ("messages" if kind == "chat" else "prompt")
        raise APIError(400, str(exc), param, "context_length_exceeded") from None
    vocab = lm.vocab_size
    if any(t >= vocab for t in body.stop_token_ids or ()):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
    max_tokens = requested or min(state.config.default_max_tokens, room)
    runs = body.candidates if isinstance(body, CompletionRequest) else body.choices
    if runs > state.config.max_concurrency:  # each choice is a request: it could never run
        param = "best_of" if runs > body.choices else "n"
        limit = state.config.max_concurrency
        raise APIError(
            400, f"{param} ({runs}) exceeds the server's {limit} concurrent requests", param
        )
    try:
        params = [body.sampling(max_tokens, i) for i in range(runs)]
    except ValueError as exc:
        raise APIError(400, str(exc), getattr(exc, "param", None)) from None
    if kind == "chat" and is_harmony(lm.tokenizer):  # the relay reads the channels' markers
        params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    grammar = params[0].grammar
    if grammar is not None:  # compiled off the event loop (the first one reads the vocabulary)
        try:
            await asyncio.to_thread(lm.grammar_compiler().compile, grammar)
        except GrammarError as exc:
            raise APIError(400, str(exc), exc.param) from None
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    cfg = state.config
    who = tenant_of(_credentials(request), cfg.api_keys, body.user, cfg.ngram_shared_scope)
    key = _route_key(who, shared)
    slots: list[Slot] = []
    try:
        for i, p in enumerate(params):
            seq_id = rid if i == 0 else f"{rid}-{i}"
            slots.append(
                _admit(
                    state,
                    body.model,
                    prompt_ids,
                    p,
                    seq_id,
                    arrived,
                    who,
                    key,
                    images,
                    prompt_tokens,
                )
            )
        where = await _placement(state, slots)
    except BaseException:
        for slot in slots:
            slot.release()
        raise
    return Relay(slots, body, rid, lm.tokenizer, prompt_ids), slots, where


async def _respond(
    state: ServerState, body: ResponsesRequest, history: list[InputItem], request: Request
) -> Response:
    """The chat answer to `body` after the conversation `history`; with truncation "auto",
    the oldest turns dropped (a user message at a time) while the prompt does not fit."""
    starts = body.turn_starts(history) if body.truncation == "auto" else []
    skip = 0
    while True:
        try:
            return await _chat(state, body.to_chat(history, skip), request)
        except APIError as exc:
            if exc.code != "context_length_exceeded" or not starts:
                raise
            skip = starts.pop(0)


async def _background(
    state: ServerState,
    body: ResponsesRequest,
    history: list[InputItem],
    request: Request,
    owner: int | None,
    items: list[InputItem],
    response: dict[str, Any],
    log: EventLog | None = None,
) -> None:
    """A background response's run: in progress, then its answer under the id it was given
    (failed with the error, or cancelled), each state stored where GET finds it; streamed
    (`log`), its events as they come. The HTTP request has been answered (or its stream
    follows `log`), so the run reads no disconnect from it."""
    store, rid = state.responses, response["id"]

    async def never() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    detached = Request(request.scope, never)
    try:
        store.put(owner, items, {**response, "status": "in_progress"})
        answer = await _respond(state, body, history, detached)
        if log is not None:
            await _follow(answer, body, log, lambda r: store.put(owner, items, r), response)
            return
        done = response_body(json.loads(bytes(answer.body)), body, True, rid)
        done["created_at"] = response["created_at"]
        store.put(owner, items, done)
    except asyncio.CancelledError:
        store.put(owner, items, {**response, "status": "cancelled"})
        raise
    except Exception as exc:
        err = exc if isinstance(exc, APIError) else APIError(500, f"the response failed: {exc}")
        error = {"code": err.code or "server_error", "message": err.message}
        store.put(owner, items, {**response, "status": "failed", "error": error})
    finally:
        state.background.pop(rid, None)
        if log is not None:
            log.close()


async def _follow(
    answer: Response,
    body: ResponsesRequest,
    log: EventLog,
    keep: Callable[[dict[str, Any]], object],
    response: dict[str, Any],
) -> None:
    """A streamed background response's chat stream into `log` as Responses events, the final
    Response given to `keep`; its slots released however it ends."""
    assert isinstance(answer, _SlotStreamingResponse)
    events = response_events(answer.body_iterator, body, keep, response)
    try:
        async for event in events:
            log.append(event)
    finally:
        await events.aclose()
        for slot in answer.slots:
            slot.release()


def _owner(state: ServerState, request: Request) -> int | None:
    """Whose stored responses a request sees: its API key's (None where the server has none)."""
    keys = state.config.api_keys
    return key_index(_credentials(request), keys) if keys else None


async def _embed(
    state: ServerState,
    request: Request,
    body: EmbeddingRequest,
    inputs: list[list[int]],
    pooling: str,
    arrived: float,
) -> list[list[float]]:
    """Each input's pooled vector, in order: prefill-only requests (SamplingParams.pooling;
    they never speculate), admitted as many at a time as the server has room for (a wave waits
    for the one before it; no room at all: 503, as for any request)."""
    cfg = state.config
    who = tenant_of(_credentials(request), cfg.api_keys, body.user, cfg.ngram_shared_scope)
    params = SamplingParams(max_tokens=1, pooling=pooling)
    rid = f"embd-{uuid.uuid4().hex}"
    vectors: list[list[float]] = []
    while len(vectors) < len(inputs):
        room = max(1, cfg.max_concurrency - state.in_flight)
        slots: list[Slot] = []
        try:
            for ids in inputs[len(vectors) : len(vectors) + room]:
                seq_id = f"{rid}-{len(vectors) + len(slots)}"
                key = _route_key(who, ids[:ROUTE_PREFIX_TOKENS])
                slots.append(
                    _admit(state, body.model, ids, params, seq_id, arrived, who, key, [], len(ids))
                )
            vectors += await asyncio.gather(*(_pooled(state, slot) for slot in slots))
        finally:
            for slot in slots:
                slot.release()
    return vectors


async def _pooled(state: ServerState, slot: Slot) -> list[float]:
    """The pooled vector an embedding request's last output carries, once it has a place
    (each placed and read on its own: a Ray replica's stream is read as it comes)."""
    await _placement(state, [slot])
    last = None
    try:
        async for out in slot.handle:
            last = out
    except EngineDeadError as exc:  # a replica lost included
        raise _refused(state, exc) from None
    assert last is not None and last.embedding is not None, "a pooling request's last output"
    slot.track.finish(last, now())
    return last.embedding


def _route_key(tenant: str, shared: list[Any]) -> str:
    """Equal for requests that share a cacheable prefix; the prefix cache is per tenant."""
    text = json.dumps([tenant, shared], separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


async def _placement(state: ServerState, slots: list[Slot]) -> dict[str, str]:
    """The response headers saying where the request runs (its first choice's place)."""
    try:
        return await state.engine.placement(slots[0].handle)
    except (QueueFullError, EngineDeadError, ValueError) as exc:
        raise _refused(state, exc) from None


def _refused(state: ServerState, exc: Exception) -> APIError:
    """The HTTP answer to the engine (or replica) refusing a request at submit."""
    retry = {"Retry-After": str(state.config.retry_after_s)}
    if isinstance(exc, QueueFullError):
        return APIError(503, f"queue full: {exc}; retry later", code="queue_full", headers=retry)
    if isinstance(exc, ReplicaLostError):  # the other replicas serve on
        return APIError(503, f"{exc}; retry", code="replica_lost", headers=retry)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    return APIError(400, str(exc), getattr(exc, "param", None))


def _chat_ids(
    lm: ModelFront,
    body: ChatCompletionRequest,
    media: list[ImageInput | VideoInput],
) -> tuple[list[int], list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation's prompt ids as the model's template renders it (tools as the template
    takes them, or as Hermes turns), each video's placeholder expanded to its frames'; with the
    messages and tools rendered. APIError 400 where the chat cannot be rendered."""
    messages, tools = body.chat(), body.tool_defs()
    if is_harmony(lm.tokenizer) and body.tool_grammar() is not None:
        # a forced call's grammar writes Hermes `<tool_call>` blocks, not harmony's channels
        msg = f"{body.model} calls tools in harmony's format: tool_choice 'auto' or 'none' only"
        raise APIError(400, msg, "tool_choice")
    if not lm.tokenizer.renders_tools and (tools or _mentions_tools(messages)):
        messages, tools = hermes_messages(messages, tools), None  # as plain turns
    videos = [m for m in media if isinstance(m, VideoInput)]
    expand = None
    if videos:  # the template's placeholder of each video -> its frames'
        assert lm.video_processing is not None
        expand = partial(expand_videos, videos=videos, proc=lm.video_processing)
    try:
        variables = body.template_kwargs()
        ids = lm.tokenizer.encode_chat(
            messages,
            tools,
            expand,
            body.add_generation_prompt,
            variables,
            body.continue_final_message,
        )
    except ImageError as exc:  # a template that places no video placeholder
        raise APIError(400, str(exc), "messages") from None
    except (ValueError, jinja2.TemplateError) as exc:  # no template / template refused
        raise APIError(400, f"cannot render the chat: {exc}", "messages") from None
    return ids, messages, tools


def _mentions_tools(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _admit(
    state: ServerState,
    model: str,
    prompt_ids: list[int],
    params: SamplingParams,
    rid: str,
    arrived: float,
    tenant: str,
    route_key: str,
    images: list[ImageInput],
    prompt_tokens: int,  # the prompt's rows, each image placeholder expanded to its rows
) -> Slot:
    retry = {"Retry-After": str(state.config.retry_after_s)}
    if state.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down", headers=retry)
    if state.in_flight >= state.config.max_concurrency:
        raise APIError(
            503,
            f"the server is at its limit of {state.config.max_concurrency} concurrent "
            "requests; retry later",
            code="server_busy",
            headers=retry,
        )
    try:
        handle = state.engine.submit(model, prompt_ids, params, rid, tenant, route_key, images)
    except (QueueFullError, EngineDeadError, ValueError) as exc:
        raise _refused(state, exc) from None
    handle.bind_loop()
    return Slot(state, handle, state.metrics.track(model, prompt_tokens, arrived))


class _SlotStreamingResponse(StreamingResponse):
    """Releases the slot however the response ends: finished, client gone (Starlette cancels
    the body iterator when it sees the disconnect), or never started."""

    def __init__(self, slots: list[Slot], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for slot in self.slots:
                slot.release()
