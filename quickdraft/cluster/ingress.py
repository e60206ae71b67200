"""The cluster's HTTP side: the same FastAPI app as one process, over engine replicas.

Stage: the ingress deployment (one Ray Serve replica that Serve's HTTP proxy forwards to).
`Ingress` asks one engine replica to describe its models (tokenizer, context, vocabulary: no
weights), then serves `server.app.create_app(RayBackend(...))`: the routes, errors, auth, SSE
framing and admin page are the single-process server's own; only the Backend differs.

`RayBackend.submit` starts a streaming call on the engine deployment (routed by
router.PrefixAffinityRouter on the request's route key) and returns a `RayHandle`, which turns
the replica's stream back into `RequestOutput`s. A replica that dies (its process killed, its
node gone) surfaces as `ReplicaLostError`: a 503 + Retry-After before the stream starts, or an
error chunk and `[DONE]` after; the next request is routed to a live replica while Ray starts a
replacement. What each replica last reported (load, acceptance, prefix cache) arrives with the
streams and feeds `/metrics`, `/health` and the admin page.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve import context as serve_context
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from quickdraft.cluster.calls import GenerateCall, ModelInfo, Refusal, ReplicaStatus
from quickdraft.config import SpeculativeConfig
from quickdraft.engine import EngineDeadError, QueueFullError, RequestOutput
from quickdraft.engine.prefix_cache import PrefixCacheStats
from quickdraft.grammar import GrammarCompiler
from quickdraft.image_encoder import EncoderStats
from quickdraft.images import ImageInput, ImageProcessing
from quickdraft.loading import context_room
from quickdraft.request import SamplingParams
from quickdraft.server.app import create_app
from quickdraft.server.backend import Handle, ReplicaLostError, Served
from quickdraft.server.metrics import PREFIX
from quickdraft.server.settings import SpeculationSettings
from quickdraft.server.state import ServerConfig
from quickdraft.tokenizer import Tokenizer
from quickdraft.videos import VideoProcessing

log = logging.getLogger("quickdraft.server")
REPLICA_HEADER = "x-quickdraft-replica"
# what a replica's death looks like to a caller, depending on when and how it died
_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass
class RemoteModel:
    """A served model as the ingress sees it: server.backend.ModelFront without weights."""

    info: ModelInfo
    _grammars: GrammarCompiler | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.info.tokenizer

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def context_length(self) -> int:
        return self.info.context_length

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def device(self) -> str:
        return self.info.device

    @property
    def image_processing(self) -> ImageProcessing | None:
        return self.info.image_processing

    @property
    def video_processing(self) -> VideoProcessing | None:
        return self.info.video_processing

    def room(self, prompt_tokens: int, max_tokens: int | None = None) -> int:
        return context_room(self.context_length, prompt_tokens, max_tokens)

    def grammar_compiler(self) -> GrammarCompiler:
        with self._lock:  # built on first use, off the event loop (app.py compiles in a thread)
            if self._grammars is None:
                info = self.info
                self._grammars = GrammarCompiler(info.tokenizer, info.vocab_size, info.eos_ids)
            return self._grammars


@dataclass
class RemoteServed:
    lm: RemoteModel
    spec_config: SpeculativeConfig


class RayHandle:
    """One request's stream from a replica (server.backend.Handle). A request whose replica
    died before taking it is sent again (`START_TRIES` in all): nothing was generated yet."""

    START_TRIES = 3

    def __init__(self, backend: RayBackend, call: GenerateCall) -> None:
        self.id = call.request_id
        self.backend = backend
        self.call = call
        self.gen = backend.stream(call)
        self.replica: str | None = None  # known once the replica's first status arrived

    def bind_loop(self) -> RayHandle:
        return self

    def cancel(self) -> None:
        self.gen.cancel()

    async def _next(self) -> RequestOutput | ReplicaStatus | Refusal | None:
        """The stream's next item (None at its end); Ray's failures as quickdraft's."""
        try:
            item: RequestOutput | ReplicaStatus | Refusal = await self.gen.__anext__()
        except StopAsyncIteration:
            return None
        except RayTaskError as exc:  # the replica's code raised
            cause = exc.cause
            if isinstance(cause, EngineDeadError):
                self.backend.lost(self.replica)
                raise ReplicaLostError(f"the replica's engine died: {cause}") from None
            raise RuntimeError(f"replica {self.replica} failed: {cause!r}") from None
        except _LOST as exc:
            self.backend.lost(self.replica)
            log.warning("request %s: replica %s lost: %s", self.id, self.replica, exc)
            raise ReplicaLostError("the replica running this request died") from None
        if isinstance(item, ReplicaStatus):
            self.replica = item.replica
            self.backend.observe(item)
        return item

    async def start(self) -> str:
        """Wait for the replica to take the request; its id. Raises what a refusal means."""
        if self.replica is not None:
            return self.replica
        for _ in range(self.START_TRIES - 1):
            try:
                item = await self._next()
                break
            except ReplicaLostError:
                self.gen = self.backend.stream(self.call)  # routed among the live replicas
        else:
            item = await self._next()
        if isinstance(item, Refusal):
            if item.kind == "queue_full":
                raise QueueFullError(item.message)
            if item.kind == "engine_dead":
                raise ReplicaLostError(item.message)
            raise ValueError(item.message)  # the ingress validated it: not expected
        if not isinstance(item, ReplicaStatus):
            raise RuntimeError(f"request {self.id}: the replica's stream opened with {item!r}")
        return item.replica

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        await self.start()
        while (item := await self._next()) is not None:
            if isinstance(item, RequestOutput):
                yield item


