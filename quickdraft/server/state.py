"""What one server instance holds: its config, the engine, metrics, speculation settings.

Stage: the HTTP side. `ServerState` lives on the event loop; the only thing shared with the
engine (thread, or replicas: backend.py) is the Backend API (submit / iterate / cancel /
configure). `slots` holds the
requests this server has admitted and not yet released (the `--max-concurrency` bound): a slot is
taken at submit and released exactly once when the response ends, however it ends. `drain()`
(graceful shutdown) refuses new requests; `abort_all()` ends the open ones, each with its final
output (finish_reason "abort"), so every stream still closes properly.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from quickdraft.config import RESPONSES_STORE_MB, SpeculativeConfig
from quickdraft.request import POOLINGS
from quickdraft.server.backend import Backend, Handle
from quickdraft.server.media import MediaPolicy
from quickdraft.server.metrics import Metrics, RequestTrack, now
from quickdraft.server.responses_store import EventLogs, ResponseStore
from quickdraft.server.settings import SpeculationSettings, save_settings

NGRAM_SHARED_SCOPES = ("tenant", "global")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # required as `Authorization: Bearer <key>` when set; several: comma-separated (access.py)
    api_key: str | None = None
    admin_token: str | None = None  # the admin API's own token; None = admin API disabled
    max_concurrency: int = 32  # requests admitted at once (running + queued); more -> 503
    max_body_bytes: int = 20 << 20  # room for images as data: URLs (OpenAI takes 20 MB ones)
    default_max_tokens: int = 2048  # when a request gives none (capped by the context)
    retry_after_s: int = 1  # the Retry-After header of a 503
    settings_path: Path | None = None  # admin changes persist here (None: not persisted)
    # Host names answered besides localhost and IP literals; "*" = any (access.py says why)
    allowed_hosts: tuple[str, ...] = ()
    # who shares the n-gram drafter's index of finished outputs: "tenant" = requests of one API
    # key / `user` only, "global" = every request (access.py `tenant_of`)
    ngram_shared_scope: str = "tenant"
    media: MediaPolicy = field(default_factory=MediaPolicy)  # what image parts may be
    # the Responses API's stored responses, MB of their JSON (0: none stored)
    responses_store_mb: int = RESPONSES_STORE_MB
    # /infill's prompt with the suffix before the prefix (llama-server's --spm-infill)
    spm_infill: bool = False
    # /v1/embeddings' pooling (request.py POOLINGS); None: the model's own, else "last"
    pooling: str | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_keys:
            raise ValueError(f"api_key names no key: {self.api_key!r}")
        if self.ngram_shared_scope not in NGRAM_SHARED_SCOPES:
            raise ValueError(
                f"ngram_shared_scope must be one of {NGRAM_SHARED_SCOPES}, "
                f"got {self.ngram_shared_scope!r}"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.pooling not in (None, *POOLINGS):
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.responses_store_mb < 0:
            raise ValueError(f"responses_store_mb must be >= 0, got {self.responses_store_mb}")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted keys (`api_key` split at commas); () = none needed."""
        if self.api_key is None:
            return ()
        return tuple(k.strip() for k in self.api_key.split(",") if k.strip())


class Slot:
    """One admitted request's claim on the server; `release` is idempotent."""

    __slots__ = ("handle", "released", "state", "track")

    def __init__(self, state: ServerState, handle: Handle, track: RequestTrack) -> None:
        self.state = state
        self.handle = handle
        self.track = track
        self.released = False
        state.slots.add(self)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.state.slots.discard(self)
        self.handle.cancel()  # no-op for a finished request; frees an unfinished one at once
        if not self.track.done:  # the client left (or the relay failed) before the last output
            self.track.abort(self.handle.id, now())


@dataclass
class ServerState:
    engine: Backend
    config: ServerConfig
    settings: dict[str, SpeculationSettings]
    base_configs: dict[str, SpeculativeConfig]  # the start-up configs settings are applied to
    metrics: Metrics
    started: int = field(default_factory=lambda: int(time.time()))
    slots: set[Slot] = field(default_factory=set)
    draining: bool = False  # shutting down: no new requests
    configure_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0))
    # background responses still running, by id (app.py `_background`; cancel ends them)
    background: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    streams: EventLogs = field(default_factory=EventLogs)  # streamed background responses'

    @property
    def in_flight(self) -> int:
        return len(self.slots)

    def drain(self) -> None:
        self.draining = True

    def abort_all(self) -> None:
        """Cancel every open request; the engine ends each with finish_reason "abort"."""
        for slot in list(self.slots):
            slot.handle.cancel()

    @classmethod
    def create(
        cls,
        engine: Backend,
        config: ServerConfig,
        settings: dict[str, SpeculationSettings] | None = None,
    ) -> ServerState:
        base = {name: served.spec_config for name, served in engine.models.items()}
        given = settings or {}
        current = {
            name: given.get(name) or SpeculationSettings.of(cfg) for name, cfg in base.items()
        }
        metrics = Metrics(list(engine.models), engine.prefix_stats, engine.encoder_stats)
        store = ResponseStore(config.responses_store_mb << 20)
        return cls(engine, config, current, base, metrics, responses=store)

    async def reconfigure(self, model: str, new: SpeculationSettings) -> None:
        """Apply `new` to requests submitted from now on, then persist it. Raises ValueError
        (bad combination, draft model that does not fit) leaving everything as it was."""
        async with self.configure_lock:  # one change at a time; loading a draft takes a while
            spec = new.apply(self.base_configs[model])
            # configure() may load a draft model and time it: keep the event loop serving
            await asyncio.to_thread(self.engine.configure, model, spec)
            self.settings[model] = new
            if self.config.settings_path is not None:
                save_settings(self.config.settings_path, self.settings)
