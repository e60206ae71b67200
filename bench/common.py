"""Helpers shared by the benchmarks: machine facts, read bandwidth, JSON output."""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def read_bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Best-of-N DRAM read bandwidth: sum over a buffer far larger than the caches."""
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


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": commit(),
    }


def emit(name: str, result: dict[str, Any]) -> None:
    """Write bench/results/<name>.json and print the JSON as the last line."""
    RESULTS.mkdir(exist_ok=True)
    text = json.dumps(result, indent=None, sort_keys=False)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(text)