class RayBackend:
    """server.backend.Backend over the engine deployment's handle."""

    def __init__(self, handle: DeploymentHandle, infos: list[ModelInfo]) -> None:
        self.handle = handle
        self._models = {i.name: RemoteServed(RemoteModel(i), i.spec) for i in infos}
        self.status: dict[str, ReplicaStatus] = {}  # replica id -> what it last reported
        self.routed: dict[str, int] = {}  # replica id -> requests it took

    @property
    def models(self) -> Mapping[str, Served]:
        return self._models

    @property
    def alive(self) -> bool:
        return True  # Ray replaces dead replicas; a request meanwhile waits for one

    @property
    def error(self) -> BaseException | None:
        return None

    @property
    def num_running(self) -> int:
        return sum(s.running for s in self.status.values())

    @property
    def num_waiting(self) -> int:
        return sum(s.waiting for s in self.status.values())

    def observe(self, status: ReplicaStatus) -> None:
        if status.replica not in self.status:
            log.info("replica %s (pid %d) serves", status.replica, status.pid)
        self.status[status.replica] = status

    def lost(self, replica: str | None) -> None:
        if replica is not None and self.status.pop(replica, None) is not None:
            log.warning("replica %s died; Ray replaces it", replica)

    def prefix_stats(self) -> dict[str, PrefixCacheStats | None]:
        """Per model: the sum over the replicas' prefix caches (None: off)."""
        return _summed(self._models, [st.prefix for st in self.status.values()])

    def encoder_stats(self) -> dict[str, EncoderStats | None]:
        """Per model: the sum over the replicas' image encoders (None: a text model)."""
        return _summed(self._models, [st.encoder for st in self.status.values()])

    def replicas(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": r,
                "pid": s.pid,
                "running": s.running,
                "waiting": s.waiting,
                "acceptance_rate": round(s.acceptance, 4),
                "requests": self.routed.get(r, 0),
            }
            for r, s in sorted(self.status.items())
        ]

    def submit(
        self,
        model: str,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
        route_key: str,
        images: Sequence[ImageInput] = (),
    ) -> Handle:
        spec = self._models[model].spec_config
        call = GenerateCall(
            model, prompt_ids, params, request_id, tenant, route_key, spec, tuple(images)
        )
        return RayHandle(self, call)

    def stream(self, call: GenerateCall) -> DeploymentResponseGenerator:
        """`call` on a replica, as a stream. Each call gets an internal request id of its own:
        Ray Serve takes a handle call's from the HTTP request being served, so the several
        calls of one request (`n` choices, /v1/embeddings' inputs) shared one, and its router,
        which indexes pending calls by that id, then leaves all but one unrouted, spinning
        (Ray's own broadcast gives each of its calls a fresh id too)."""

        def send() -> Any:
            context = serve_context._get_serve_request_context()
            own = dataclasses.replace(context, _internal_request_id=uuid.uuid4().hex)
            current: Any = serve_context._serve_request_context  # typed for its None default
            current.set(own)
            return self.handle.options(stream=True).generate.remote(call)

        gen = contextvars.copy_context().run(send)  # the HTTP request's own context untouched
        assert isinstance(gen, DeploymentResponseGenerator)
        return gen

    async def placement(self, handle: Handle) -> dict[str, str]:
        assert isinstance(handle, RayHandle)
        replica = await handle.start()
        self.routed[replica] = self.routed.get(replica, 0) + 1
        return {REPLICA_HEADER: replica}

    def configure(self, model: str, spec_config: SpeculativeConfig) -> None:
        """Check `spec_config` on one replica (ValueError if it cannot apply it); every request
        from now on carries it, and each replica applies it before its next request."""
        problem = self.handle.configure.remote(model, spec_config).result()
        if problem is not None:
            raise ValueError(problem)
        self._models[model].spec_config = spec_config


