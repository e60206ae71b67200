"""Fixed-k acceptance and tok/s of none, n-gram and a trained drafter on SmolLM2 (code and prose
bench prompts, greedy, cost model off): `python bench/dflash_fixed_k.py DRAFTER_DIR [METHOD K]`,
METHOD dflash (default, k 7) or mtp (a `train-drafter --kind mtp` head)."""

import sys
import time

import torch

from quickdraft.bench.speculative import bench_sets
from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.loading import load
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation

torch.set_num_threads(2)
method = sys.argv[2] if len(sys.argv) > 2 else "dflash"
k = int(sys.argv[3]) if len(sys.argv) > 3 else 7
lm = load("smollm2-135m", "gguf", progress=False)
sets = bench_sets()
for name, cfg in [
    ("none", None),
    ("ngram", SpeculativeConfig(method="ngram", num_draft_tokens=k, adaptive=False)),
    (
        method,
        SpeculativeConfig(
            method=method, draft_model=sys.argv[1], num_draft_tokens=k, adaptive=False
        ),
    ),
]:
    spec = None if cfg is None else make_speculation(lm, cfg)
    for s in ("code", "prose"):
        toks = secs = acc = cyc = 0
        for p in sets[s][:3]:
            ids = lm.tokenizer.encode_chat([{"role": "user", "content": p}])
            req = lm.new_request(ids, SamplingParams(max_tokens=128))
            t = time.perf_counter()
            for _ in stream(lm, req, spec):
                pass
            secs += time.perf_counter() - t
            toks += len(req.output_ids)
            acc += req.spec.accepted
            cyc += req.spec.cycles
        print(
            name,
            s,
            f"tok/s {toks / secs:.1f}",
            f"AL {(acc + cyc) / max(cyc, 1):.2f}" if cyc else "",
        )
