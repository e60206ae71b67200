"""Start-up of `quickdraft serve` with the default pair: the first start on a fresh machine (the
models downloaded, nothing converted yet) and the next one, each to a healthy server, with the
process's resident memory sampled all along (issue 22: peak RSS <= 1.5x the two GGUF files,
healthy <= 2 min after the download, a warm start in seconds).

A fresh QUICKDRAFT_HOME holds only the GGUF files (hard links to the ones already downloaded,
or copies) and a link to the built kernels, which scripts/setup.sh builds at install time; the
first start then converts the tokenizers, repacks the target, makes the draft's int4 copy and
times the cost tables, and the second start reuses all of it. Peak RSS is the kernel's VmHWM
of the server process; the trace samples VmRSS every --interval seconds. Writes
bench/results/<name>.{json,md,png} (RSS over time per start).

    python bench/startup.py                                  # the default pair
    python bench/startup.py --model smollm2-135m --no-draft --name startup-smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from quickdraft.bench.report import RESULTS, machine, table, write
from quickdraft.config import DEFAULT_DRAFTS, DEFAULT_MODEL, cache_dir
from quickdraft.hub import gguf_file


def status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def one_start(cmd: list[str], env: dict[str, str], port: int, args: Any) -> dict[str, Any]:
    """Start the server, sample its RSS until /health answers, stop it."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        t0, trace = time.monotonic(), []
        try:
            while True:
                elapsed = time.monotonic() - t0
                trace.append((round(elapsed, 2), status_kb(proc.pid, "VmRSS") / 1024))
                if healthy(port):
                    break
                if proc.poll() is not None or elapsed > args.timeout:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-3000:]
                    sys.exit(f"server did not come up:\n{tail}")
                time.sleep(args.interval)
            return {
                "healthy_s": round(time.monotonic() - t0, 2),
                "peak_rss_mb": round(status_kb(proc.pid, "VmHWM") / 1024, 1),
                "rss_at_health_mb": round(status_kb(proc.pid, "VmRSS") / 1024, 1),
                "trace": trace,
            }
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--no-draft", action="store_true", help="serve the model alone (n-gram)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--interval", type=float, default=0.25, help="RSS sampling period (s)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--name", default="startup")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    report: dict[str, Any] = {"bench": "startup", "machine": machine(), "model": args.model}
    models = [args.model]
    if not args.no_draft and args.model in DEFAULT_DRAFTS:
        models.append(DEFAULT_DRAFTS[args.model])
    cmd = [sys.executable, "-m", "quickdraft", "serve", args.model, "--port", str(args.port)]
    if args.no_draft:
        cmd += ["--speculative-method", "ngram"]
    report["command"] = " ".join(["quickdraft", *cmd[3:]])
    files = [gguf_file(m) for m in models]  # downloaded into the usual home first
    report["gguf_gb"] = round(sum(f.stat().st_size for f in files) / 1e9, 3)
    kernels = cache_dir() / "torch_extensions"
    with tempfile.TemporaryDirectory(prefix="qd-startup-") as tmp:
        fresh = Path(tmp)
        (fresh / "gguf").mkdir()
        for f in files:
            try:
                os.link(f, fresh / "gguf" / f.name)
            except OSError:  # another file system
                shutil.copy2(f, fresh / "gguf" / f.name)
        if kernels.is_dir():
            (fresh / "torch_extensions").symlink_to(kernels)
        env = {**os.environ, "QUICKDRAFT_HOME": str(fresh), "PYTHONUNBUFFERED": "1"}
        report["first"] = one_start(cmd, env, args.port, args)
        report["next"] = one_start(cmd, env, args.port, args)
    rows = [
        [
            start,
            report[start]["healthy_s"],
            report[start]["peak_rss_mb"],
            f"{report[start]['peak_rss_mb'] / 1e3 / report['gguf_gb']:.2f}x",
            report[start]["rss_at_health_mb"],
        ]
        for start in ("first", "next")
    ]
    md = (
        f"`{report['command']}` under a fresh QUICKDRAFT_HOME holding {', '.join(models)} "
        f"({report['gguf_gb']} GB of GGUF files) and the built kernels\n\n"
        + table(
            ["start", "healthy (s)", "peak RSS (MB)", "peak / files", "RSS at health (MB)"], rows
        )
    )

    def plot(fig: Any) -> None:
        ax = fig.subplots()
        for start in ("first", "next"):
            t, mb = zip(*report[start]["trace"], strict=True)
            ax.plot(t, mb, label=f"{start} start")
        ax.axhline(1.5 * report["gguf_gb"] * 1e3, ls="--", c="grey", label="1.5x the GGUF files")
        ax.set(xlabel="seconds from launch", ylabel="RSS (MB)", title="quickdraft serve start-up")
        ax.legend()

    write(args.name, report, md, plot, args.out)


if __name__ == "__main__":
    main()