class ReplicaCollector(Collector):
    """Per-replica series for `/metrics` (label `replica`); the request, token, latency and
    speculation series are the ingress's own, which sees every request of every replica."""

    def __init__(self, backend: RayBackend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        b = self.backend
        routed = CounterMetricFamily(
            PREFIX + "replica_requests", "Requests routed to each replica", labels=["replica"]
        )
        for r, n in sorted(b.routed.items()):
            routed.add_metric([r], n)
        yield routed
        gauges = {
            "replica_num_requests_running": ("Requests decoding, per replica", "running"),
            "replica_num_requests_waiting": ("Requests queued, per replica", "waiting"),
            "replica_acceptance_rate": ("Draft tokens accepted / drafted", "acceptance"),
        }
        for metric, (doc, attr) in gauges.items():
            g = GaugeMetricFamily(PREFIX + metric, doc, labels=["replica"])
            for r, st in sorted(b.status.items()):
                g.add_metric([r], getattr(st, attr))
            yield g
        yield GaugeMetricFamily(
            PREFIX + "replicas", "Engine replicas that reported", value=len(b.status)
        )


@serve.ingress()
class Ingress:
    """The HTTP ingress deployment; `engine` is the engine deployment's handle."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        engine: DeploymentHandle,
        config: ServerConfig,
        settings: dict[str, SpeculationSettings] | None = None,
    ) -> None:
        infos: list[ModelInfo] = await engine.describe.remote()
        self.backend = RayBackend(engine, infos)
        self.config = config
        self.settings = settings

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.backend, self.config, self.settings)
        app.state.qd.metrics.registry.register(ReplicaCollector(self.backend))
        return app


def _summed(models: Iterable[str], per_replica: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model, the field-wise sum of the replicas' stats records (None where none has one)."""
    out: dict[str, Any] = dict.fromkeys(models)
    for stats in per_replica:
        for name, record in stats.items():
            if record is None:
                continue
            total = out.get(name)
            if total is None:
                out[name] = dataclasses.replace(record)
                continue
            for f in dataclasses.fields(record):
                setattr(total, f.name, getattr(total, f.name) + getattr(record, f.name))
    return out
