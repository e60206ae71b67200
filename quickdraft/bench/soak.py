"""The soak benchmark (`quickdraft bench --soak`): nothing lost, nothing leaked, nothing changed.

Starts one `quickdraft serve` process (the server's own defaults: shared n-gram index on, tenant
scope) and sends `requests` chat requests, `concurrency` at a time, from a fixed plan (seeded):
greedy prompts of every prompt set with mixed `max_tokens`, half of them streamed; a share
`cancel` of the streams is dropped by the client after its first chunks, and a share `invalid`
is a broken request (a bad value, a wrong shape, a lone surrogate, an unknown model, truncated
JSON). Before the run every distinct (prompt, max_tokens) is sent alone: its single-request
output is the reference. Reported: requests lost (no final answer: a transport error, a stream
without its finish_reason and [DONE]), 5xx answers, invalid requests not answered 4xx, greedy
outputs that differ from their reference, the server's RSS after a warm-up round at the same
concurrency vs after the run, and the live sequences (/health running + waiting) once the run
has settled. Writes soak-<model>.{json,md,png} (the PNG: RSS and requests in flight over time).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from quickdraft.bench.report import RESULTS, machine, write
from quickdraft.bench.serving import _prompts, served
from quickdraft.config import DEFAULT_DTYPE, DEFAULT_MODEL, SpeculativeConfig


@dataclass(frozen=True, slots=True)
class SoakTest:
    model: str = DEFAULT_MODEL
    dtype: str = DEFAULT_DTYPE
    spec: SpeculativeConfig = field(default_factory=lambda: SpeculativeConfig(method="ngram"))
    requests: int = 1000
    concurrency: int = 16
    max_tokens: tuple[int, ...] = (8, 32, 96)  # mixed lengths, drawn per request
    prompts: int = 12  # distinct prompts (each has a reference output per max_tokens)
    cancel: float = 0.10  # share of requests the client drops mid-stream
    invalid: float = 0.05  # share of broken requests
    seed: int = 0
    threads: int | None = None
    start_timeout_s: float = 3600.0
    out_dir: Path = RESULTS
    device: str = "auto"  # the server's --device


@dataclass(frozen=True, slots=True)
class Planned:
    kind: str  # "greedy" | "cancel" | "invalid"
    prompt: str
    max_tokens: int
    stream: bool
    broken: int = 0  # which INVALID body (kind "invalid")


def invalid_body(model: str, which: int) -> bytes:
    """One of five broken requests, each a 4xx."""
    chat = [{"role": "user", "content": "hi"}]
    bodies: list[Any] = [
        {"model": model, "messages": chat, "temperature": 7},
        {"model": model, "messages": [123]},
        {"model": model, "messages": [{"role": "user", "content": "\ud800"}]},
        {"model": "no-such-model", "messages": chat},
    ]
    if which < len(bodies):
        return json.dumps(bodies[which]).encode()
    return b'{"model": "' + model.encode() + b'", "messages": [{"role": '  # truncated JSON


def plan(t: SoakTest) -> list[Planned]:
    rng = random.Random(t.seed)
    prompts = _prompts(t.prompts)
    out = []
    for _ in range(t.requests):
        roll = rng.random()
        kind = "invalid" if roll < t.invalid else "cancel" if roll < t.invalid + t.cancel else ""
        prompt, max_tokens = rng.choice(prompts), rng.choice(t.max_tokens)
        stream = kind == "cancel" or rng.random() < 0.5
        out.append(Planned(kind or "greedy", prompt, max_tokens, stream, rng.randrange(5)))
    return out


@dataclass(slots=True)
class Outcome:
    status: int = 0
    text: str = ""
    finish: str | None = None
    lost: str | None = None  # why no final answer arrived
    dropped: bool = False  # the client closed the stream before its end (kind "cancel")


async def send(client: httpx.AsyncClient, model: str, p: Planned, rng: random.Random) -> Outcome:
    out = Outcome()
    headers = {"Content-Type": "application/json"}
    if p.kind == "invalid":
        r = await client.post(
            "/v1/chat/completions", content=invalid_body(model, p.broken), headers=headers
        )
        out.status = r.status_code
        return out
    body = {
        "model": model,
        "messages": [{"role": "user", "content": p.prompt}],
        "max_tokens": p.max_tokens,
        "temperature": 0,
        "stream": p.stream,
    }
    if not p.stream:
        r = await client.post("/v1/chat/completions", json=body)
        out.status = r.status_code
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            out.text, out.finish = choice["message"]["content"], choice["finish_reason"]
        return out
    drop_after = rng.randint(1, 3) if p.kind == "cancel" else None
    chunks, done = 0, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:  # in-band: the request failed on the server's side
                out.status, out.lost = 500, f"in-band error {chunk['error'].get('code')}"
                return out
            if chunk["choices"]:
                out.text += chunk["choices"][0]["delta"].get("content") or ""
                out.finish = chunk["choices"][0]["finish_reason"] or out.finish
            chunks += 1
            if drop_after is not None and chunks > drop_after:
                out.dropped = True
                return out  # leaving the block closes the connection mid-stream
    if not done or out.finish is None:
        out.lost = "stream ended without finish_reason and [DONE]"
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run_plan(
    url: str, model: str, items: list[Planned], conc: int, seed: int, pid: int | None = None
) -> tuple[list[Outcome], list[tuple[float, float, int]]]:
    """Every item, `conc` at a time; with `pid`, the server's RSS sampled every 0.5 s."""
    outcomes: list[Outcome] = [Outcome() for _ in items]
    samples: list[tuple[float, float, int]] = []  # (s since start, RSS MB, in flight)
    queue = list(enumerate(items))
    queue.reverse()
    in_flight = 0
    t0 = time.perf_counter()
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=conc + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def worker(wid: int) -> None:
            nonlocal in_flight
            rng = random.Random(seed * 1000 + wid)
            while queue:
                idx, p = queue.pop()
                in_flight += 1
                try:
                    outcomes[idx] = await send(client, model, p, rng)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                    outcomes[idx] = Outcome(lost=f"{type(exc).__name__}: {exc}")
                finally:
                    in_flight -= 1

        async def sampler() -> None:
            while pid is not None:
                samples.append((time.perf_counter() - t0, rss_mb(pid), in_flight))
                await asyncio.sleep(0.5)

        watch = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(w) for w in range(conc)))
        watch.cancel()
    return outcomes, samples


