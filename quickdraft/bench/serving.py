"""The HTTP serving benchmark (`quickdraft bench --serve`, bench/serve.py).

Starts one `quickdraft serve` process, then at each concurrency level runs speculation off, then
on (switched through the admin API, so both run in the same process on the same weights),
`rounds` times in alternation (a level reports each round's on / off ratio and their median:
these shared machines drift by 10-20 % within a minute), sending streaming chat requests and
measuring what a client sees: output tok/s (all completion tokens / wall time of the level),
TTFT p50/p99, inter-token latency (per request: (last token - first token) / (tokens - 1)),
end-to-end latency p50/p99, and the acceptance the responses report. Warm-up requests after
each switch are excluded. Same prompts (a round-robin mix of the code / prose / json /
repetitive sets), greedy, in both phases. Writes serve-<model>.{json,md,png} and returns the
report.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from quickdraft.bench.report import RESULTS, machine, write
from quickdraft.bench.speculative import prompt_sets
from quickdraft.config import BENCH_MAX_TOKENS, DEFAULT_DTYPE, DEFAULT_MODEL, SpeculativeConfig

PHASES = ("off", "on")


@dataclass(frozen=True, slots=True)
class LoadTest:
    model: str = DEFAULT_MODEL
    dtype: str = DEFAULT_DTYPE
    spec: SpeculativeConfig = field(default_factory=lambda: SpeculativeConfig(method="ngram"))
    concurrency: tuple[int, ...] = (1, 4, 8)
    requests: int = 8  # per concurrency level, phase and round
    rounds: int = 1  # off / on pairs per level, alternating
    max_tokens: int = BENCH_MAX_TOKENS
    threads: int | None = None  # the server's torch threads (None: torch's default)
    start_timeout_s: float = 3600.0  # first use of a model may download + convert it
    out_dir: Path = RESULTS
    device: str = "auto"  # the server's --device

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


@dataclass(slots=True)
class Sample:
    ttft: float
    itl: float | None  # mean inter-token latency of this request (None: < 2 tokens)
    e2e: float
    tokens: int
    spec: dict[str, Any]


def _prompts(n: int) -> list[str]:
    sets = list(prompt_sets().values())
    mixed = [s[i] for i in range(max(len(s) for s in sets)) for s in sets if i < len(s)]
    return [mixed[i % len(mixed)] for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _server_cmd(t: LoadTest, port: int, token: str, settings: Path) -> list[str]:
    cmd = [sys.executable, "-m", "quickdraft", "serve", t.model, "--dtype", t.dtype]
    cmd += ["--device", t.device]
    # one argument: a token that starts with "-" (token_urlsafe draws them) is not an option
    cmd += ["--port", str(port), f"--admin-token={token}", "--settings", str(settings)]
    cmd += [
        "--speculative-method",
        t.spec.method,
        "--num-draft-tokens",
        str(t.spec.num_draft_tokens),
    ]
    cmd += ["--ngram-min", str(t.spec.ngram_min), "--ngram-max", str(t.spec.ngram_max)]
    # this bench sends the same prompts again (warm-up, every level): the n-gram drafter's
    # shared index of finished outputs would replay them, which no real workload gets
    cmd += ["--ngram-shared-tokens", "0"]
    cmd += ["--max-concurrency", str(2 * max(t.concurrency) + 2), "--log-level", "warning"]
    if t.spec.draft_model:
        cmd += ["--draft-model", t.spec.draft_model]
        cmd += ["--draft-quantization", t.spec.draft_quantization]
    if not t.spec.adaptive:
        cmd += ["--no-adaptive"]
    if t.threads:
        cmd += ["--threads", str(t.threads)]
    return cmd


@dataclass(frozen=True, slots=True)
class Served:
    url: str  # http://127.0.0.1:<port>
    token: str  # its admin token
    proc: subprocess.Popen[bytes]


@contextmanager
def served(
    command: Callable[[int, str, Path], list[str]], start_timeout_s: float, name: str
) -> Iterator[Served]:
    """A `quickdraft serve` subprocess, `command(port, admin_token, settings_file)`, on a free
    loopback port with its log and settings in a fresh temp dir, yielded once healthy; if the
    body fails, the log's tail goes to stderr; terminated (killed after 30 s) at the end, and
    its temp dir removed."""
    port, token = _free_port(), secrets.token_urlsafe(12)
    url = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix=f"quickdraft-{name}-"))
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command(port, token, workdir / "settings.json"),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        _wait_healthy(url, proc, start_timeout_s)
        yield Served(url, token, proc)
    except BaseException:
        sys.stderr.write(f"server log ({log_path}):\n{log_path.read_text()[-4000:]}\n")
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)  # its settings hold the admin token


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during start-up (code {proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                usage, spec = chunk["usage"], chunk.get("speculative") or {}
    done = time.perf_counter()
    n = usage.get("completion_tokens", 0)
    first, last = first or done, last or done
    itl = (last - first) / (n - 1) if n > 1 else None
    return Sample(first - sent, itl, done - sent, n, spec)


async def _level(url: str, model: str, prompts: list[str], conc: int, max_tokens: int) -> Any:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    samples: list[Sample] = []
    timeout = httpx.Timeout(3600.0, connect=10.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:

        async def worker() -> None:
            while not queue.empty():
                samples.append(await _one(client, model, queue.get_nowait(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    return samples, wall


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _summary(samples: list[Sample], wall: float) -> dict[str, Any]:
    tokens = sum(s.tokens for s in samples)
    ttft, e2e = [s.ttft for s in samples], [s.e2e for s in samples]
    itl = [s.itl for s in samples if s.itl is not None]
    drafted = sum(s.spec.get("drafted", 0) for s in samples)
    accepted = sum(s.spec.get("accepted", 0) for s in samples)
    cycles = sum(s.spec.get("cycles", 0) for s in samples)
    return {
        "requests": len(samples),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 3),
        "ttft_p50_s": round(_pct(ttft, 0.5), 4),
        "ttft_p99_s": round(_pct(ttft, 0.99), 4),
        "itl_mean_s": round(statistics.fmean(itl), 5) if itl else None,
        "itl_p50_s": round(_pct(itl, 0.5), 5) if itl else None,
        "e2e_p50_s": round(_pct(e2e, 0.5), 3),
        "e2e_p99_s": round(_pct(e2e, 0.99), 3),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_acceptance_length": round(1 + accepted / cycles, 4) if cycles else 0.0,
    }


def _switch(url: str, token: str, model: str, on: bool) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    state = httpx.get(url + "/admin/api/state", headers=headers, timeout=30).json()
    settings = next(m for m in state["models"] if m["name"] == model)["settings"]
    r = httpx.put(
        f"{url}/admin/api/models/{quote(model, safe='')}",
        json={**settings, "enabled": on},
        headers=headers,
        timeout=1800,  # switching on may load the draft model
    )
    r.raise_for_status()


def run_load_test(t: LoadTest) -> dict[str, Any]:
    """Both phases at every level; writes serve-<model>.{json,md,png} in t.out_dir."""
    host = machine()  # before the server starts: the code it runs is the code recorded
    command = partial(_server_cmd, t)
    with served(command, t.start_timeout_s, "loadtest") as server:
        url, token = server.url, server.token
        prompts = _prompts(t.requests)
        results: dict[str, dict[str, Any]] = {phase: {} for phase in PHASES}
        ratios: dict[str, list[float]] = {}  # level -> on / off output tok/s of each round
        # off and on alternate per level and round (not one phase after the other): on a
        # shared machine load drifts over minutes, and each ratio should see the same
        # conditions on both sides
        for conc in t.concurrency:
            pooled: dict[str, tuple[list[Sample], float]] = {p: ([], 0.0) for p in PHASES}
            rates: dict[str, float] = {}
            for r in range(t.rounds):
                for phase in PHASES:
                    _switch(url, token, t.model, on=phase == "on")
                    # warm-up, excluded: kernels, allocator, (re)loaded draft model, this batch
                    asyncio.run(_level(url, t.model, prompts[:conc], conc, 8))
                    samples, wall = asyncio.run(_level(url, t.model, prompts, conc, t.max_tokens))
                    row = _summary(samples, wall)
                    rates[phase] = row["output_tok_s"]
                    got, walls = pooled[phase]
                    pooled[phase] = (got + samples, walls + wall)
                    where = f"{phase} c={conc} round {r + 1}"
                    print(f"[serve bench] {where}: {json.dumps(row)}", flush=True)
                ratios.setdefault(str(conc), []).append(round(rates["on"] / rates["off"], 3))
            for phase in PHASES:
                results[phase][str(conc)] = _summary(*pooled[phase])
    speedup = {c: round(statistics.median(r), 3) for c, r in ratios.items()}
    report = {
        "bench": "serve",
        "model": t.model,
        "dtype": t.dtype,
        "speculation": asdict(t.spec),
        "requests_per_level": t.requests,
        "rounds": t.rounds,
        "max_tokens": t.max_tokens,
        "machine": host,
        "results": results,
        "speedup_on_vs_off": speedup,  # the median of the rounds' ratios
        "round_ratios": ratios,
    }
    stem = f"serve-{Path(t.model).name}"  # not Path.with_suffix: names hold dots
    write(stem, report, markdown(report), _plot(report), t.out_dir, figsize=(13, 3.8))
    return report


def markdown(report: dict[str, Any]) -> str:
    spec = report["speculation"]
    what = spec["method"] + (f" ({spec['draft_model']})" if spec["method"] == "draft" else "")
    rounds = report.get("rounds", 1)
    per_round = report.get("round_ratios", {})
    lines = [
        f"{report['model']} {report['dtype']}, speculation {what} k <= {spec['num_draft_tokens']}"
        f", {report['requests_per_level']} requests/level, max_tokens {report['max_tokens']}, "
        "greedy, streamed over HTTP"
        + (
            f"; off and on alternated {rounds} times per level: figures over all rounds, the "
            "speedup the median of the rounds' ratios"
            if rounds > 1
            else ""
        ),
        "",
        "| concurrency | speculation | output tok/s | speedup | TTFT p50 / p99 s | ITL mean ms "
        "| e2e p50 / p99 s | acceptance | AL |" + (" per round |" if rounds > 1 else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if rounds > 1 else ""),
    ]
    for conc in report["results"]["off"]:
        for phase in PHASES:
            r = report["results"][phase][conc]
            speedup = report["speedup_on_vs_off"][conc] if phase == "on" else 1.0
            ratios = per_round.get(conc, []) if phase == "on" else []
            each = " / ".join(f"{x:.2f}" for x in ratios)  # the per-round column
            itl = "" if r["itl_mean_s"] is None else f"{1000 * r['itl_mean_s']:.1f}"
            acc = f"{100 * r['acceptance_rate']:.0f} %" if r["drafted"] else "-"
            al = r["mean_acceptance_length"] if r["drafted"] else "-"
            lines.append(
                f"| {conc} | {phase} | {r['output_tok_s']:.2f} | {speedup:.2f}x | "
                f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {itl} | "
                f"{r['e2e_p50_s']:.1f} / {r['e2e_p99_s']:.1f} | {acc} | {al} |"
                + (f" {each} |" if rounds > 1 else "")
            )
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any]) -> Callable[[Any], None]:
    def draw(fig: Any) -> None:
        levels = list(report["results"]["off"])
        axes = fig.subplots(1, 3)
        panels = [
            ("output_tok_s", "output tok/s", 1.0),
            ("ttft_p50_s", "TTFT p50 (s)", 1.0),
            ("itl_mean_s", "inter-token latency (ms)", 1000.0),
        ]
        for ax, (key, label, scale) in zip(axes, panels, strict=True):
            for phase in PHASES:
                ys = [(report["results"][phase][c][key] or 0) * scale for c in levels]
                ax.plot([int(c) for c in levels], ys, marker="o", label=f"speculation {phase}")
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_xticks([int(c) for c in levels])
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{report['model']} ({report['dtype']}): serving, speculation on vs off")

    return draw
