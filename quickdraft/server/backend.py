"""What the HTTP routes talk to: one in-process engine, or engine replicas elsewhere (Ray).

Stage: the seam between the HTTP edge and whatever generates. The routes (app.py, admin.py,
relay.py) see only `Backend`: the served models' fronts (tokenizer, context, grammar compiler:
what validation and chat rendering need, no weights), `submit` -> a handle that yields
`RequestOutput`s and can be cancelled, `configure` for the admin page, and load / cache
numbers. `LocalBackend` is the single-process server's: every request goes to its one `Engine`.
quickdraft/cluster/ingress.py has the Ray one; nothing here imports Ray.

`route_key` names the prefix a request shares with others (same conversation, same system
prompt + tools): requests with one key should run where that prefix is cached. One engine holds
every cache, so `LocalBackend` ignores it. `placement` waits until the request has a place and
returns response headers saying where (Ray: the replica); it raises `ReplicaLostError` when the
place died first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, EngineDeadError, RequestOutput
from quickdraft.engine.prefix_cache import PrefixCacheStats
from quickdraft.grammar import GrammarCompiler
from quickdraft.image_encoder import EncoderStats
from quickdraft.images import ImageInput, ImageProcessing
from quickdraft.request import SamplingParams
from quickdraft.tokenizer import Tokenizer
from quickdraft.videos import VideoProcessing


class ReplicaLostError(EngineDeadError):
    """The replica running a request died; the others serve on, so a retry can succeed (HTTP
    503 + Retry-After, unlike a dead single engine)."""


class ModelFront(Protocol):
    """What the routes need of a served model (loading.LoadedModel has it all)."""

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def path(self) -> Path: ...
    @property
    def context_length(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def device(self) -> str:
        """Where the model runs ("cpu", "cuda (NVIDIA H100 80GB HBM3)")."""
        ...

    @property
    def image_processing(self) -> ImageProcessing | None:
        """A vision-language model's image preprocessing; None: it takes text only."""
        ...

    @property
    def video_processing(self) -> VideoProcessing | None:
        """Its video preprocessing; None: it takes no video."""
        ...

    def room(self, prompt_tokens: int, max_tokens: int | None = None) -> int: ...
    def grammar_compiler(self) -> GrammarCompiler: ...


class Served(Protocol):
    @property
    def lm(self) -> ModelFront: ...
    @property
    def spec_config(self) -> SpeculativeConfig: ...


class Handle(Protocol):
    """One submitted request, as engine.RequestHandle has it."""

    id: str

    def bind_loop(self) -> Any: ...
    def cancel(self) -> None: ...
    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...


class Backend(Protocol):
    @property
    def models(self) -> Mapping[str, Served]: ...
    @property
    def alive(self) -> bool: ...
    @property
    def error(self) -> BaseException | None: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    def prefix_stats(self) -> dict[str, PrefixCacheStats | None]: ...
    def encoder_stats(self) -> dict[str, EncoderStats | None]: ...
    def replicas(self) -> list[dict[str, Any]]: ...
    def submit(
        self,
        model: str,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant: str,
        route_key: str,
        images: Sequence[ImageInput] = (),
    ) -> Handle: ...
    async def placement(self, handle: Handle) -> dict[str, str]: ...
    def configure(self, model: str, spec_config: SpeculativeConfig) -> None: ...


class LocalBackend:
    """The single-process server: one `Engine` in this process serves every request."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def models(self) -> Mapping[str, Served]:
        return self.engine.models

    @property
    def alive(self) -> bool:
        return self.engine.alive

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    def prefix_stats(self) -> dict[str, PrefixCacheStats | None]:
        return {name: st.prefix_cache for name, st in self.engine.step_stats.items()}

    def encoder_stats(self) -> dict[str, EncoderStats | None]:
        return {name: st.encoder for name, st in self.engine.step_stats.items()}

    def replicas(self) -> list[dict[str, Any]]:
        return []

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
        del route_key  # one engine holds every prefix
        return self.engine.submit(model, prompt_ids, params, request_id, tenant, list(images))

    async def placement(self, handle: Handle) -> dict[str, str]:
        return {}

    def configure(self, model: str, spec_config: SpeculativeConfig) -> None:
        self.engine.configure(model, spec_config)