def settle(url: str, limit_s: float = 60.0) -> dict[str, int]:
    """/health's running + waiting once both are 0, or as they are at `limit_s`."""
    deadline = time.monotonic() + limit_s
    while True:
        h = httpx.get(url + "/health", timeout=10).json()
        if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
            return {"running": h["running"], "waiting": h["waiting"]}
        time.sleep(0.2)


def server_cmd(t: SoakTest, port: int, token: str, settings: Path) -> list[str]:
    cmd = [sys.executable, "-m", "quickdraft", "serve", t.model, "--dtype", t.dtype]
    cmd += ["--device", t.device]
    # one argument: a token that starts with "-" (token_urlsafe draws them) is not an option
    cmd += ["--port", str(port), f"--admin-token={token}", "--settings", str(settings)]
    cmd += ["--speculative-method", t.spec.method]
    cmd += ["--num-draft-tokens", str(t.spec.num_draft_tokens)]
    if t.spec.draft_model:
        cmd += ["--draft-model", t.spec.draft_model]
        cmd += ["--draft-quantization", t.spec.draft_quantization]
    cmd += ["--max-concurrency", str(2 * t.concurrency + 2), "--log-level", "warning"]
    if t.threads:
        cmd += ["--threads", str(t.threads)]
    return cmd


