"""Who may talk to the server: the Host / Origin check and the API key, before any route.

Stage: the HTTP edge, outermost (nothing of a refused request reaches a route or its body).

Host check (DNS rebinding): a page on `attacker.example` whose name the attacker re-points at
127.0.0.1 reaches a loopback server as same-origin, so its requests carry `Host:
attacker.example`. The server answers only Host names it knows: `localhost` (and `*.localhost`),
any IP literal (an address cannot be rebound: a browser sends an IP Host only to that IP, and so
the bind address, a wildcard bind reached by any of the machine's addresses, and a container's
port map all pass), and the `--allowed-hosts` names; `*` allows every name. A browser's
`Origin` (sent on cross-site requests and on any POST/PUT) must be the Host itself (the admin
page calling its own server), a local name or loopback address, or an allowed name: that stops
another site's page, including one served from a bare IP, from driving the API through the
user's browser. 403 (OpenAI-shaped) otherwise.

API key: when one is set, every route needs `Authorization: Bearer <key>` (the scheme word in
any case, RFC 7235; or Anthropic's `x-api-key: <key>`) except /health and /metrics (probes and
scrapers) and /admin (the page is static; its API needs the admin token, checked with the same
parser in admin.py). So /openapi.json sits behind the key; it never lists the admin API either
way. Several keys (`--api-key a,b`, llama.cpp's comma-separated list) are each accepted.

Tenant (`tenant_of()`): who a request comes from, for what the engine shares across requests (the
n-gram drafter's index of finished outputs, speculation/drafters/ngram.py): the API key it used
(by its place in the list, so the key itself is kept nowhere else) and, within one key, the
request's `user` field (OpenAI's end-user id: an application holding one key keeps its end users
apart by setting it). Without a key, `user` alone, and every request without one is the one
anonymous tenant: a self-declared `user` keeps cooperating clients apart, not a client who
claims another's id, which only separate keys do. `--ngram-shared-scope global` makes every
request one tenant (one index for all, as before).
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from quickdraft.server.errors import error_for, error_response
from quickdraft.server.protocol import APIError

PUBLIC_PATHS = ("/health", "/metrics")  # and everything under /admin (its API has its own token)


def bearer_token(authorization: str) -> str | None:
    """An `Authorization` header value -> its Bearer credentials, or None for another scheme."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip(" \t") or None


def credentials(authorization: str | None, api_key: str | None) -> str:
    """A request's credentials as an `Authorization` value: its Authorization header, or else
    Anthropic's `x-api-key: KEY` (what the anthropic client sends; llama-server takes both)
    as `Bearer KEY`."""
    if authorization:
        return authorization
    return f"Bearer {api_key}" if api_key else ""


def token_matches(authorization: str, expected: str) -> bool:
    """Constant-time comparison of the header's Bearer token with `expected`."""
    given = bearer_token(authorization)
    # the header arrived as latin-1 (ASGI bytes); compare the bytes the client sent
    return given is not None and secrets.compare_digest(
        given.encode("latin-1", "replace"), expected.encode()
    )


def key_index(authorization: str, keys: tuple[str, ...]) -> int | None:
    """Which of `keys` the header's Bearer token is (each compared in constant time), or None."""
    given = bearer_token(authorization)
    if given is None:
        return None
    sent = given.encode("latin-1", "replace")  # as in token_matches
    matches = [i for i, key in enumerate(keys) if secrets.compare_digest(sent, key.encode())]
    return matches[0] if matches else None


def tenant_of(authorization: str, keys: tuple[str, ...], user: str | None, scope: str) -> str:
    """The request's tenant (module docstring): "key<i>" and/or "user:<id>", or "" when it
    names neither, or for every request when `scope` is "global"."""
    if scope == "global":
        return ""
    key = key_index(authorization, keys) if keys else None
    parts = ([] if key is None else [f"key{key}"]) + ([] if user is None else [f"user:{user}"])
    return "/".join(parts)


def hostname(netloc: str) -> str | None:
    """'Example.com:8000' -> 'example.com', '[::1]:80' -> '::1'; None when it is not a host."""
    if not netloc or any(c in netloc for c in "@/\\?# "):
        return None
    try:
        name = urlsplit("//" + netloc).hostname
    except ValueError:  # e.g. an unbalanced '['
        return None
    return name.rstrip(".") if name else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_local(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    return _is_ip(name) and ipaddress.ip_address(name).is_loopback


class HostCheckMiddleware:
    """403 for a Host (DNS rebinding) or browser Origin (cross-site request) not allowed."""

    def __init__(
        self, app: ASGIApp, allowed_hosts: tuple[str, ...], on_error: Callable[[int], None]
    ) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.allowed = frozenset(h.lower().rstrip(".") for h in allowed_hosts)
        self.on_error = on_error

    def host_ok(self, host: str) -> bool:
        name = hostname(host)
        return name is not None and (name in self.allowed or _is_local(name) or _is_ip(name))

    def origin_ok(self, origin: str, host: str) -> bool:
        if origin == "null":  # a sandboxed frame or a file: page; no site to trust
            return False
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        if parts.netloc.lower() == host.lower():  # the server's own page
            return True
        name = hostname(parts.netloc)
        return name is not None and (name in self.allowed or _is_local(name))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.any_host or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        err: APIError | None = None
        if host and not self.host_ok(host):  # HTTP/1.0 may send none: no browser does
            err = _forbidden(f"host {host!r} is not allowed", "host_not_allowed")
        elif origin is not None and not self.origin_ok(origin.decode("latin-1"), host):
            err = _forbidden(
                f"origin {origin.decode('latin-1')!r} is not allowed", "origin_not_allowed"
            )
        if err is None:
            await self.app(scope, receive, send)
            return
        self.on_error(err.status)
        await error_response(err)(scope, receive, send)


def _forbidden(what: str, code: str) -> APIError:
    message = f"{what}; start the server with --allowed-hosts NAME to answer it"
    return APIError(403, message, code=code, type="permission_error")


class ApiKeyMiddleware:
    """`Authorization: Bearer <one of api_keys>` on every route but the public ones (when keys
    are set); checked before the body is read, so an unauthenticated client learns nothing."""

    def __init__(
        self, app: ASGIApp, api_keys: tuple[str, ...], on_error: Callable[[int], None]
    ) -> None:
        self.app = app
        self.api_keys = api_keys
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if (
            not self.api_keys
            or scope["type"] != "http"
            or path in PUBLIC_PATHS
            or path == "/admin"
            or path.startswith("/admin/")
        ):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = credentials(
            headers.get(b"authorization", b"").decode("latin-1"),
            headers.get(b"x-api-key", b"").decode("latin-1"),
        )
        if key_index(given, self.api_keys) is not None:
            await self.app(scope, receive, send)
            return
        self.on_error(401)
        err = APIError(401, "missing or invalid API key", code="invalid_api_key")
        await error_for(path, err)(scope, receive, send)
