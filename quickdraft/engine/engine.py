"""Engine: one thread owns the models; requests come and go through queues.

Stage: the step loop between the server (or CLI/bench) and the models. The public API is what
the server codes against, and stays fixed while the scheduling inside changes:

    engine = Engine({"name": ServedModel(lm, spec_config)}, max_waiting=64)
    engine.start()
    handle = engine.submit("name", prompt_ids, SamplingParams(...), request_id="r1")
    for out in handle: ...          # sync consumers (CLI, bench, tests)
    async for out in handle: ...    # asyncio consumers (the server); bind with handle.bind_loop()
    handle.cancel()                 # frees the sequence at the engine's next step
    engine.configure("name", SpeculativeConfig(...))   # applies to requests submitted after it
    engine.stop()

Each `RequestOutput` carries the new text / token ids of one step (a whole accepted speculative
block at once) and, on the last one, the finish reason; usage and speculation telemetry are
readable on every output. `submit` raises `QueueFullError` when `max_waiting` requests are
already waiting and `ValueError` for a request that cannot run (unknown model, too long).

Inside: continuous batching. Per served model an `EngineCore` (core.py) runs steps: new
requests join the running batch (their prefill chunked), finished and cancelled ones leave at
once with their caches freed, and each step is ONE packed target forward with the speculation
policy choosing every request's draft length from its acceptance and the batch. Each model
keeps a prefix cache (engine/prefix_cache.py; on unless `prefix_cache=PrefixCacheConfig(
enabled=False)`): a prompt that starts with blocks an earlier request computed skips their
prefill, and `RequestOutput.cached_tokens` says how many prompt tokens that was. Optional:
`scheduler=SchedulerConfig(...)` in the constructor, and `step_stats` (per model, live
counters of steps / rows / drafts / accepted, and the prefix cache's, for metrics).

A request that fails (an exception in its step) gets the exception on its handle and the
engine serves on; if the engine thread itself dies, `alive` turns False and every waiting or
running consumer receives `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine.core import EngineCore, StepStats
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.engine.sequence import Sequence
from quickdraft.images import ImageInput
from quickdraft.loading import LoadedModel
from quickdraft.request import (
    FinishReason,
    Request,
    SamplingParams,
    SpecStats,
    Timing,
    TokenLogprob,
)
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import AnySpeculation

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep the runtime initialised


@functools.cache
def _omp_pause() -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the OpenMP runtime torch loaded (None if there is none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if any(name in Path(path).name for name in ("libgomp", "libiomp5", "libomp")):
            try:
                fn: Callable[[int], int] = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            return fn
    return None


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker pool (OpenMP 5.0 `omp_pause_resource_all`,
    soft pause); torch re-creates it if this thread runs parallel ops again.

    Why: libgomp lets idle workers spin between parallel regions only while it manages no
    more threads than there are CPUs. A thread that loaded the models (or ran a configure())
    keeps its pool docked for good, so once the engine thread has its own, every parallel
    region of every step pays futex wake-ups: smollm2-135m decoded at ~21 tok/s on the engine
    thread against ~35 in the main thread on this 2-core machine, and ~37 after this call.
    Returns False where no OpenMP runtime with the call is loaded (then nothing changes)."""
    pause = _omp_pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crashed or shut down); no request will be served."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str  # new text since the previous output (stop-string safe)
    token_ids: list[int]  # new output token ids since the previous output
    finish_reason: FinishReason | None  # set on the last output only
    prompt_tokens: int
    completion_tokens: int  # output tokens so far
    spec: SpecStats  # the request's live telemetry (read-only for consumers)
    timing: Timing
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per new token id, if asked
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (known from admission)
    stop_reason: str | int | None = None  # on the last output: `Request.stop_reason`
    # on the first output, if asked: per prompt id after the first, its logprob (the prefill's)
    prompt_logprobs: list[TokenLogprob] | None = None
    # on the last output of a pooling request: the prompt's pooled hidden rows (not normalised)
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class ServedModel:
    """A loaded target and its current speculation settings (None drafter = speculation off)."""

    lm: LoadedModel
    spec_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    speculation: AnySpeculation | None = None


