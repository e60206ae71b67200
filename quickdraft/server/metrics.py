"""Serving telemetry: Prometheus metrics (`/metrics`) and the admin page's live numbers.

Stage: the HTTP side, fed by each request's stream of `RequestOutput`s as the event loop
receives them (so TTFT and inter-token latency are what a client sees, queueing included). All
updates run on the event-loop thread: no locks. Names mirror vLLM's with a `quickdraft:`
prefix; speculation counters follow vLLM's counting (a "draft" is one cycle that proposed >= 1
token; accepted tokens exclude the bonus token). Speculation counters advance with every output,
not only at the end, so a long request shows up in the live view while it runs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from quickdraft.engine import RequestOutput
from quickdraft.engine.prefix_cache import PrefixCacheStats
from quickdraft.image_encoder import EncoderStats
from quickdraft.request import SpecStats

log = logging.getLogger("quickdraft.server")

PREFIX = "quickdraft:"
WINDOW_S = 10.0  # the live view's tok/s and recent acceptance cover this many seconds
# vLLM's bucket edges, widened at the top: a CPU decodes far slower than a GPU
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
E2E_BUCKETS = (0.3, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 240, 480, 960, 1920)


@dataclass(slots=True)
class ModelStats:
    """Plain aggregates per model for the admin page (Prometheus holds the same counts)."""

    requests: int = 0
    output_tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    recent: deque[tuple[float, int, int, int]] = field(default_factory=deque)  # t, out, drft, acc
    last_request: dict[str, Any] | None = None

    def add(self, now: float, tokens: int, drafted: int, accepted: int) -> None:
        self.output_tokens += tokens
        self.recent.append((now, tokens, drafted, accepted))
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()

    def acceptance_histogram(self) -> list[int]:
        """[j] = drafting cycles that accepted exactly j tokens. Accepted tokens are always a
        prefix of the draft, so cycles with >= j accepted = accepted_per_pos[j - 1]."""
        at_least = [self.drafts, *self.accepted_per_pos, 0]
        return [at_least[j] - at_least[j + 1] for j in range(len(at_least) - 1)]

    def snapshot(self, now: float) -> dict[str, Any]:
        self._prune(now)
        tokens = sum(r[1] for r in self.recent)
        drafted = sum(r[2] for r in self.recent)
        accepted = sum(r[3] for r in self.recent)
        return {
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "acceptance_rate": _ratio(self.accepted, self.draft_tokens),
            "mean_acceptance_length": 1 + _ratio(self.accepted, self.drafts) if self.drafts else 0,
            "acceptance_histogram": self.acceptance_histogram(),
            "recent_tok_s": round(tokens / WINDOW_S, 2),
            "recent_acceptance_rate": _ratio(accepted, drafted),
            "window_s": WINDOW_S,
            "last_request": self.last_request,
        }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else 0.0


PrefixStats = Callable[[], dict[str, PrefixCacheStats | None]]


class PrefixCacheCollector(Collector):
    """The engine's live prefix-cache counters, read at scrape time (vLLM's names:
    prefix_cache_queries / _hits in tokens; and the cache's blocks, bytes and evictions)."""

    def __init__(self, stats: PrefixStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        per_model = {name: st for name, st in self.stats().items() if st is not None}
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", "queries"),
            "prefix_cache_hits": ("Prompt tokens served from the prefix cache", "hits"),
            "prefix_cache_evicted_blocks": ("Blocks evicted from the prefix cache", "evicted"),
        }
        for metric, (doc, attr) in counters.items():
            c = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            for name, st in per_model.items():
                c.add_metric([name], getattr(st, attr))
            yield c
        gauges = {
            "prefix_cache_blocks": ("Blocks held by the prefix cache", "blocks"),
            "prefix_cache_bytes": ("Bytes held by the prefix cache", "bytes"),
            "prefix_cache_budget_bytes": ("The prefix cache's memory budget", "budget_bytes"),
        }
        for metric, (doc, attr) in gauges.items():
            g = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            for name, st in per_model.items():
                g.add_metric([name], getattr(st, attr))
            yield g


EncoderStatsFn = Callable[[], dict[str, EncoderStats | None]]


