"""Build and run the cluster application: engine replicas + ingress on Ray Serve.

Stage: process entry for `quickdraft serve --replicas N` (`serve_cluster`) and for Ray Serve's
own tools (`serve run quickdraft.ray:build`, a Serve config file; see quickdraft/ray.py).
`build_app` is the one place that says how the deployments are configured:

- engine replicas: `replicas` of them (or autoscaled from `replicas` up to `max_replicas` on
  ongoing requests per replica), each a process holding `threads_per_replica` CPUs of Ray's and
  as many torch threads; routed by router.PrefixAffinityRouter; Ray replaces one whose process
  dies or whose engine thread died (`check_health`); a stopping replica (scale-down, redeploy)
  finishes its open requests for up to the shutdown timeout first.
- the ingress: one replica with no CPU reservation (it tokenizes and relays; the engines
  compute), behind Serve's HTTP proxy on `host:port`.

`serve_cluster` starts a local Ray instance (or joins `address`), runs the application, and on
SIGTERM / Ctrl-C shuts Serve down, which drains the open requests as above.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any

from quickdraft.server.main import ServeOptions, _setup_logging, start_settings
from quickdraft.server.state import ServerConfig

log = logging.getLogger("quickdraft.server")
APP_NAME = "quickdraft"


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    replicas: int = 2
    max_replicas: int | None = None  # > replicas: autoscale between the two
    threads_per_replica: int = 1
    address: str | None = None  # an existing Ray cluster ("auto", "ray://host:10001"); None: local
    num_cpus: int | None = None  # a local Ray instance's CPUs (None: the machine's)
    spill_threshold: int = 4  # router.PrefixAffinityRouter

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(
                f"--max-replicas ({self.max_replicas}) must be >= --replicas ({self.replicas})"
            )
        if self.threads_per_replica < 1:
            raise ValueError(f"--threads-per-replica must be >= 1, got {self.threads_per_replica}")
        if self.spill_threshold < 1:
            raise ValueError(f"spill threshold must be >= 1, got {self.spill_threshold}")


def build_app(opts: ServeOptions, config: ServerConfig, cluster: ClusterOptions) -> Any:
    """The Serve application (a `ray.serve.Application`); `config` must carry an admin token."""
    from ray import serve

    from quickdraft.cluster.ingress import Ingress
    from quickdraft.cluster.replica import EngineReplica
    from quickdraft.cluster.router import PrefixAffinityRouter

    config, spec, saved = start_settings(opts, config)
    name = opts.served_name or opts.model
    threads = cluster.threads_per_replica
    scaling: dict[str, Any] = {"num_replicas": cluster.replicas}
    if cluster.max_replicas is not None and cluster.max_replicas > cluster.replicas:
        scaling = {
            "autoscaling_config": {
                "min_replicas": cluster.replicas,
                "max_replicas": cluster.max_replicas,
                # a CPU engine batches a handful of requests well; more queue in the router
                "target_ongoing_requests": 4,
            }
        }
    engines = serve.deployment(
        name="EngineReplica",
        ray_actor_options={
            "num_cpus": threads,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        max_ongoing_requests=config.max_concurrency,
        graceful_shutdown_timeout_s=opts.shutdown_timeout_s,
        health_check_period_s=2,
        health_check_timeout_s=30,
        request_router_config={
            "request_router_class": PrefixAffinityRouter,
            "request_router_kwargs": {"spill_threshold": cluster.spill_threshold},
            "request_routing_stats_period_s": 2,
        },
        **scaling,
    )(EngineReplica)
    ingress = serve.deployment(
        name="Ingress",
        ray_actor_options={"num_cpus": 0},
        # the app answers 503 beyond --max-concurrency itself; health and metrics still pass
        max_ongoing_requests=config.max_concurrency + 16,
        graceful_shutdown_timeout_s=opts.shutdown_timeout_s + 5,
    )(Ingress)
    engine_app = engines.bind(
        opts.model,
        opts.dtype,
        spec,
        name,
        threads,
        config.max_concurrency,
        opts.prefix_cache,
        opts.mmproj,
    )
    return ingress.bind(engine_app, config, saved)


def start_ray(cluster: ClusterOptions) -> None:
    """Join `cluster.address`, or start a local Ray instance (no dashboard)."""
    import ray

    if cluster.address is not None:
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        ray.init(num_cpus=cluster.num_cpus, include_dashboard=False, log_to_driver=False)


def serve_cluster(opts: ServeOptions, config: ServerConfig, cluster: ClusterOptions) -> None:
    import ray
    from ray import serve

    _setup_logging(opts.log_level)
    start_ray(cluster)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": opts.host, "port": opts.port})
        name = opts.served_name or opts.model
        log.info(
            "deploying %s: %d replica(s) x %d thread(s)%s",
            name,
            cluster.replicas,
            cluster.threads_per_replica,
            f", autoscaling to {cluster.max_replicas}" if cluster.max_replicas else "",
        )
        serve.run(build_app(opts, config, cluster), name=APP_NAME, route_prefix="/")
        url = f"http://{opts.host}:{opts.port}"
        log.info("serving %s at %s/v1 (admin page %s/admin, metrics %s/metrics)", name, *[url] * 3)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        log.info("shutting down: open requests finish (up to %g s)", opts.shutdown_timeout_s)
    finally:
        serve.shutdown()
        ray.shutdown()
