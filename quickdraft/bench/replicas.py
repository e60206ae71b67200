"""The scale-out benchmark (`quickdraft bench --serve --replicas 1,2`).

On one machine, the same CPU budget split three ways, each a real server process under the
same streamed greedy load at one concurrency (serving.py's client, prompts and summary):
the single-process server with `cores` threads, then `quickdraft serve --replicas R` with
`cores / R` threads per replica for each R given (R = 1 isolates what Ray Serve's proxy, the
ingress and the handle add; R > 1 is process-level parallelism instead of torch threads).
Warm-up requests excluded. Each request is a conversation of `turns` turns sharing a system
prompt, so prefix affinity shows up as cached prompt tokens. Per-replica figures (routed
requests, acceptance) come from the server's `/metrics` and admin API. Writes
serve-replicas-<model>.{json,md,png}; docs/cluster.md projects them to N machines.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from quickdraft.bench.report import RESULTS, machine, write
from quickdraft.bench.serving import LoadTest, Sample, _server_cmd, _summary, served
from quickdraft.config import BENCH_MAX_TOKENS, DEFAULT_DTYPE, SpeculativeConfig

SYSTEM = (
    "You are a senior Python reviewer. Answer with short code and one-line explanations; "
    "keep names as the user wrote them and never invent APIs."
)
TOPICS = [
    "reverse a linked list",
    "parse an ISO date",
    "merge two sorted lists",
    "count words in a file",
    "flatten a nested list",
    "check balanced brackets",
    "memoize a function",
    "read a CSV into dicts",
]


@dataclass(frozen=True, slots=True)
class ScaleTest:
    model: str = "smollm2-135m"
    dtype: str = DEFAULT_DTYPE
    spec: SpeculativeConfig = field(default_factory=lambda: SpeculativeConfig(method="ngram"))
    replicas: tuple[int, ...] = (1, 2)
    concurrency: int = 8
    conversations: int = 16  # each `turns` requests, sent in order
    turns: int = 2
    max_tokens: int = BENCH_MAX_TOKENS
    cores: int = 2  # the CPU budget every configuration gets
    start_timeout_s: float = 1800.0
    out_dir: Path = RESULTS

    def __post_init__(self) -> None:
        for r in self.replicas:
            if r < 1 or self.cores % r:
                raise ValueError(f"--replicas {r}: must divide the {self.cores} cores evenly")


def _cluster_cmd(t: ScaleTest, replicas: int, port: int, token: str, settings: Path) -> list[str]:
    base = LoadTest(t.model, t.dtype, t.spec, (t.concurrency,), max_tokens=t.max_tokens)
    cmd = _server_cmd(base, port, token, settings)
    return [*cmd, "--replicas", str(replicas), "--threads-per-replica", str(t.cores // replicas)]


def _single_cmd(t: ScaleTest, port: int, token: str, settings: Path) -> list[str]:
    base = LoadTest(t.model, t.dtype, t.spec, (t.concurrency,), max_tokens=t.max_tokens)
    return _server_cmd(replace(base, threads=t.cores), port, token, settings)


async def _conversation(
    client: httpx.AsyncClient, t: ScaleTest, topic: str, turns: int, max_tokens: int
) -> list[tuple[Sample, int, str]]:
    """One conversation's turns, in order: (sample, cached prompt tokens, replica)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": topic}]
    out = []
    for turn in range(turns):
        body = {
            "model": t.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        first = last = None
        usage: dict[str, Any] = {}
        spec: dict[str, Any] = {}
        parts: list[str] = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            replica = r.headers.get("x-quickdraft-replica", "-")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    parts.append(chunk["choices"][0]["delta"]["content"])
                    last = time.perf_counter()
                    first = first or last
                if chunk.get("usage"):
                    usage, spec = chunk["usage"], chunk.get("speculative") or {}
        done = time.perf_counter()
        n = usage.get("completion_tokens", 0)
        first, last = first or done, last or done
        itl = (last - first) / (n - 1) if n > 1 else None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.append((Sample(first - sent, itl, done - sent, n, spec), cached, replica))
        messages += [
            {"role": "assistant", "content": "".join(parts)},
            {"role": "user", "content": f"Now make it handle edge case {turn + 1}."},
        ]
    return out


async def _load(url: str, t: ScaleTest, n: int, turns: int, max_tokens: int) -> Any:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(f"{TOPICS[i % len(TOPICS)]} (variant {i})")
    results: list[list[tuple[Sample, int, str]]] = []
    timeout = httpx.Timeout(3600.0, connect=10.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:

        async def worker() -> None:
            while not queue.empty():
                topic = queue.get_nowait()
                results.append(await _conversation(client, t, topic, turns, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(t.concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def _row(results: list[list[tuple[Sample, int, str]]], wall: float) -> dict[str, Any]:
    samples = [s for conv in results for s, _, _ in conv]
    row = _summary(samples, wall)
    later = [c for conv in results for _, c, _ in conv[1:]]
    row["cached_tokens_later_turns_mean"] = round(sum(later) / len(later), 1) if later else 0.0
    homes = [len({r for _, _, r in conv}) == 1 for conv in results]
    row["conversations_on_one_replica"] = f"{sum(homes)}/{len(homes)}"
    per: dict[str, int] = {}
    for conv in results:
        for _, _, r in conv:
            per[r] = per.get(r, 0) + 1
    row["requests_per_replica"] = dict(sorted(per.items()))
    return row


def _measure(url: str, token: str, t: ScaleTest) -> dict[str, Any]:
    # warm-up, excluded: kernels, allocator, each replica's first batches
    asyncio.run(_load(url, t, t.concurrency, 1, 8))
    results, wall = asyncio.run(_load(url, t, t.conversations, t.turns, t.max_tokens))
    row = _row(results, wall)
    state = httpx.get(
        url + "/admin/api/state", headers={"Authorization": f"Bearer {token}"}, timeout=30
    ).json()
    row["replicas"] = state.get("replicas", [])
    return row


def run_scale_test(t: ScaleTest) -> dict[str, Any]:
    host = machine()  # before the servers start: the code they run is the code recorded
    configs: dict[str, Callable[[int, str, Path], list[str]]] = {
        f"single process x {t.cores} threads": partial(_single_cmd, t)
    }
    for r in t.replicas:
        configs[f"{r} replica(s) x {t.cores // r} thread(s)"] = partial(_cluster_cmd, t, r)
    results: dict[str, dict[str, Any]] = {}
    for label, command in configs.items():
        with served(command, t.start_timeout_s, "scale") as server:
            results[label] = row = _measure(server.url, server.token, t)
            print(f"[scale bench] {label}: {json.dumps(row)}", flush=True)
    report = {
        "bench": "serve-replicas",
        "model": t.model,
        "dtype": t.dtype,
        "speculation": asdict(t.spec),
        "concurrency": t.concurrency,
        "conversations": t.conversations,
        "turns": t.turns,
        "max_tokens": t.max_tokens,
        "cores": t.cores,
        "cpu_flags": _cpu_flags(),
        "machine": host,
        "results": results,
    }
    stem = f"serve-replicas-{Path(t.model).name}"
    write(stem, report, markdown(report), _plot(report), t.out_dir, figsize=(12, 3.8))
    return report


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def markdown(report: dict[str, Any]) -> str:
    spec = report["speculation"]
    lines = [
        f"{report['model']} {report['dtype']}, speculation {spec['method']} k <= "
        f"{spec['num_draft_tokens']}, concurrency {report['concurrency']}, "
        f"{report['conversations']} conversations x {report['turns']} turns, max_tokens "
        f"{report['max_tokens']}, greedy, streamed over HTTP; every row uses {report['cores']} "
        "cores",
        "",
        "| configuration | output tok/s | TTFT p50 / p99 s | ITL mean ms | e2e p50 / p99 s "
        "| acceptance | cached tokens (turn 2+) | conversations on one replica | requests per "
        "replica |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in report["results"].items():
        itl = "" if r["itl_mean_s"] is None else f"{1000 * r['itl_mean_s']:.1f}"
        acc = f"{100 * r['acceptance_rate']:.0f} %" if r["drafted"] else "-"
        per = ", ".join(str(n) for n in r["requests_per_replica"].values())
        lines.append(
            f"| {label} | {r['output_tok_s']:.2f} | {r['ttft_p50_s']:.2f} / "
            f"{r['ttft_p99_s']:.2f} | {itl} | {r['e2e_p50_s']:.1f} / {r['e2e_p99_s']:.1f} | "
            f"{acc} | {r['cached_tokens_later_turns_mean']} | "
            f"{r['conversations_on_one_replica']} | {per} |"
        )
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any]) -> Any:
    def draw(fig: Any) -> None:
        labels = list(report["results"])
        axes = fig.subplots(1, 3)
        panels = [
            ("output_tok_s", "output tok/s", 1.0),
            ("ttft_p50_s", "TTFT p50 (s)", 1.0),
            ("acceptance_rate", "acceptance (%)", 100.0),
        ]
        for ax, (key, label, scale) in zip(axes, panels, strict=True):
            ax.bar(range(len(labels)), [report["results"][c][key] * scale for c in labels])
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels([c.replace(" x ", "\nx ") for c in labels], fontsize=7)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, axis="y")
        fig.suptitle(f"{report['model']}: one process vs Ray Serve replicas, same cores")

    return draw
