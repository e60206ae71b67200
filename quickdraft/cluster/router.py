"""Prefix-affinity routing: Ray Serve's request router for the engine replicas.

Stage: inside each DeploymentHandle that calls the replicas (the ingress's). A request whose
`GenerateCall.route_key` is set goes to its home replica: the one ranked first by rendezvous
(highest-random-weight) hashing of (key, replica id). That is consistent hashing: when a
replica leaves, only its keys move, and each goes to its own second choice, so the prefix cache
and the n-gram drafter's index on every other replica keep paying.

Load-aware spill-over: when the home replica's queue is `spill_threshold` or more requests
longer than the least-loaded replica's, or Ray finds it full (`max_ongoing_requests`), the
request goes to the rest instead. Among equals (no key, or spilling) Ray Serve picks the
replica with the shortest queue; ties go to the higher acceptance rate the replica last
reported (replica.py `record_routing_stats`), where drafting pays most.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from quickdraft.cluster.calls import GenerateCall


def route_key(pending: PendingRequest | None) -> str:
    """The request's route key ("" when it has none, e.g. a configure call)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], GenerateCall):
        return ""
    return pending.args[0].route_key


def rendezvous(key: str, replicas: list[str]) -> list[str]:
    """`replicas` in the key's preference order (the first is its home)."""

    def weight(replica: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()

    return sorted(replicas, key=weight, reverse=True)


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, spill_threshold: int = 4, **kwargs: Any) -> None:
        """`spill_threshold`: how many more queued requests than the least-loaded replica the
        home replica may have before a request goes elsewhere."""
        if spill_threshold < 1:
            raise ValueError(f"spill_threshold must be >= 1, got {spill_threshold}")
        self.spill_threshold = spill_threshold

    def _queue(self, r: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(r.replica_id)
        if cached is not None:
            return cached
        return int(r.routing_stats.get("queue", 0))

    def _least_loaded_first(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        return sorted(
            replicas, key=lambda r: (self._queue(r), -r.routing_stats.get("acceptance", 0.0))
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = route_key(pending_request)
        if not key:
            return [self._least_loaded_first(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = [by_id[i] for i in rendezvous(key, list(by_id))]
        home, rest = order[0], self._least_loaded_first(order[1:])
        least = min(self._queue(r) for r in candidate_replicas)
        if self._queue(home) - least >= self.spill_threshold:
            return [rest, [home]] if rest else [[home]]
        return [[home], rest] if rest else [[home]]
