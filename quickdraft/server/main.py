"""Start a server: load the model, configure speculation, start the engine, run uvicorn.

Stage: process entry (`quickdraft serve` calls `serve`). Speculation at start = the command
line's, overridden per model by the settings file when it has an entry (what an operator set on
the admin page survives restarts). `BackgroundServer` runs an app on a loopback port in a thread
(tests, notebooks, the serving benchmark's in-process use).

Shutdown (SIGTERM, SIGINT, or `BackgroundServer` leaving): uvicorn stops taking connections and
waits for the open ones; `_Server` also refuses new requests on kept-alive connections and, once
`shutdown_timeout_s` has passed, aborts the requests still open, so every stream still ends with
its final chunk (finish_reason "abort") and `data: [DONE]`. `serve` then returns, and the process
exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import uvicorn
from fastapi import FastAPI

from quickdraft.config import DEFAULT_DTYPE, DEFAULT_MODEL, PrefixCacheConfig, SpeculativeConfig
from quickdraft.memory import freeze_loaded
from quickdraft.server.app import create_app
from quickdraft.server.settings import SpeculationSettings, load_settings
from quickdraft.server.state import ServerConfig, ServerState

log = logging.getLogger("quickdraft.server")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str = DEFAULT_MODEL
    dtype: str = DEFAULT_DTYPE
    spec: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None
    log_level: str = "info"
    access_log: bool = False
    shutdown_timeout_s: float = 30.0  # open requests run on this long after SIGTERM, then abort
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    device: str = "auto"  # loading.resolve_device
    mmproj: str | None = None  # a vision-language GGUF's multimodal projector (--mmproj)

    def __post_init__(self) -> None:
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown timeout must be >= 0 s, got {self.shutdown_timeout_s}")


def serve(opts: ServeOptions, config: ServerConfig) -> None:
    from quickdraft.engine import Engine, ServedModel
    from quickdraft.loading import load

    _setup_logging(opts.log_level)
    name = opts.served_name or opts.model
    config, spec, saved = start_settings(opts, config)
    log.info(
        "loading %s (%s, device %s), speculation %s", opts.model, opts.dtype, opts.device, spec
    )
    lm = load(opts.model, opts.dtype, opts.device, mmproj=opts.mmproj)
    engine = Engine(
        {name: ServedModel(lm, spec)},
        max_waiting=config.max_concurrency,
        prefix_cache=opts.prefix_cache,
    )
    freeze_loaded()
    engine.start()
    try:
        app = create_app(engine, config, saved)
        url = f"http://{opts.host}:{opts.port}"
        log.info("serving %s at %s/v1 (admin page %s/admin, metrics %s/metrics)", name, *[url] * 3)
        server = _Server(
            app,
            opts.shutdown_timeout_s,
            host=opts.host,
            port=opts.port,
            log_level=opts.log_level,
            access_log=opts.access_log,
        )
        if threading.current_thread() is threading.main_thread():
            # uvicorn raises the signal it stopped on again once it has shut down; with this
            # handler in place (uvicorn restores it) that is a no-op and the process exits 0
            signal.signal(signal.SIGTERM, server.handle_exit)
        server.run()
    finally:
        engine.stop()


def start_settings(
    opts: ServeOptions, config: ServerConfig
) -> tuple[ServerConfig, SpeculativeConfig, dict[str, SpeculationSettings] | None]:
    """The config with an admin token (made up if none was given), the served model's
    speculation at start (the settings file's entry, if any, over the command line's), and
    that entry as the admin page's settings (None: none saved)."""
    name = opts.served_name or opts.model
    saved = load_settings(config.settings_path) if config.settings_path else {}
    spec = opts.spec
    if name in saved:
        spec = saved[name].apply(opts.spec)
        log.info("settings file %s sets %s speculation: %s", config.settings_path, name, spec)
    if config.admin_token is None:  # the admin page is always protected: make up a token
        config = _with_admin_token(config, secrets.token_urlsafe(18))
        log.warning("admin token for this run (--admin-token sets one): %s", config.admin_token)
    return config, spec, {name: saved[name]} if name in saved else None


# after the shutdown timeout: time for the aborted requests to send their last chunk before
# uvicorn cancels what is left
_ABORT_GRACE_S = 10.0


class _Server(uvicorn.Server):
    """uvicorn's server; its shutdown drains the quickdraft state (see the module docstring)."""

    def __init__(self, app: FastAPI, timeout_s: float, **options: Any) -> None:
        grace = round(timeout_s + _ABORT_GRACE_S)
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace, **options))
        self.qd: ServerState = app.state.qd
        self.timeout_s = timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.qd.drain()
        if self.qd.in_flight:
            log.info(
                "shutting down: %d open requests finish (abort in %g s)",
                self.qd.in_flight,
                self.timeout_s,
            )
        abort = asyncio.get_running_loop().call_later(self.timeout_s, self.qd.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()


def _with_admin_token(config: ServerConfig, token: str) -> ServerConfig:
    import dataclasses

    return dataclasses.replace(config, admin_token=token)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The server logs one line per finished request (metrics.RequestTrack.finish) with the
    # request's and the cumulative acceptance; the engine's own per-request line would repeat it.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("quickdraft.engine").setLevel(logging.WARNING)


class BackgroundServer:
    """`with BackgroundServer(app) as srv: httpx.get(srv.url + "/health")` -- uvicorn on a free
    loopback port in a daemon thread, stopped (and joined) on exit."""

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        log_level: str = "warning",
        shutdown_timeout_s: float = 1.0,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = _Server(app, shutdown_timeout_s, log_level=log_level, access_log=False)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        done = threading.Event()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during start-up")
            done.wait(0.02)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
