"""quickdraft.server.access: who may talk to the server, over a real loopback server.

The API key in any case of the `Bearer` scheme word (RFC 7235); the OpenAPI schema behind the
key and never describing the admin API; the Host / Origin check against DNS rebinding and
cross-site requests from a browser (with and without an API key).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import LoadedModel, load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer

KEY = "sk-access-key"
ADMIN = "access-admin-token"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    lm: LoadedModel = load(str(tiny_model_dir), "fp32", progress=False)
    eng = Engine({"tiny": ServedModel(lm)})
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def keyed(engine: Engine) -> Iterator[BackgroundServer]:
    config = ServerConfig(api_key=KEY, admin_token=ADMIN, allowed_hosts=("api.example.com",))
    with BackgroundServer(create_app(engine, config)) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_srv(engine: Engine) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(engine, ServerConfig(admin_token=ADMIN))) as srv:
        yield srv


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_server_access_bearer_scheme_in_any_case(keyed: BackgroundServer, scheme: str) -> None:
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status_code == 200, r.text
    admin = {"Authorization": f"{scheme} {ADMIN}"}
    assert httpx.get(keyed.url + "/admin/api/state", headers=admin).status_code == 200


@pytest.mark.parametrize(
    "header",
    [f"Basic {KEY}", f"Bearer{KEY}", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}"],
    ids=["other-scheme", "no-space", "no-scheme", "longer-key", "shorter-key"],
)
def test_server_access_wrong_credentials_are_401(keyed: BackgroundServer, header: str) -> None:
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": header})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_server_access_openapi_and_docs_behind_the_key(keyed: BackgroundServer) -> None:
    for path in ("/openapi.json", "/docs", "/redoc"):
        r = httpx.get(keyed.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    r = httpx.get(keyed.url + "/openapi.json", headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200
    paths = r.json()["paths"]
    assert "/v1/chat/completions" in paths
    assert not [p for p in paths if p.startswith("/admin")]


def test_server_access_openapi_without_a_key_hides_the_admin_api(
    open_srv: BackgroundServer,
) -> None:
    r = httpx.get(open_srv.url + "/openapi.json")
    assert r.status_code == 200
    assert not [p for p in r.json()["paths"] if p.startswith("/admin")]


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "10.1.2.3", "API.example.com"],
)
def test_server_access_allowed_hosts(keyed: BackgroundServer, host: str) -> None:
    headers = {"Host": host, "Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url + "/v1/models", headers=headers).status_code == 200


@pytest.mark.parametrize("which", ["open", "keyed"])
@pytest.mark.parametrize(
    "path", ["/health", "/v1/models", "/admin", "/admin/api/state", "/openapi.json"]
)
def test_server_access_rebound_host_is_refused(
    open_srv: BackgroundServer, keyed: BackgroundServer, which: str, path: str
) -> None:
    srv = open_srv if which == "open" else keyed
    headers = {"Host": "attacker.example:8000", "Authorization": f"Bearer {KEY}"}
    r = httpx.get(srv.url + path, headers=headers)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"]


def test_server_access_cross_site_origin_is_refused(open_srv: BackgroundServer) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    evil = httpx.post(
        open_srv.url + "/v1/completions", json=body, headers={"Origin": "http://1.2.3.4"}
    )
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
    for origin in ("null", "http://attacker.example"):
        r = httpx.get(open_srv.url + "/v1/models", headers={"Origin": origin})
        assert r.status_code == 403
    # the page's own origin (same host and port), and a local one, are fine
    for origin in (open_srv.url, "http://localhost:3000"):
        r = httpx.post(open_srv.url + "/v1/completions", json=body, headers={"Origin": origin})
        assert r.status_code == 200, r.text


def test_server_access_star_allows_every_host(engine: Engine) -> None:
    config = ServerConfig(allowed_hosts=("*",))
    with BackgroundServer(create_app(engine, config)) as srv:
        headers = {"Host": "anything.example", "Origin": "http://elsewhere.example"}
        assert httpx.get(srv.url + "/v1/models", headers=headers).status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert c.models.list().data[0].id == "tiny"
