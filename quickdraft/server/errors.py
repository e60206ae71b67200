"""Every failure at the HTTP edge becomes an OpenAI-shaped error with the right status
(Anthropic-shaped on Anthropic's routes, /v1/messages).

Stage: the HTTP edge, around the routes (error handlers, body limit). FastAPI
answers validation failures with 422 and its own body; OpenAI clients expect 400 and
`{"error": {"message", "type", "param", "code"}}`, so the validation handler is replaced. The
body limit is a small ASGI middleware of our own because Starlette's answers 413 in plain text
(and only recent versions have one): it judges by the declared Content-Length, or counts the
bytes of a chunked body as they arrive, and drains (never stores) an oversized body before
answering so the client can read the 413.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quickdraft.server.protocol import APIError

log = logging.getLogger("quickdraft.server")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# Anthropic's error types by status (its Messages API: messages_api.py)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(err: APIError) -> JSONResponse:
    """`err` as Anthropic shapes it: {"type": "error", "error": {"type", "message"}}, the
    field it names at the start of the message."""
    body = err.body()["error"]
    message, param = body["message"], body["param"]
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error")
    content = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(content, status_code=err.status, headers=err.headers)


def error_for(path: str, err: APIError) -> JSONResponse:
    """`err` shaped for the route it answers: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    return anthropic_error(err) if path.startswith("/v1/messages") else error_response(err)


# pydantic names each member of a union in the error location ("str", "list[TextPart]",
# "function-after[_unicode(), str]"); a client knows only the field, so these are dropped
_UNION_TAGS = {"str", "int", "float", "bool"}
# wrong-type errors whose input should have been a JSON object
_OBJECT_TYPES = {"model_type", "model_attributes_type", "dict_type"}


def _field_loc(error: dict[str, Any]) -> tuple[Any, ...]:
    """pydantic's location without "body" and union member names."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") == "extra_forbidden":  # the last part is the client's own key
        return (*_field_loc({"loc": loc[:-1]}), *loc[-1:])
    return tuple(
        p
        for p in loc
        if isinstance(p, int) or (p != "body" and "[" not in p and p not in _UNION_TAGS)
    )


def _param(loc: tuple[Any, ...]) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _is_wrong_type(error: dict[str, Any]) -> bool:
    return str(error.get("type", "")).endswith("_type")


def validation_error(exc: RequestValidationError) -> APIError:
    errors = [dict(e) for e in exc.errors()] or [{"msg": "invalid request", "loc": ()}]
    if errors[0].get("type") == "json_invalid":
        detail = (errors[0].get("ctx") or {}).get("error", "")
        return APIError(400, f"invalid JSON body: {detail}".rstrip(": "), code="invalid_json")
    # A union reports one error per member. The member whose type fitted (a bad value, not a
    # wrong type), then the deepest location, says best what is wrong (pydantic's own rule for
    # picking a union member).
    best = max(errors, key=lambda e: (not _is_wrong_type(e), len(_field_loc(e))))
    param = _param(_field_loc(best))
    kind = best.get("type")
    msg = str(best.get("msg", "invalid value"))
    if kind in _OBJECT_TYPES:
        if param is None:
            return APIError(400, "the request body must be a JSON object", code="invalid_body")
        msg = "must be a JSON object"
    elif kind == "string_unicode":  # protocol.Text's, or pydantic's own (a Literal, a key)
        msg = "not valid Unicode (it holds a lone surrogate)"
        if param is None:
            msg = "a key of the request body is " + msg
    elif kind == "extra_forbidden":
        msg = "unrecognized or unsupported request argument"
    elif _is_wrong_type(best):  # every member of a union refused the type: list what fits
        wanted = [
            str(e["msg"]) for e in errors if _is_wrong_type(e) and _field_loc(e) == _field_loc(best)
        ]
        wanted = list(dict.fromkeys(wanted))
        msg = " or ".join([wanted[0], *(w.removeprefix("Input should be ") for w in wanted[1:])])
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """Route every error to an OpenAI-shaped response; `on_error(status)` counts it."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        on_error(exc.status)
        log.info("%s %s -> %d %s", request.method, request.url.path, exc.status, exc.message)
        return error_for(request.url.path, exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return await on_api_error(request, validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)  # 404 unknown route, 405 wrong method, ...
        err = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
        return await on_api_error(request, err)

    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        # the exception's text stays in the log: it can quote internals, paths or other data
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        err = APIError(500, "internal server error (logged)", code="internal_error")
        return await on_api_error(request, err)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(Exception, on_bug)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)


class BodyLimitMiddleware:
    """413 (OpenAI-shaped) for a request body over `max_bytes`; 400 for a bad Content-Length."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Callable[[int], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await self._reject(scope, send, APIError(400, "invalid Content-Length header"))
                return
            if size > self.max_bytes:
                await self._drain(receive, 0)
                await self._reject(scope, send, self._too_large(size))
                return
        # Chunked bodies declare no size: read them here (bounded) and replay them to the app.
        body: list[Message] = []
        received = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # a disconnect before the body was complete
                body.append(message)
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, received)
                await self._reject(scope, send, self._too_large(received))
                return
            body.append(message)
            more = message.get("more_body", False)

        async def replay() -> Message:
            return body.pop(0) if body else await receive()

        await self.app(scope, replay, send)

    async def _drain(self, receive: Receive, seen: int) -> None:
        """Read (and drop) the rest of an oversized body, up to a cap: a client still writing
        when the server closes gets a connection reset instead of the 413."""
        budget = 16 * self.max_bytes + 2**20
        while seen <= budget:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            seen += len(message.get("body", b""))

    def _too_large(self, size: int) -> APIError:
        return APIError(
            413,
            f"request body of {size}+ bytes exceeds the limit of {self.max_bytes} bytes",
            code="request_too_large",
        )

    async def _reject(self, scope: Scope, send: Send, err: APIError) -> None:
        self.on_error(err.status)
        log.info("%s %s -> %d %s", scope.get("method"), scope.get("path"), err.status, err.message)
        payload = json.dumps(err.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
