"""The admin page: `/admin` (static HTML + JS, no build step) and its JSON API.

Stage: the HTTP edge, for the operator. `GET /admin` serves the page itself (it holds no data);
everything under `/admin/api/` needs `Authorization: Bearer <admin token>`, a token of its own
(never the API key), and stays out of the OpenAPI schema. `PUT /admin/api/models/{name}` changes
a model's speculation for requests submitted from then on (running requests keep theirs),
without a restart, and writes the settings file; a change the engine cannot apply (e.g. a
draft model with another tokenizer) answers 400 and leaves the old settings in force. Every
field is checked before anything is applied or stored, whatever the method and whether
speculation is on: a draft model must be a catalog name, a model directory or a .gguf file
(never any other path, e.g. `../../etc/passwd`), and method `mtp` needs a model whose
checkpoint has an MTP head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response

from quickdraft import hub
from quickdraft.engine.prefix_cache import PrefixCacheStats
from quickdraft.server.access import token_matches
from quickdraft.server.metrics import now
from quickdraft.server.protocol import APIError
from quickdraft.server.settings import METHODS, SpeculationSettings
from quickdraft.server.state import ServerState
from quickdraft.speculation.drafters.mtp import mtp_tensor_names

STATIC = Path(__file__).resolve().parent / "static"
# the page loads only its own script; no framing (clickjacking of the settings form)
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    def require_admin(request: Request) -> None:
        token = state.config.admin_token
        if token is None:
            raise APIError(401, "the admin API is disabled (start with --admin-token)")
        if not token_matches(request.headers.get("authorization", ""), token):
            raise APIError(401, "missing or invalid admin token", code="invalid_admin_token")

    @r.get("/admin", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse((STATIC / "admin.html").read_text(), headers=_PAGE_HEADERS)

    @r.get("/admin/admin.js", include_in_schema=False)
    async def script() -> Response:
        js = (STATIC / "admin.js").read_text()
        return Response(js, media_type="text/javascript", headers=_PAGE_HEADERS)

    @r.get("/admin/api/state", dependencies=[Depends(require_admin)], include_in_schema=False)
    async def get_state() -> dict[str, Any]:
        return snapshot(state)

    # {name:path}: a model served under its directory's path (the default name) holds slashes
    @r.put(
        "/admin/api/models/{name:path}",
        dependencies=[Depends(require_admin)],
        include_in_schema=False,
    )
    async def put_model(name: str, body: SpeculationSettings) -> dict[str, Any]:
        if name not in state.engine.models:
            raise APIError(404, f"model {name!r} is not served", "name", "model_not_found")
        if body.enabled and body.method == "draft" and not body.draft_model:
            raise APIError(400, "method 'draft' needs a draft model", "draft_model")
        if body.method == "mtp" and not mtp_tensor_names(state.engine.models[name].lm.path):
            # checked even with speculation off: it is stored, and refused once switched on
            raise APIError(400, f"model {name!r} has no MTP head (no mtp.* tensors)", "method")
        if body.draft_model is not None:  # checked even when unused now: it is stored
            try:
                hub.check_model(body.draft_model)
            except hub.UnknownModelError as exc:
                raise APIError(400, f"draft_model: {exc}", "draft_model") from None
        try:
            await state.reconfigure(name, body)
        except (ValueError, hub.HubError, OSError) as exc:
            raise APIError(400, f"cannot apply these settings: {exc}") from None
        return snapshot(state)

    return r


def _prefix(st: PrefixCacheStats | None) -> dict[str, Any] | None:
    """The prefix cache's numbers for the page (None: the cache is off)."""
    if st is None:
        return None
    return {
        "queries": st.queries,
        "hits": st.hits,
        "hit_rate": round(st.hits / st.queries, 4) if st.queries else 0.0,
        "blocks": st.blocks,
        "megabytes": round(st.bytes / 2**20, 1),
        "budget_megabytes": round(st.budget_bytes / 2**20, 1),
    }


def snapshot(state: ServerState) -> dict[str, Any]:
    """Everything the page shows: per model its settings, what runs, and live statistics."""
    t = now()
    eng = state.engine
    prefix = eng.prefix_stats()
    models = []
    for name, served in eng.models.items():
        cfg = served.spec_config
        models.append(
            {
                "name": name,
                "context_length": served.lm.context_length,
                "device": served.lm.device,
                "settings": state.settings[name].model_dump(),
                "active": {
                    "method": cfg.method,
                    "num_draft_tokens": cfg.num_draft_tokens,
                    "draft_model": cfg.draft_model if cfg.method == "draft" else None,
                    "adaptive": cfg.adaptive,
                },
                "stats": state.metrics.models[name].snapshot(t),
                "prefix_cache": _prefix(prefix[name]),
            }
        )
    path = state.config.settings_path
    return {
        "models": models,
        "methods": list(METHODS),
        "draft_models": sorted(hub.CATALOG),
        "settings_file": None if path is None else str(path),
        "engine": {"alive": eng.alive, "running": eng.num_running, "waiting": eng.num_waiting},
        "replicas": eng.replicas(),  # [] for the single-process server
        "in_flight": state.in_flight,
        "max_concurrency": state.config.max_concurrency,
    }