_DONE = object()  # end-of-stream marker in a handle's queue


class RequestHandle:
    """The consumer's side of one request: iterate outputs, or cancel."""

    def __init__(
        self, request: Request, model: str, speculation: AnySpeculation | None = None
    ) -> None:
        self.request = request
        self.model = model
        self.id = request.id
        self.speculation = speculation  # fixed at submit: configure() affects later requests
        self.sent_ids = 0  # output ids already delivered (engine thread)
        self._cancelled = threading.Event()
        self._sync: queue.Queue[object] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async: asyncio.Queue[object] | None = None
        # bind_loop (event loop) and _put (engine thread) race: without it an output put to the
        # sync queue just after bind_loop drained it would never reach the async consumer
        self._bind = threading.Lock()

    def bind_loop(self) -> RequestHandle:
        """Deliver outputs to the running asyncio loop (call from that loop, before iterating)."""
        with self._bind:
            self._loop = asyncio.get_running_loop()
            self._async = asyncio.Queue()
            # outputs that arrived before binding
            while not self._sync.empty():
                self._async.put_nowait(self._sync.get_nowait())
        return self

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put(self, item: object) -> None:  # engine thread
        with self._bind:
            if self._loop is None or self._async is None:
                self._sync.put(item)
                return
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                self._cancelled.set()

    def __iter__(self) -> Iterator[RequestOutput]:
        while (item := self._sync.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, RequestOutput)
            yield item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._async is not None, "call bind_loop() first"
        while (item := await self._async.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, RequestOutput)
            yield item


