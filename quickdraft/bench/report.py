"""What every benchmark records beside its figures, and how it writes them.

`machine()` is the one description of the host a figure was measured on (CPU model and the ISA
flags the kernels dispatch on, threads, torch, commit, uncommitted package files); `write()`
puts a report into `<out>/<name>.json` + `.md` + `.png` and prints the JSON as the last line,
so every benchmark leaves the same three files and a script can read the last line. Used by
`quickdraft bench` (speculative.py, serving.py here) and by the scripts in bench/.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from quickdraft.kernels.build import cpu_id, isa

RESULTS = Path("bench/results")  # relative to where a benchmark is run: the checkout's root


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu() -> dict[str, Any] | None:
    """The GPU torch sees (name, memory, driver, CUDA), or None."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    driver = None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "driver": driver,
        "cuda": torch.version.cuda,
    }


def machine() -> dict[str, Any]:
    """The host and code a figure comes from."""
    changed = _git("status", "--porcelain", "--untracked-files=all", "quickdraft")
    return {
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),  # family.model.stepping
        "isa": isa(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": gpu(),
        "commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        # package files that differ from that commit: the measured code is not the committed one
        "uncommitted": changed.splitlines(),
    }


def read_bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Best-of-N DRAM read bandwidth: a sum over a buffer far larger than the caches."""
    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best / 1e9


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def bars(
    ax: Any, title: str, ylabel: str, groups: Sequence[str], series: dict[str, Sequence[float]]
) -> None:
    """Grouped bars on one matplotlib axes: one bar per series in each group."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], list(values), width, label=label)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)


def bar_chart(
    title: str, ylabel: str, groups: Sequence[str], series: dict[str, Sequence[float]]
) -> Callable[[Any], None]:
    """A figure of one grouped bar chart (`bars`), for `write(plot=...)`."""
    return lambda fig: bars(fig.subplots(), title, ylabel, groups, series)


def write(
    name: str,
    report: dict[str, Any],
    markdown: str,
    plot: Callable[[Any], None],
    out_dir: Path = RESULTS,
    figsize: tuple[float, float] = (9, 4),
) -> None:
    """`out_dir/name.{json,md,png}`; prints the markdown, then the JSON on one line as the
    last line. A benchmark records `machine()` in `report["machine"]` when it starts (the
    code it ran is then the code recorded); one that did not gets the host as it is now.
    `plot(fig)` draws on a fresh matplotlib figure (`bar_chart` makes one such function)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report.setdefault("machine", machine())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    cpu = f"{m['cpu']}, {m['cpu_id']}" if m.get("cpu_id") else m["cpu"]
    host = f"\n{cpu} ({' '.join(m['isa']) or 'no listed ISA flags'}), commit {m['commit']}\n"
    if m.get("gpu"):
        g = m["gpu"]
        host += (
            f"GPU: {g['name']} ({g['memory_gib']} GiB), driver {g['driver']}, CUDA {g['cuda']}\n"
        )
    (out_dir / f"{name}.md").write_text(markdown + host)
    fig = plt.figure(figsize=figsize)
    plot(fig)
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}.png", dpi=100)
    plt.close(fig)
    print(markdown + host + "\n" + json.dumps(report), flush=True)