class EncoderCollector(Collector):
    """A vision-language model's image encoder, read at scrape time (vLLM's multimodal cache
    names: images looked up by content digest, and those found encoded already)."""

    def __init__(self, stats: EncoderStatsFn) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        per_model = {name: st for name, st in self.stats().items() if st is not None}
        counters = {
            "mm_cache_queries": ("Images looked up in the image encoder's cache", "images"),
            "mm_cache_hits": ("Images whose encoding the cache held", None),
            "image_encoder_seconds": ("Seconds the vision tower ran", "seconds"),
        }
        for metric, (doc, attr) in counters.items():
            c = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            for name, st in per_model.items():
                c.add_metric([name], st.images - st.encoded if attr is None else getattr(st, attr))
            yield c
        g = GaugeMetricFamily(
            PREFIX + "mm_cache_bytes", "Bytes of image encodings held", labels=["model_name"]
        )
        for name, st in per_model.items():
            g.add_metric([name], st.bytes)
        yield g


class Metrics:
    def __init__(
        self,
        models: list[str],
        prefix_stats: PrefixStats | None = None,
        encoder_stats: EncoderStatsFn | None = None,
    ) -> None:
        # one registry per app: several servers (tests) in one process never share counters
        self.registry = r = CollectorRegistry()
        if prefix_stats is not None:
            r.register(PrefixCacheCollector(prefix_stats))
        if encoder_stats is not None:
            r.register(EncoderCollector(encoder_stats))
        m = ["model_name"]
        self.success = Counter(
            PREFIX + "request_success", "Finished requests", [*m, "finished_reason"], registry=r
        )
        self.errors = Counter(
            PREFIX + "request_errors", "Requests answered with an error", ["status"], registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens", m, registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens", m, registry=r
        )
        self.running = Gauge(PREFIX + "num_requests_running", "Requests decoding", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued", registry=r)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first token",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time per output token after the first",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last token",
            m,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.num_drafts = Counter(
            PREFIX + "spec_decode_num_drafts", "Cycles that drafted >= 1 token", m, registry=r
        )
        self.num_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Drafted tokens", m, registry=r
        )
        self.num_accepted = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Accepted draft tokens", m, registry=r
        )
        self.num_relaxed = Counter(
            PREFIX + "spec_decode_num_relaxed_accepted_tokens",
            "Accepted draft tokens that strict verification would have rejected (relaxed "
            "thinking-phase acceptance; counted within the accepted tokens too)",
            m,
            registry=r,
        )
        self.accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position",
            [*m, "position"],
            registry=r,
        )
        self.models = {name: ModelStats() for name in models}
        for name in models:  # export zeros from the start: a scrape always lists every series
            for c in (self.prompt_tokens, self.generation_tokens, self.num_drafts):
                c.labels(name)
            for c in (self.num_draft_tokens, self.num_accepted, self.num_relaxed):
                c.labels(name)

    def track(self, model: str, prompt_tokens: int, arrived: float) -> RequestTrack:
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        return RequestTrack(self, model, arrived)

    def error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def scrape(self, running: int, waiting: int) -> bytes:
        self.running.set(running)
        self.waiting.set(waiting)
        return bytes(generate_latest(self.registry))

    def cumulative_acceptance(self, model: str) -> float:
        s = self.models[model]
        return s.accepted / s.draft_tokens if s.draft_tokens else 0.0

    def add_spec(
        self, model: str, drafts: int, drafted: int, accepted: list[int], relaxed: int = 0
    ) -> None:
        """Add one request's speculation progress (deltas); accepted = [per position];
        `relaxed`: of those, kept only by relaxed acceptance."""
        stats = self.models[model]
        stats.drafts += drafts
        stats.draft_tokens += drafted
        n_acc = sum(accepted)
        stats.accepted += n_acc
        grow = len(accepted) - len(stats.accepted_per_pos)
        if grow > 0:
            stats.accepted_per_pos += [0] * grow
        self.num_drafts.labels(model).inc(drafts)
        self.num_draft_tokens.labels(model).inc(drafted)
        self.num_accepted.labels(model).inc(n_acc)
        if relaxed:
            self.num_relaxed.labels(model).inc(relaxed)
        for pos, n in enumerate(accepted):
            if n:
                stats.accepted_per_pos[pos] += n
                self.accepted_per_pos.labels(model, str(pos)).inc(n)


