"""quickdraft.server.admin: the admin API (own token, live changes, settings file) over HTTP,
and `quickdraft serve` as a real process loading its settings file at start."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_process import serve_process

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import LoadedModel, load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer
from quickdraft.server.settings import load_settings

ADMIN = "the-admin-token"
KEY = "the-api-key"


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


@pytest.fixture(scope="module")
def settings_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("admin") / "settings.json"


@pytest.fixture(scope="module")
def srv(lm: LoadedModel, settings_path: Path) -> Iterator[BackgroundServer]:
    # unquantized drafts: the draft-model test drafts with the target itself and expects every
    # draft accepted, which an int4 copy would not give
    spec = SpeculativeConfig(adaptive=False, draft_quantization="none")
    engine = Engine({"tiny": ServedModel(lm, spec)})
    engine.start()
    config = ServerConfig(api_key=KEY, admin_token=ADMIN, settings_path=settings_path)
    with BackgroundServer(create_app(engine, config)) as server:
        yield server
    engine.stop()


def admin(srv: BackgroundServer, method: str, path: str, token: str = ADMIN, **kw: Any) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, srv.url + path, headers=headers, timeout=60, **kw)


def spec_of_next_request(url: str, key: str = KEY) -> dict[str, Any]:
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    r = c.completions.create(
        model="tiny",
        prompt="abcabcabcabc",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == 24
    spec: dict[str, Any] = r.model_extra["speculative"]  # type: ignore[index]
    return spec


def test_admin_page_is_served_and_api_needs_the_admin_token(srv: BackgroundServer) -> None:
    page = httpx.get(srv.url + "/admin")
    assert page.status_code == 200 and '<script src="/admin/admin.js">' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(srv.url + "/admin/admin.js").status_code == 200
    for token in ("", "wrong", KEY):  # the API key is not the admin token
        r = admin(srv, "GET", "/admin/api/state", token=token)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        put = admin(srv, "PUT", "/admin/api/models/tiny", token=token, json={})
        assert put.status_code == 401
    state = admin(srv, "GET", "/admin/api/state").json()
    assert state["models"][0]["name"] == "tiny"
    assert state["models"][0]["device"] == "cpu"
    assert state["models"][0]["active"]["method"] == "none"


def test_admin_change_applies_to_next_request_and_persists(
    srv: BackgroundServer, settings_path: Path
) -> None:
    assert spec_of_next_request(srv.url)["method"] == "none"
    new = {"enabled": True, "method": "ngram", "draft_model": None, "num_draft_tokens": 3}
    r = admin(srv, "PUT", "/admin/api/models/tiny", json=new)
    assert r.status_code == 200, r.text
    assert r.json()["models"][0]["active"] == {
        "method": "ngram",
        "num_draft_tokens": 3,
        "draft_model": None,
        "adaptive": False,  # the start-up config's fields the page does not edit are kept
    }
    spec = spec_of_next_request(srv.url)
    assert spec["method"] == "ngram" and spec["drafted"] > 0
    assert len(spec["accepted_per_position"]) <= 3
    assert json.loads(settings_path.read_text())["models"]["tiny"] == new
    assert load_settings(settings_path)["tiny"].num_draft_tokens == 3

    off = {**new, "enabled": False}
    assert admin(srv, "PUT", "/admin/api/models/tiny", json=off).status_code == 200
    assert spec_of_next_request(srv.url)["method"] == "none"
    saved = json.loads(settings_path.read_text())["models"]["tiny"]
    assert saved["enabled"] is False and saved["method"] == "ngram"  # the choice is kept


def test_admin_draft_model_setting_loads_the_draft(
    srv: BackgroundServer, tiny_model_dir: Path
) -> None:
    # the tiny model drafting for itself: same tokenizer, so the engine accepts it
    new = {
        "enabled": True,
        "method": "draft",
        "draft_model": str(tiny_model_dir),
        "num_draft_tokens": 2,
    }
    r = admin(srv, "PUT", "/admin/api/models/tiny", json=new)
    assert r.status_code == 200, r.text
    spec = spec_of_next_request(srv.url)
    # a draft model identical to the target (both fp32) is accepted at every position
    assert spec["method"] == "draft" and spec["drafted"] > 0
    assert spec["accepted"] == spec["drafted"]


def not_a_model(tmp: Path) -> str:
    (tmp / "config.json").write_text("{}")  # a directory, but not a model directory
    return str(tmp)


# (change to a good setting, the field the 400 names); each is refused whatever the method and
# whether speculation is on: nothing of it is applied or stored
BAD_CHANGES: list[tuple[str, dict[str, Any], str]] = [
    ("unknown-method", {"method": "eagle"}, "method"),
    ("k-zero", {"num_draft_tokens": 0}, "num_draft_tokens"),
    ("k-above-32", {"num_draft_tokens": 33}, "num_draft_tokens"),
    ("k-string", {"num_draft_tokens": "3"}, "num_draft_tokens"),
    ("enabled-string", {"enabled": "yes"}, "enabled"),
    ("draft-without-model", {"method": "draft", "draft_model": None}, "draft_model"),
    ("no-such-draft", {"method": "draft", "draft_model": "/no/such/model"}, "draft_model"),
    ("traversal-with-draft", {"method": "draft", "draft_model": "../../etc/passwd"}, "draft_model"),
    ("traversal-with-ngram", {"draft_model": "../../etc/passwd"}, "draft_model"),
    ("file-while-off", {"enabled": False, "draft_model": "/etc/passwd"}, "draft_model"),
    ("not-a-model-dir", {"draft_model": "NOT_A_MODEL"}, "draft_model"),
    ("nul-byte", {"draft_model": "qwen\x00"}, "draft_model"),
    ("unknown-field", {"extra": 1}, "extra"),
    ("mtp-without-head", {"method": "mtp"}, "method"),
    ("mtp-without-head-while-off", {"enabled": False, "method": "mtp"}, "method"),
]


@pytest.mark.parametrize(("change", "param"), [pytest.param(c, p, id=i) for i, c, p in BAD_CHANGES])
def test_admin_bad_settings_change_nothing(
    srv: BackgroundServer, settings_path: Path, tmp_path: Path, change: dict[str, Any], param: str
) -> None:
    if change.get("draft_model") == "NOT_A_MODEL":
        change = {**change, "draft_model": not_a_model(tmp_path)}
    good = {"enabled": True, "method": "ngram", "draft_model": None, "num_draft_tokens": 4}
    assert admin(srv, "PUT", "/admin/api/models/tiny", json=good).status_code == 200
    before = settings_path.read_text()
    r = admin(srv, "PUT", "/admin/api/models/tiny", json={**good, **change})
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert r.json()["error"]["param"] == param
    assert settings_path.read_text() == before
    assert admin(srv, "GET", "/admin/api/state").json()["models"][0]["settings"] == good
    assert spec_of_next_request(srv.url)["method"] == "ngram"


def test_admin_unknown_model_is_404(srv: BackgroundServer) -> None:
    good = {"enabled": True, "method": "ngram", "draft_model": None, "num_draft_tokens": 4}
    assert admin(srv, "PUT", "/admin/api/models/other", json=good).status_code == 404


def test_admin_changes_a_model_named_by_its_path(lm: LoadedModel, tmp_path: Path) -> None:
    """`quickdraft serve /some/dir` names the model by its path: its settings can be changed
    through the admin API, the name's slashes sent as they are or percent-encoded."""
    name = "/models/org/tiny"
    engine = Engine({name: ServedModel(lm, SpeculativeConfig(adaptive=False))})
    engine.start()
    config = ServerConfig(admin_token=ADMIN, settings_path=tmp_path / "settings.json")
    try:
        with BackgroundServer(create_app(engine, config)) as server:
            on = {"enabled": True, "method": "ngram", "draft_model": None, "num_draft_tokens": 3}
            for path in (name, "%2Fmodels%2Forg%2Ftiny"):
                r = admin(server, "PUT", "/admin/api/models/" + path, json=on)
                assert r.status_code == 200, r.text
                on = {**on, "num_draft_tokens": 2}
            (got,) = admin(server, "GET", "/admin/api/state").json()["models"]
            assert got["name"] == name and got["settings"]["num_draft_tokens"] == 2  # the last PUT
            assert admin(server, "PUT", "/admin/api/models/org/tiny", json=on).status_code == 404
    finally:
        engine.stop()


def test_admin_serve_cli_loads_the_settings_file_at_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = tmp_path / "settings.json"
    saved = {"enabled": True, "method": "ngram", "draft_model": None, "num_draft_tokens": 2}
    settings.write_text(json.dumps({"version": 1, "models": {"tiny": saved}}))
    args = ["--speculative-method", "none", "--settings", str(settings)]
    args += ["--admin-token", ADMIN, "--api-key", KEY]
    with serve_process(tiny_model_dir, *args) as server:
        auth = {"Authorization": f"Bearer {ADMIN}"}
        state = httpx.get(server.url + "/admin/api/state", headers=auth)
        assert state.json()["models"][0]["settings"] == saved  # the file won over the flags
        spec = spec_of_next_request(server.url)
        assert spec["method"] == "ngram" and len(spec["accepted_per_position"]) <= 2
    assert "settings file" in server.log and "request cmpl-" in server.log  # a line per request
    assert "cumulative acceptance" in server.log