def run_soak(t: SoakTest) -> dict[str, Any]:
    host = machine()
    items = plan(t)
    with served(partial(server_cmd, t), t.start_timeout_s, "soak") as server:
        url = server.url
        keys = sorted({(p.prompt, p.max_tokens) for p in items if p.kind == "greedy"})
        singles = [Planned("greedy", prompt, n, False) for prompt, n in keys]
        t0 = time.perf_counter()
        refs, _ = asyncio.run(run_plan(url, t.model, singles, 1, t.seed))
        ref_s = time.perf_counter() - t0
        reference = {k: o.text for k, o in zip(keys, refs, strict=True)}
        warm = [
            Planned("greedy", p.prompt, p.max_tokens, p.stream) for p in items[: 2 * t.concurrency]
        ]
        asyncio.run(run_plan(url, t.model, warm, t.concurrency, t.seed))
        settle(url)
        rss_before = rss_mb(server.proc.pid)
        t0 = time.perf_counter()
        outcomes, samples = asyncio.run(
            run_plan(url, t.model, items, t.concurrency, t.seed, server.proc.pid)
        )
        wall = time.perf_counter() - t0
        live = settle(url)
        rss_after = rss_mb(server.proc.pid)
    ref_failed = [o for o in refs if o.status != 200 or o.lost]
    report = {
        "bench": "soak",
        "model": t.model,
        "dtype": t.dtype,
        "speculation": asdict(t.spec),
        "config": {k: v for k, v in asdict(t).items() if k not in ("spec", "out_dir")},
        "machine": host,
        "results": summarize(items, outcomes, reference)
        | {
            "references": len(keys),
            "references_failed": len(ref_failed),
            "reference_s": round(ref_s, 1),
            "wall_s": round(wall, 1),
            "rss_mb_after_warmup": round(rss_before, 1),
            "rss_mb_after_run": round(rss_after, 1),
            "rss_mb_peak": round(max((s[1] for s in samples), default=rss_after), 1),
            "rss_growth_mb": round(rss_after - rss_before, 1),
            "live_sequences_after": live,
        },
        "samples": [[round(s, 2), round(r, 1), n] for s, r, n in samples],
    }
    write(f"soak-{Path(t.model).name}", report, markdown(report), _plot(report), t.out_dir)
    return report


def summarize(
    items: list[Planned], outcomes: list[Outcome], reference: dict[tuple[str, int], str]
) -> dict[str, Any]:
    kinds = {k: sum(p.kind == k for p in items) for k in ("greedy", "cancel", "invalid")}
    lost = [o.lost for o in outcomes if o.lost]
    greedy = [(p, o) for p, o in zip(items, outcomes, strict=True) if p.kind == "greedy"]
    mismatched = [
        p for p, o in greedy if o.status == 200 and o.text != reference[(p.prompt, p.max_tokens)]
    ]
    invalid = [o for p, o in zip(items, outcomes, strict=True) if p.kind == "invalid"]
    return {
        "requests": len(items),
        "by_kind": kinds,
        "lost": len(lost),
        "lost_reasons": sorted(set(lost))[:10],
        "status_5xx": sum(o.status >= 500 for o in outcomes),
        "greedy_not_200": sum(o.status != 200 for _, o in greedy),
        "invalid_not_4xx": sum(not 400 <= o.status < 500 for o in invalid),
        "greedy_mismatched": len(mismatched),
        "greedy_checked": len(greedy),
        "dropped_mid_stream": sum(o.dropped for o in outcomes),
        "output_chars": sum(len(o.text) for _, o in greedy),
    }


def markdown(report: dict[str, Any]) -> str:
    r, c = report["results"], report["config"]
    spec = report["speculation"]
    live = r["live_sequences_after"]
    rows = [
        (
            "requests (greedy / cancelled / invalid)",
            f"{r['requests']} ({r['by_kind']['greedy']} / {r['by_kind']['cancel']} / "
            f"{r['by_kind']['invalid']})",
        ),
        ("streams dropped by the client mid-stream", r["dropped_mid_stream"]),
        ("lost", r["lost"]),
        ("5xx answers", r["status_5xx"]),
        ("invalid requests not answered 4xx", r["invalid_not_4xx"]),
        (
            "greedy outputs != single-request output",
            f"{r['greedy_mismatched']} of {r['greedy_checked']}",
        ),
        (
            "RSS after warm-up -> after run (peak)",
            f"{r['rss_mb_after_warmup']} -> {r['rss_mb_after_run']} MB ({r['rss_mb_peak']} MB), "
            f"growth {r['rss_growth_mb']} MB",
        ),
        ("live sequences after the run", f"running {live['running']}, waiting {live['waiting']}"),
        ("wall time of the run", f"{r['wall_s']} s"),
    ]
    lines = [
        f"{report['model']} {report['dtype']}, speculation {spec['method']}, concurrency "
        f"{c['concurrency']}, max_tokens from {c['max_tokens']}, {c['prompts']} prompts, "
        f"seed {c['seed']}",
        "",
        "| check | result |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
    ]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any]) -> Callable[[Any], None]:
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        ts = [s[0] for s in report["samples"]]
        ax.plot(ts, [s[1] for s in report["samples"]], label="server RSS (MB)")
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("RSS (MB)")
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.plot(ts, [s[2] for s in report["samples"]], color="tab:orange", alpha=0.6)
        twin.set_ylabel("requests in flight")
        ax.set_title(f"{report['model']}: soak, RSS (blue) and requests in flight (orange)")

    return draw
