"""One engine replica: a Ray Serve replica (its own process) that runs one quickdraft Engine.

Stage: the generating side of a cluster. The replica loads the model once, starts the engine
thread with `threads` torch threads, and serves `generate(GenerateCall)` as a stream (see
calls.py for its shape). Before submitting, it brings the model's speculation to the config the
call carries, so an admin change reaches every replica, including ones Ray starts later.

Ray Serve drives the rest: `record_routing_stats` gives the router this replica's queue depth
and acceptance; `check_health` fails once the engine thread is dead, so Ray replaces the
replica; a graceful stop (scale-down, redeploy) waits for the open streams
(`graceful_shutdown_timeout_s`) before `__del__` stops the engine. A stream the ingress
cancels (its client left) cancels the engine request in `finally:`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from quickdraft.cluster.calls import GenerateCall, ModelInfo, Refusal, ReplicaStatus
from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine import Engine, EngineDeadError, QueueFullError, RequestOutput


class EngineReplica:
    def __init__(
        self,
        model: str,
        dtype: str,
        spec: SpeculativeConfig,
        served_name: str,
        threads: int,
        max_waiting: int,
        prefix_cache: PrefixCacheConfig,
        mmproj: str | None = None,
    ) -> None:
        import torch
        from ray import serve

        from quickdraft.engine import ServedModel
        from quickdraft.loading import load

        torch.set_num_threads(threads)
        self.replica = serve.get_replica_context().replica_id.unique_id
        lm = load(model, dtype, progress=False, mmproj=mmproj)
        self.engine = Engine(
            {served_name: ServedModel(lm, spec)}, max_waiting=max_waiting, prefix_cache=prefix_cache
        )
        self.engine.start()
        self._configure_lock = asyncio.Lock()

    def describe(self) -> list[ModelInfo]:
        return [
            ModelInfo(
                name,
                s.lm.path,
                s.lm.tokenizer,
                s.lm.vocab_size,
                s.lm.context_length,
                s.lm.eos_ids,
                s.spec_config,
                s.lm.device,
                s.lm.image_processing,
                s.lm.video_processing,
            )
            for name, s in self.engine.models.items()
        ]

    def status(self) -> ReplicaStatus:
        stats = self.engine.step_stats
        return ReplicaStatus(
            self.replica,
            os.getpid(),
            self.engine.num_running,
            self.engine.num_waiting,
            sum(s.draft_rows for s in stats.values()),
            sum(s.accepted for s in stats.values()),
            {name: s.prefix_cache for name, s in stats.items()},
            {name: s.encoder for name, s in stats.items()},
        )

    async def configure(self, model: str, spec: SpeculativeConfig) -> str | None:
        """Apply `spec` to `model`'s new requests; the reason it cannot, or None."""
        async with self._configure_lock:
            if self.engine.models[model].spec_config == spec:
                return None
            try:  # may load a draft model: off the replica's event loop
                await asyncio.to_thread(self.engine.configure, model, spec)
            except (ValueError, OSError) as exc:
                return str(exc)
            return None

    async def generate(
        self, call: GenerateCall
    ) -> AsyncIterator[RequestOutput | ReplicaStatus | Refusal]:
        if call.model not in self.engine.models:
            yield Refusal("invalid", f"model {call.model!r} is not served here", "model")
            return
        problem = await self.configure(call.model, call.spec)
        if problem is not None:
            yield Refusal("invalid", f"cannot apply the speculation settings: {problem}")
            return
        try:
            handle = self.engine.submit(
                call.model,
                call.prompt_ids,
                call.params,
                call.request_id,
                call.tenant,
                call.images,
            )
        except QueueFullError as exc:
            yield Refusal("queue_full", str(exc))
            return
        except EngineDeadError as exc:
            yield Refusal("engine_dead", str(exc))
            return
        except ValueError as exc:
            yield Refusal("invalid", str(exc), getattr(exc, "param", None))
            return
        handle.bind_loop()
        try:
            yield self.status()
            async for out in handle:
                yield out
            yield self.status()
        finally:  # finished: a no-op; the ingress cancelled the stream: free the sequence now
            handle.cancel()

    def record_routing_stats(self) -> dict[str, float]:
        """Ray Serve calls this every `request_routing_stats_period_s`; router.py reads it."""
        st = self.status()
        return {"queue": st.running + st.waiting, "acceptance": st.acceptance}

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine thread is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)  # absent when __init__ failed
        if engine is not None:
            engine.stop()
