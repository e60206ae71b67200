"""quickdraft's OpenAI-compatible server (fastapi + uvicorn).

app.py       create_app(engine, config): /v1/chat/completions, /v1/completions (JSON and
             SSE), /v1/models, /health, /metrics
protocol.py  request validation and response bodies (OpenAI wire format + `speculative`)
access.py    who may call: Host / Origin check (DNS rebinding), the API key
errors.py    OpenAI-shaped errors (400 not 422), body limit (413)
metrics.py   Prometheus metrics (`quickdraft:` prefix) and the admin page's live numbers
admin.py     /admin page + its token-protected API; settings.py persists its changes
state.py     ServerConfig and the per-server state (concurrency slots)
main.py      serve(): load, start the engine, run uvicorn, drain on SIGTERM; BackgroundServer
"""

from quickdraft.server.app import create_app
from quickdraft.server.state import ServerConfig

__all__ = ["ServerConfig", "create_app"]