class Engine:
    def __init__(
        self,
        models: dict[str, ServedModel],
        max_waiting: int = 64,
        scheduler: SchedulerConfig | None = None,
        prefix_cache: PrefixCacheConfig | None = None,
    ) -> None:
        """`prefix_cache`: each model's prefix cache (None: the defaults, on)."""
        if not models:
            raise ValueError("the engine needs at least one model")
        self.models = models
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._waiting: deque[RequestHandle] = deque()  # submitted, not yet in a core
        self._wake = threading.Condition(self._lock)
        prefix = prefix_cache or PrefixCacheConfig()
        self._cores = {name: EngineCore(s.lm, scheduler, prefix) for name, s in models.items()}
        self._handles: dict[Sequence, RequestHandle] = {}  # engine thread only
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.error: BaseException | None = None  # what killed the engine thread, if anything
        for name, served in models.items():
            if served.speculation is None:
                self.configure(name, served.spec_config)

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        """Start the engine thread. The caller (which loaded the models) should run no torch
        work while the engine runs: its OpenMP workers are released here (see
        `release_openmp_workers`)."""
        assert self._thread is None, "already started"
        release_openmp_workers()
        self._thread = threading.Thread(target=self._loop, name="quickdraft-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + sum(c.num_waiting for c in self._cores.values())

    @property
    def num_running(self) -> int:
        return sum(c.num_running for c in self._cores.values())

    @property
    def step_stats(self) -> dict[str, StepStats]:
        """Per model: live step counters (steps, rows, drafts, accepted, ...); read-only."""
        return {name: core.stats for name, core in self._cores.items()}

    def configure(self, model: str, spec_config: SpeculativeConfig) -> None:
        """Set `model`'s speculation for requests submitted from now on (loads a draft model
        if needed, in the caller's thread; running requests keep what they started with)."""
        served = self._served(model)
        try:
            speculation = make_speculation(served.lm, spec_config)
        finally:
            release_openmp_workers()  # this thread ran torch ops (draft load, cost timing)
        with self._lock:
            served.spec_config, served.speculation = spec_config, speculation

    def submit(
        self,
        model: str,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        tenant: str = "",
        images: list[ImageInput] | tuple[ImageInput, ...] = (),
    ) -> RequestHandle:
        """`tenant`: who sent it; what a drafter learns from one request's output drafts only
        for requests of the same tenant (speculation/drafters/ngram.py). `images`: one per
        image placeholder in `prompt_ids` (a vision-language model)."""
        served = self._served(model)
        rid = request_id or f"req-{next(self._ids)}"
        # ValueError if too long (with the images' rows), ImageError for images it cannot take
        request = served.lm.new_request(prompt_ids, params, rid, tenant, images)
        with self._lock:
            if not self.alive:
                raise EngineDeadError("the engine is not running")
            if self.num_waiting >= self.max_waiting:
                raise QueueFullError(f"{self.num_waiting} requests are already waiting")
            # an embedding request (params.pooling) only prefills: it never speculates
            speculation = served.speculation if params.pooling is None else None
            handle = RequestHandle(request, model, speculation)
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    # ------------------------------------------------------------------ engine thread

    def _served(self, model: str) -> ServedModel:
        try:
            return self.models[model]
        except KeyError:
            raise ValueError(f"unknown model {model!r}; serving {sorted(self.models)}") from None

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._waiting and not self._busy() and not self._stop:
                        self._wake.wait()
                    if self._stop:
                        break
                    incoming = list(self._waiting)
                    self._waiting.clear()
                for handle in incoming:
                    seq = self._cores[handle.model].add(handle.request, handle.speculation)
                    self._handles[seq] = handle
                self._reap_cancelled()
                for core in self._cores.values():
                    if core.has_work:
                        self._emit(core.step())
        except BaseException as exc:  # the thread dies: every consumer must hear about it
            self.error = exc
            log.exception("engine thread died")
            raise
        finally:
            with self._lock:
                self._stop = True
                orphans = list(self._waiting) + list(self._handles.values())
                self._waiting.clear()
            self._handles.clear()
            for h in orphans:
                h._put(EngineDeadError("the engine stopped"))
                h._put(_DONE)

    def _busy(self) -> bool:
        return any(core.has_work for core in self._cores.values())

    def _reap_cancelled(self) -> None:
        """Cancelled requests leave before the next step; their caches are freed now."""
        for seq, handle in list(self._handles.items()):
            if handle.cancelled and not seq.request.finished:
                self._cores[handle.model].abort(seq)
                self._emit([seq])

    def _emit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            handle = self._handles[seq]
            req = seq.request
            if seq.error is not None:
                handle._put(seq.error)
            text = req.stream_delta()
            if text or req.finished:
                handle._put(self._output(req, text, handle.sent_ids, seq.cached_tokens))
                handle.sent_ids = len(req.output_ids)
            if req.finished:
                del self._handles[seq]  # before _DONE: a consumer that saw the end of its
                handle._put(_DONE)  # stream also sees the engine without its request
                log.info(
                    "request %s finished (%s): %d prompt + %d output tokens, %s",
                    req.id,
                    req.finish_reason,
                    len(req.prompt_ids),
                    len(req.output_ids),
                    req.spec.summary(),
                )

    @staticmethod
    def _output(req: Request, text: str, sent_ids: int, cached_tokens: int) -> RequestOutput:
        return RequestOutput(
            req.id,
            text,
            req.output_ids[sent_ids:],
            req.finish_reason,
            len(req.prompt_ids),
            len(req.output_ids),
            req.spec,
            req.timing,
            req.logprobs[sent_ids:],
            cached_tokens=cached_tokens,
            stop_reason=req.stop_reason,
            prompt_logprobs=req.prompt_logprobs
            if sent_ids == 0 and req.params.prompt_logprobs is not None
            else None,
            embedding=req.embedding.tolist()
            if req.finished and req.embedding is not None
            else None,
        )