class RequestTrack:
    """One request's view: turns its outputs into metric observations."""

    __slots__ = (
        "arrived",
        "done",
        "drafted",
        "drafts",
        "first",
        "last",
        "metrics",
        "model",
        "per_pos",
        "relaxed",
        "tokens",
    )

    def __init__(self, metrics: Metrics, model: str, arrived: float) -> None:
        self.metrics = metrics
        self.model = model
        self.arrived = arrived
        self.first: float | None = None
        self.last = arrived
        self.done = False
        self.tokens = 0
        self.drafts = 0  # speculation counts already reported
        self.drafted = 0
        self.relaxed = 0
        self.per_pos: list[int] = []

    def output(self, out: RequestOutput, now: float) -> None:
        n = len(out.token_ids)
        d_drafted, d_accepted = self._spec_delta(out.spec)
        self.metrics.models[self.model].add(now, n, d_drafted, d_accepted)
        if n == 0:
            return
        self.metrics.generation_tokens.labels(self.model).inc(n)
        if self.first is None:
            self.first = now
            self.metrics.ttft.labels(self.model).observe(now - self.arrived)
            n -= 1  # the first token's latency is the TTFT
        if n > 0:  # a speculative block of n tokens arrives at once: n tokens, gap/n each
            per_token = (now - self.last) / n
            itl = self.metrics.itl.labels(self.model)
            for _ in range(n):
                itl.observe(per_token)
        self.last = now
        self.tokens += len(out.token_ids)

    def _spec_delta(self, spec: SpecStats) -> tuple[int, int]:
        # The engine thread updates SpecStats while we read it; deltas against what was already
        # reported keep the totals exact once the final output has been seen.
        per_pos = list(spec.accepted_per_position)
        drafted_pos = list(spec.drafted_per_position)
        drafts_now = drafted_pos[0] if drafted_pos else 0
        drafted_now = spec.drafted
        if drafted_now == self.drafted and per_pos == self.per_pos:
            return 0, 0
        old = self.per_pos + [0] * (len(per_pos) - len(self.per_pos))
        delta = [n - o for n, o in zip(per_pos, old, strict=False)]
        d_drafted = drafted_now - self.drafted
        relaxed_now = spec.relaxed
        d_relaxed = relaxed_now - self.relaxed
        self.metrics.add_spec(self.model, drafts_now - self.drafts, d_drafted, delta, d_relaxed)
        self.drafts, self.drafted, self.per_pos = drafts_now, drafted_now, per_pos
        self.relaxed = relaxed_now
        return d_drafted, sum(delta)

    def abort(self, request_id: str, now: float, reason: str = "abort") -> None:
        """The request ended before its last output: "abort" = the client went away (vLLM's
        name), "error" = it failed."""
        self.done = True
        self.metrics.success.labels(self.model, reason).inc()
        log.info(
            "request %s %s: finish=%s after %d tokens, %.2fs",
            request_id,
            self.model,
            reason,
            self.tokens,
            now - self.arrived,
        )

    def finish(self, out: RequestOutput, now: float) -> None:
        """The request's last output has been handled: count it and log one line."""
        self.done = True
        stats = self.metrics.models[self.model]
        stats.requests += 1
        reason = str(out.finish_reason)
        self.metrics.success.labels(self.model, reason).inc()
        self.metrics.e2e.labels(self.model).observe(now - self.arrived)
        ttft = (self.first - self.arrived) if self.first is not None else None
        decode_s = now - self.first if self.first is not None else 0.0
        tok_s = (self.tokens - 1) / decode_s if self.tokens > 1 and decode_s > 0 else 0.0
        stats.last_request = {
            "id": out.request_id,
            "finish_reason": reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "ttft_s": None if ttft is None else round(ttft, 4),
            "e2e_s": round(now - self.arrived, 4),
            "decode_tok_s": round(tok_s, 2),
            "speculative": out.spec.as_dict(),
        }
        spec = out.spec
        log.info(
            "request %s %s: finish=%s prompt=%d completion=%d ttft=%s e2e=%.2fs "
            "decode=%.1f tok/s spec=%s acceptance %.0f%% (AL %.2f) | cumulative acceptance "
            "%.0f%%",
            out.request_id,
            self.model,
            reason,
            out.prompt_tokens,
            out.completion_tokens,
            "-" if ttft is None else f"{ttft:.2f}s",
            now - self.arrived,
            tok_s,
            spec.method,
            100 * spec.acceptance_rate,
            spec.mean_acceptance_length,
            100 * self.metrics.cumulative_acceptance(self.model),
        )


def now() -> float:
    return time.perf_counter()
