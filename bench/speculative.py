"""Speculative decoding A/B (see quickdraft/benchmark.py); JSON as the last line.

python bench/speculative.py --tokens 128           # every prompt; references on 2 per set
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quickdraft.benchmark import run
from quickdraft.config import DEFAULT_DRAFT_QUANTIZATION, QUANTIZATIONS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--per-set", type=int, default=None, help="default: all prompts")
    ap.add_argument("--reference-per-set", type=int, default=2)
    ap.add_argument("--sets", nargs="*", default=None)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument(
        "--draft-quantization", default=DEFAULT_DRAFT_QUANTIZATION, choices=QUANTIZATIONS
    )
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    report = run(
        a.target,
        a.draft,
        a.dtype,
        a.tokens,
        a.per_set,
        a.sets,
        a.k,
        not a.no_hf,
        Path(a.out),
        a.draft_quantization,
        a.reference_per_set,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
