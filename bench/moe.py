"""Sparse MoE decode and prefill against llama.cpp and ik_llama.cpp, on the same Q4_K_M files.

No MoE weights exist offline, so the files are random weights at the real per-layer widths of
Qwen3.6-35B-A3B (`qwen35moe`: hybrid Gated DeltaNet + gated attention, 256 experts top 8 + a
shared expert), Qwen3-30B-A3B (`qwen3moe`: 128 experts top 8), gpt-oss-20b (`gpt-oss`: 32
experts top 4 with biases, sinks, alternating windows) and Gemma-4-26B-A4B (`gemma4`: a GeGLU
MLP beside 128 experts top 8, local and global layers of other shapes), with layers, experts and the
vocabulary cut so that the files fit (stated in the report). Each is written as llama.cpp's
converter lays it out (hub/gguf_write.py), F32, then quantized by llama.cpp's own quantizer
(the `peers` extra) to Q4_K_M, gpt-oss to MXFP4_MOE (its uploads' type: MXFP4 experts), so
every engine reads the same bytes in the same block formats.

Measured in interleaved rounds (these machines are noisy), threads fixed for every engine:
  quickdraft     the model loaded as a user's GGUF is (`--dtype gguf`), forwards timed as
                 llama-bench times them: tg = 128 one-row greedy steps from an empty cache,
                 pp512 / pp5 = one forward of 512 / 5 rows from an empty cache; also a 5-row
                 forward against a one-row step at the same context (a verify's cost)
  llama.cpp      mainline's llama-bench (--llama-bench; built from the llama.cpp source that
                 llama-cpp-python vendors)
  ik_llama.cpp   its llama-bench with -fmoe 1 -rtr 1 (--ik-bench)
`--rows`: a forward's cost by rows 1..8 (a decode step, then verifies of k = 1..7) from an
empty cache, ours against each peer's `llama-bench -p N` on the same file (ms = N / its tok/s),
with ours also at context 64, in interleaved rounds.
`--arch gemma4-e2b` (with --pairs): Gemma 4 E2B whole, dense, beside them (random Q4_K_M blocks
streamed as quickdraft/bench/shapes.py `write_gemma4_e2b` writes them, typed as llama.cpp's
quantizer types a tied Gemma 4).
`--pairs N`: decode and pp512 in N back-to-back pairs (ours, then each peer's `llama-bench -p 512`,
the order swapped every pair), the ratio taken within each pair and its median reported: two
runs seconds apart share the host's phase far more often than two a minute apart.
`--full --arch qwen35moe` (or qwen3moe): the full-size file of that shape (every layer, expert
and id: Qwen3.6-35B-A3B's 20 GiB, Qwen3-30B-A3B's 17 GiB), random Q4_K_M blocks streamed to
disk, then each engine alone in its own process: our first start once, then --rounds rounds of
our second start and each peer in swapped order, the median of the rounds' ratios reported.
`--full --mtp-cuts N ...`: MTP's costs on the full-size qwen35moe file instead (a forward by
rows 1..8 at context 64 beside each peer's `llama-bench -p N`, the file's nextn head one chained
step with every id and cut to the first N ids, `--draft-vocab`), and the speedup by k projected
at the acceptance of bench/hybrid.py's staged qwen35moe run (the file's head is random).
Weights streamed per decoded token: every tensor's bytes, the routed experts' times top_k / E,
one row of the embedding table; GB/s = that times tok/s. The markdown has the row
`decode vs best peer | N.NNx`.

    .venv/bin/python bench/moe.py --files /tmp/moe-files \
        --llama-bench /work/peers/llama.cpp/build/bin/llama-bench \
        --ik-bench /work/peers/ik/build/bin/llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from quickdraft.bench.peers import llama_cpp_quantize
from quickdraft.bench.report import bar_chart, machine, read_bandwidth_gbs, table, write
from quickdraft.bench.shapes import GEMMA4_E2B, MOE_CUTS, MOE_REAL, init_, write_gemma4_e2b
from quickdraft.bench.speculative import forward_seconds
from quickdraft.config import ModelConfig
from quickdraft.hub.convert import convert_gguf
from quickdraft.hub.gguf_write import (
    llama_cpp_tensors,
    q4_k_m_type,
    random_chunks,
    write_gguf,
    write_gguf_streamed,
)
from quickdraft.kernels.linear_gguf import FORMATS
from quickdraft.loading import load
from quickdraft.memory import freeze_loaded
from quickdraft.models.families.gemma4 import Gemma4LM
from quickdraft.models.families.gemma4_config import Gemma4Config
from quickdraft.models.families.gpt_oss import GptOssConfig, GptOssLM
from quickdraft.models.families.hybrid_config import HybridConfig
from quickdraft.models.families.llama import CausalLM
from quickdraft.models.families.qwen3_next import HybridLM
from quickdraft.models.formats.packed_copy import PACKED_NAME
from quickdraft.models.heads.mtp import MTPHead, hybrid_mtp_parts

# quickdraft/bench/shapes.py; Gemma 4 E2B (dense, whole) beside the MoE files for --pairs
REAL: dict[str, dict[str, Any]] = {**MOE_REAL, "gemma4-e2b": GEMMA4_E2B}
CUTS: dict[str, dict[str, Any]] = {**MOE_CUTS, "gemma4-e2b": {}}


def config(arch: str) -> dict[str, Any]:
    return {**REAL[arch], **CUTS[arch]}


# the file type each model's uploads use: gpt-oss GGUFs keep their experts in MXFP4
QTYPES = {"gpt-oss": "MXFP4_MOE"}


def write_file(arch: str, directory: Path) -> Path:
    """The random-weight file of `arch` in its QTYPES file type, Q4_K_M by default (kept in
    `directory` for later runs)."""
    if arch == "gemma4-e2b":  # whole: random blocks, streamed
        return write_gemma4_e2b(directory)
    qtype = QTYPES.get(arch, "Q4_K_M")
    path = directory / f"{arch}-{qtype}.gguf"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    cfg = config(arch)
    model: torch.nn.Module
    if arch == "qwen35moe":
        model = HybridLM(HybridConfig.from_dict(cfg), torch.bfloat16)
    elif arch == "gpt-oss":
        model = GptOssLM(GptOssConfig.from_dict(cfg), torch.bfloat16)
    elif arch == "gemma4":
        model = Gemma4LM(Gemma4Config.from_dict(cfg), torch.bfloat16)
    else:
        model = CausalLM(ModelConfig.from_dict(cfg), torch.bfloat16)
    init_(model, 0, 1.0)
    tensors = llama_cpp_tensors(model.state_dict(), arch, cfg)
    del model
    source = directory / f"{arch}-F32.gguf"
    write_gguf(source, arch, cfg, tensors, "F32")
    del tensors
    llama_cpp_quantize(source, path, qtype, torch.get_num_threads())
    source.unlink()
    return path


def full_plan(arch: str) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], str]]]:
    """The real config of `arch` (qwen35moe with its MTP block) and every tensor of its Q4_K_M
    file: names and shapes from our model built on the meta device, laid out by llama.cpp's
    converter (hub/gguf_write.py), types by `q4_k_m_type`."""
    cfg = dict(REAL[arch])
    meta = torch.device("meta")
    if arch == "qwen35moe":
        cfg["mtp_num_hidden_layers"] = 1
        hcfg = HybridConfig.from_dict(cfg)
        model: torch.nn.Module = HybridLM(hcfg, torch.bfloat16, meta)
        parts = hybrid_mtp_parts(hcfg, torch.bfloat16, meta)
        head = MTPHead(
            parts, hcfg.hidden_size, lambda ids: ids, torch.empty(0), torch.bfloat16, meta
        )
        state = model.state_dict() | {f"mtp.{k}": v for k, v in head.state_dict().items()}
    else:
        model = CausalLM(ModelConfig.from_dict(cfg), torch.bfloat16, meta)
        state = model.state_dict()
    tensors = llama_cpp_tensors(state, arch, cfg)
    blocks = cfg["num_hidden_layers"] + (1 if arch == "qwen35moe" else 0)
    plan = {n: (tuple(t.shape), q4_k_m_type(n, tuple(t.shape), blocks)) for n, t in tensors.items()}
    return cfg, plan


def write_full(arch: str, directory: Path) -> Path:
    """The full-size random-weight Q4_K_M file of `arch`, streamed (never held in memory)."""
    path = directory / f"{arch}-full-Q4_K_M.gguf"
    if path.exists():
        return path
    cfg, plan = full_plan(arch)
    need = sum(
        int(np.prod(s)) // FORMATS[q].block * FORMATS[q].block_bytes
        if q != "F32"
        else 4 * int(np.prod(s))
        for s, q in plan.values()
    )
    free = shutil.disk_usage(directory).free
    if need > free - (2 << 30):
        raise SystemExit(f"{path}: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    write_gguf_streamed(tmp, arch, cfg, plan, random_chunks)
    tmp.rename(path)
    return path


def streamed_bytes(path: Path, cfg: dict[str, Any]) -> tuple[float, dict[str, int]]:
    """Weight bytes one decoded token reads (without the MTP block, which plain decoding
    does not run), and the file's tensors per block format. A file without `output.weight`
    (Gemma 4: tied embeddings) scores every token against the whole embedding table."""
    total = 0.0
    formats: Counter[str] = Counter()
    tensors = GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    for t in tensors:
        formats[t.tensor_type.name] += 1
        if t.name.startswith(f"blk.{cfg['num_hidden_layers']}."):  # the MTP block: not read
            continue
        n = float(t.n_bytes)
        if "_exps." in t.name:
            n *= cfg["num_experts_per_tok"] / cfg["num_experts"]
        elif t.name == "token_embd.weight":
            n *= (1 if tied else 0) + 1 / cfg["vocab_size"]  # the head, and the token's row
        elif t.name == "per_layer_token_embd.weight":  # Gemma 4's per-layer table: one row
            n /= cfg["vocab_size_per_layer_input"]
        total += n
    return total, dict(formats.most_common())


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


class Ours:
    """quickdraft on the file, as `quickdraft serve FILE` loads it (--dtype gguf)."""

    def __init__(self, path: Path, work: Path) -> None:
        model_dir = work / f"{path.stem}-model"
        if not model_dir.exists():
            convert_gguf(path, model_dir, "gguf", progress=False)
        t = time.perf_counter()
        lm = load(str(model_dir), "gguf", progress=False)
        self.model: Any = lm.model
        self.eos_ids = lm.eos_ids
        del lm
        self.load_s = time.perf_counter() - t
        freeze_loaded()  # as `quickdraft serve` does after loading
        self.vocab = self.model.config.vocab_size
        self.rss_mb = _rss_mb()

    def forward_s(self, rows: int, context: int = 0) -> float:
        return forward_seconds(self.model, rows, context, reps=1, vocab=self.vocab)

    def decode_s(self, tokens: int) -> list[float]:
        """Per-step seconds of `tokens` greedy one-row steps from an empty cache."""
        cache = self.model.new_cache(tokens + 8)
        token = torch.tensor([1])
        steps = []
        for i in range(tokens):
            t = time.perf_counter()
            out = self.model(token, [cache], [1])
            cache.commit(i + 1)
            token = out.logits[-1:].argmax(-1)
            steps.append(time.perf_counter() - t)
        return steps

    def round(self, tokens: int) -> dict[str, float]:
        self.forward_s(8)  # warm
        steps = self.decode_s(tokens)
        pp512 = min(self.forward_s(512) for _ in range(2))
        pp5 = min(self.forward_s(5) for _ in range(5))
        one = [self.forward_s(1, context=64) for _ in range(5)]
        five = [self.forward_s(5, context=64) for _ in range(5)]
        return {
            "decode_tps": round(len(steps) / sum(steps), 2),
            "pp512_tps": round(512 / pp512, 1),
            "pp5_tps": round(5 / pp5, 1),
            "step_ms_at_64": _ms(one),
            "rows5_ms_at_64": _ms(five),
        }


def _rss_mb() -> float:
    """Resident memory in MiB (the report's `*_mb` fields are MiB, as ru_maxrss / 1024)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def llama_bench(
    binary: Path, path: Path, threads: int, tokens: int, extra: list[str], prompts: str = "512,5"
) -> dict[str, float]:
    """One llama-bench run (pp512, pp5, tg`tokens`, one repetition each) -> tok/s."""
    cmd = [str(binary), "-m", str(path), "-t", str(threads), "-p", prompts, "-n", str(tokens)]
    cmd += ["-r", "1", "-o", "json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    rows = json.loads(out.stdout)
    got: dict[str, float] = {}
    for r in rows:
        key = f"pp{r['n_prompt']}_tps" if r["n_prompt"] else "decode_tps"
        got[key] = round(float(r["avg_ts"]), 2)
    return got


def ours_once(path: Path, work: Path, tokens: int) -> dict[str, Any]:
    """One start of quickdraft on `path` in this process (the child `--ours` runs): load
    seconds, resident and peak memory, decode and pp512 tok/s."""
    import resource

    t = time.perf_counter()
    ours = Ours(path, work)
    start_s = time.perf_counter() - t  # conversion (first start) + load
    ours.forward_s(8)
    steps = ours.decode_s(tokens)
    pp512 = ours.forward_s(512)
    return {
        "start_s": round(start_s, 1),
        "rss_mb": ours.rss_mb,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "decode_tps": round(len(steps) / sum(steps), 2),
        "pp512_tps": round(512 / pp512, 1),
    }


def run_full(
    arch: str,
    work: Path,
    peers: dict[str, tuple[Path, list[str]]],
    threads: int,
    tokens: int,
    rounds: int,
) -> dict[str, Any]:
    """The full-size file: written (streamed), then each engine alone in its own process, so
    that the machine's memory holds one engine's weights at a time: quickdraft's first start
    (repack + packed copy; skipped where a run before left the copy), then `rounds` rounds of
    its second start (the packed copy) and each peer, the order swapped every round. Per
    engine the medians of its rounds; decode and pp512 against the best peer as the median of
    the rounds' ratios (a ratio within a round shares the host's phase)."""
    t = time.perf_counter()
    path = write_full(arch, work)
    written_s = time.perf_counter() - t
    cfg, _ = full_plan(arch)
    per_token, formats = streamed_bytes(path, cfg)
    out: dict[str, Any] = {
        "file_gib": round(path.stat().st_size / 2**30, 2),
        "write_s": round(written_s, 1),
        "tensors_by_format": formats,
        "weight_mb_per_token": round(per_token / 1e6, 1),
        "machine_memory_gib": round(
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1
        ),
        "rounds": rounds,
        "engines": {},
    }
    child = [sys.executable, __file__, "--ours", str(path), "--files", str(work)]
    child += ["--threads", str(threads), "--tokens", str(tokens)]

    def gbs(got: dict[str, Any]) -> dict[str, Any]:
        return {**got, "decode_gbs": round(got["decode_tps"] * per_token / 1e9, 1)}

    def ours() -> dict[str, Any]:
        run = subprocess.run(child, capture_output=True, text=True, timeout=3600)
        if run.returncode:
            return {"error": run.stderr[-2000:]}
        return gbs(json.loads(run.stdout.strip().splitlines()[-1]))

    def peer(name: str) -> dict[str, Any]:
        binary, extra = peers[name]
        try:
            return gbs(llama_bench(binary, path, threads, tokens, extra, prompts="512"))
        except subprocess.CalledProcessError as e:
            return {"error": (e.stderr or "")[-2000:]}

    if not (work / f"{path.stem}-model" / PACKED_NAME).exists():  # a run before left none
        out["engines"]["quickdraft first_start"] = ours()
    second = "quickdraft second_start"
    order = [second, *peers]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in order}
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            runs[name].append(ours() if name == second else peer(name))
    for name, got in runs.items():
        ok = [g for g in got if "error" not in g]
        if not ok:
            out["engines"][name] = got[-1]
            continue
        summary: dict[str, Any] = {
            k: statistics.median(g[k] for g in ok) for k in ok[0] if k != "peak_rss_mb"
        }
        if "peak_rss_mb" in ok[0]:
            summary["peak_rss_mb"] = max(g["peak_rss_mb"] for g in ok)
        summary["rounds"] = got
        if name in peers:
            summary["flags"] = peers[name][1]
        out["engines"][name] = summary
    ratios: dict[str, list[float]] = {"decode_tps": [], "pp512_tps": []}
    for r in range(rounds):
        mine = runs[second][r]
        theirs = [runs[p][r] for p in peers if "error" not in runs[p][r]]
        if "error" in mine or not theirs:
            continue
        for key, series in ratios.items():
            series.append(round(mine[key] / max(g[key] for g in theirs), 3))
    if ratios["decode_tps"]:
        out["vs_best_peer"] = {
            "decode_rounds": ratios["decode_tps"],
            "decode": statistics.median(ratios["decode_tps"]),
            "pp512_rounds": ratios["pp512_tps"],
            "pp512": statistics.median(ratios["pp512_tps"]),
        }
    return out


def ours_mtp(path: Path, work: Path, cuts: Sequence[int], rounds: int) -> dict[str, Any]:
    """The MTP costs of `path` in this process (the child `--ours-mtp` runs): a forward's ms by
    rows 1..8 at context 64 (median of 3 a round), and the file's MTP head (its nextn block)
    one chained step with the whole vocabulary and cut to each of `cuts` first ids plus the
    end-of-generation ids (`--draft-vocab`), `rounds` interleaved rounds, medians."""
    from quickdraft.speculation.drafters.mtp import head_step_seconds, load_mtp_head

    ours = Ours(path, work)
    model_dir = work / f"{path.stem}-model"
    head = load_mtp_head(ours.model, model_dir)
    whole = head.lm_head_weight
    heads: dict[str, tuple[Any, Any]] = {"all": (whole, None)}
    for n in cuts:
        head.lm_head_weight, head.vocab = whole, None
        head.keep_first_(n, ours.eos_ids)
        heads[str(n)] = (head.lm_head_weight, head.vocab)
    ours.forward_s(8)  # warm
    rows: list[list[float]] = []
    steps: dict[str, list[float]] = {name: [] for name in heads}
    for _ in range(rounds):
        rows.append(
            [statistics.median(ours.forward_s(n, 64) for _ in range(3)) * 1e3 for n in ROWS]
        )
        for name, (weight, vocab) in heads.items():
            head.lm_head_weight, head.vocab = weight, vocab
            steps[name].append(head_step_seconds(head, context=64, reps=5) * 1e3)
    return {
        "rows_ms": [round(statistics.median(r[i] for r in rows), 3) for i in range(len(ROWS))],
        "head_step_ms": {k: round(statistics.median(v), 3) for k, v in steps.items()},
        "rounds": {"rows_ms": rows, "head_step_ms": steps},
        "rss_mb": _rss_mb(),
    }


STAGED = Path(__file__).parent / "results" / "hybrid-gguf-qwen35moe.json"


def staged_survival(report: Path = STAGED) -> tuple[list[float], str]:
    """P(a cycle accepts at least j drafts), j = 1..k, from the accepted-drafts histogram of
    bench/hybrid.py's staged qwen35moe run (k drafts every cycle), and where it came from."""
    run = json.loads(report.read_text())
    hist = run["throughput"]["accepted_histogram"]
    total = sum(hist)
    survival = [round(sum(hist[j:]) / total, 4) for j in range(1, len(hist))]
    rate = run["throughput"]["acceptance_rate"]
    return survival, f"{report.name} (k = {run['k']}, acceptance rate {rate}, {total} cycles)"


def project_mtp(
    rows_ms: Sequence[float], head_ms: float, survival: Sequence[float]
) -> list[dict[str, float]]:
    """MTP at k = 1..len(survival) from measured costs: a cycle is k head steps and a (k+1)-row
    verify, and yields 1 + sum_j P(>= j accepted) tokens; speedup = tokens x one-row step /
    cycle. The engine's own per-cycle work is not in it."""
    out = []
    for k in range(1, len(survival) + 1):
        tokens = 1 + sum(survival[:k])
        cycle = rows_ms[k] + k * head_ms
        out.append(
            {
                "k": k,
                "tokens_per_cycle": round(tokens, 3),
                "cycle_ms": round(cycle, 2),
                "speedup": round(tokens * rows_ms[0] / cycle, 3),
            }
        )
    return out


def run_full_mtp(
    work: Path,
    peers: dict[str, tuple[Path, list[str]]],
    threads: int,
    cuts: Sequence[int],
    rounds: int,
) -> dict[str, Any]:
    """MTP's costs on the full-size qwen35moe file (its nextn block random, so acceptance is
    taken from the staged run): ours in a child process (`ours_mtp`), each peer's
    `llama-bench -p 1,...,8` on the same file, and the projected speedup by k for the head
    with the whole vocabulary and cut to each of `cuts`."""
    path = write_full("qwen35moe", work)
    child = [sys.executable, __file__, "--ours-mtp", str(path), "--files", str(work)]
    child += ["--threads", str(threads), "--rounds", str(rounds)]
    child += ["--mtp-cuts", *(str(n) for n in cuts)]
    run = subprocess.run(child, capture_output=True, text=True, timeout=3600)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    ours = json.loads(run.stdout.strip().splitlines()[-1])
    prompts = ",".join(str(n) for n in ROWS)
    peer_rows = {}
    for name, (binary, extra) in peers.items():
        # mainline mmaps the file by default: 20 GiB of a 23.5 GiB machine then pages from disk
        # in every forward (~0.5 s a row); read into memory instead (ik's -rtr does already)
        load = ["-lm", "none"] if name == "llama.cpp" else []
        got = llama_bench(binary, path, threads, 0, [*extra, *load], prompts=prompts)
        peer_rows[name] = [round(n / got[f"pp{n}_tps"] * 1e3, 3) for n in ROWS]
    survival, source = staged_survival()
    return {
        "file": path.name,
        "file_gib": round(path.stat().st_size / 2**30, 2),
        "machine_memory_gib": round(
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1
        ),
        "ours": ours,
        "peer_rows_ms": peer_rows,
        "staged_survival": survival,
        "staged_source": source,
        "projected": {
            name: project_mtp(ours["rows_ms"], ms, survival)
            for name, ms in ours["head_step_ms"].items()
        },
    }


def markdown_full_mtp(report: dict[str, Any]) -> str:
    m = report["mtp"]
    ours = m["ours"]
    one = ours["rows_ms"][0]
    rows = [["quickdraft at 64", *ours["rows_ms"], round(ours["rows_ms"][-1] / one, 2)]]
    rows += [[k, *v, round(v[-1] / v[0], 2)] for k, v in m["peer_rows_ms"].items()]
    heads = [[name, ms, round(ms / one, 3)] for name, ms in ours["head_step_ms"].items()]
    proj = []
    for name, ks in m["projected"].items():
        best = max(ks, key=lambda r: r["speedup"])
        proj.append([name, *(r["speedup"] for r in ks), best["k"], f"{best['speedup']}x"])
    k_max = len(m["staged_survival"])
    return (
        "# MTP on the full-size qwen35moe file: verify cost by rows, the head's step, and the "
        "projected speedup\n\n"
        f"{m['file']} ({m['file_gib']} GiB Q4_K_M, random blocks; {m['machine_memory_gib']} GiB "
        f"machine, nothing else running), {report['threads']} threads, {report['rounds']} "
        "interleaved rounds (medians). The file's MTP head is its random nextn block, so "
        "acceptance cannot be measured on it: it is taken from the staged run "
        f"({m['staged_source']}): P(>= j drafts accepted) = {m['staged_survival']}.\n\n"
        "## A forward's ms by rows (ours at context 64; peers `llama-bench -p N` from an "
        "empty cache, mainline with `-lm none`: the file read into memory, not mmapped)\n\n"
        + table(["engine", *(f"{n} rows" for n in ROWS), "8 rows / 1"], rows)
        + "\n## The MTP head's one chained step (its layer and the head; `--draft-vocab N`: the "
        "first N ids and the end-of-generation ids)\n\n"
        + table(["head scores", "ms", "over a one-row target step"], heads)
        + "\n## Projected MTP speedup over plain decoding by k (k head steps + a (k+1)-row "
        "verify a cycle, the staged acceptance; the engine's own per-cycle work not counted)\n\n"
        + table(["head scores", *(f"k = {k}" for k in range(1, k_max + 1)), "best k", "best"], proj)
    )


ROWS = range(1, 9)  # a decode step and verifies of k = 1..7


def rows_cost(
    arch: str, work: Path, peers: dict[str, tuple[Path, list[str]]], threads: int, rounds: int
) -> dict[str, Any]:
    """A forward's ms by rows (ROWS) on `arch`'s cut file: ours from an empty cache and at
    context 64, each peer's llama-bench `-p N` (one forward of N rows from an empty cache), the
    median of `rounds` interleaved rounds."""
    path = write_file(arch, work)
    ours = Ours(path, work)
    ours.forward_s(8)  # warm
    runs: dict[str, list[list[float]]] = {"quickdraft": [], "quickdraft at 64": []}
    runs |= {name: [] for name in peers}
    prompts = ",".join(str(n) for n in ROWS)
    for _ in range(rounds):
        runs["quickdraft"].append([min(ours.forward_s(n) for _ in range(3)) * 1e3 for n in ROWS])
        runs["quickdraft at 64"].append(
            [statistics.median(ours.forward_s(n, 64) for _ in range(3)) * 1e3 for n in ROWS]
        )
        for name, (binary, extra) in peers.items():
            got = llama_bench(binary, path, threads, 0, extra, prompts=prompts)
            runs[name].append([n / got[f"pp{n}_tps"] * 1e3 for n in ROWS])
    ms = {
        k: [round(statistics.median(r[i] for r in v), 3) for i in range(len(ROWS))]
        for k, v in runs.items()
    }
    return {"file": path.name, "rows": list(ROWS), "ms": ms, "rounds": runs}


def markdown_rows(report: dict[str, Any]) -> str:
    out = ["# A forward's cost by rows (a decode step, then verifies): quickdraft vs llama-bench\n"]
    for arch, r in report["rows"].items():
        header = ["engine", *(f"{n} rows ms" for n in r["rows"]), "8 rows / 1"]
        rows = [[k, *v, round(v[-1] / v[0], 2)] for k, v in r["ms"].items()]
        out.append(
            f"\n## {arch} ({r['file']}), median of {report['rounds']} interleaved rounds, "
            f"{report['threads']} threads; peers: `llama-bench -p 1,...,8` (from an empty "
            "cache, like ours without a context)\n\n" + table(header, rows)
        )
    return "".join(out)


def paired_decode(
    arch: str,
    work: Path,
    peers: dict[str, tuple[Path, list[str]]],
    threads: int,
    tokens: int,
    pairs: int,
) -> dict[str, Any]:
    """Decode and pp512 in `pairs` back-to-back pairs: our `tokens` greedy steps and one
    512-row forward, and each peer's `llama-bench -p 512 -n tokens`, the order swapped every
    pair. The host's phases move whole runs by 30 % or more, and two runs seconds apart share a
    phase far more often than two a minute apart, so the ratio within a pair is steadier than
    a ratio of medians."""
    path = write_file(arch, work)
    per_token, _ = streamed_bytes(path, config(arch))
    ours = Ours(path, work)
    ours.forward_s(8)  # warm
    runs: dict[str, list[float]] = {"quickdraft": [], **{p: [] for p in peers}}
    pp: dict[str, list[float]] = {"quickdraft": [], **{p: [] for p in peers}}

    def run(name: str) -> None:
        if name == "quickdraft":
            steps = ours.decode_s(tokens)
            runs[name].append(round(len(steps) / sum(steps), 2))
            pp[name].append(round(512 / ours.forward_s(512), 1))
        else:
            binary, extra = peers[name]
            got = llama_bench(binary, path, threads, tokens, extra, prompts="512")
            runs[name].append(got["decode_tps"])
            pp[name].append(got["pp512_tps"])

    order = ["quickdraft", *peers]
    for i in range(pairs):
        for name in order if i % 2 == 0 else order[::-1]:
            run(name)
    ratios = {
        p: [round(a / b, 3) for a, b in zip(runs["quickdraft"], runs[p], strict=True)]
        for p in peers
    }
    pp_ratios = {
        p: [round(a / b, 3) for a, b in zip(pp["quickdraft"], pp[p], strict=True)] for p in peers
    }
    return {
        "file": path.name,
        "weight_mb_per_token": round(per_token / 1e6, 1),
        "tokens": tokens,
        "decode_tps": runs,
        "ratios": ratios,
        "median_ratio": {p: statistics.median(r) for p, r in ratios.items()},
        "pp512_tps": pp,
        "pp512_ratios": pp_ratios,
        "pp512_median_ratio": {p: statistics.median(r) for p, r in pp_ratios.items()},
        "median_gbs": {
            n: round(statistics.median(v) * per_token / 1e9, 1) for n, v in runs.items()
        },
    }


def markdown_pairs(report: dict[str, Any]) -> str:
    out = ["# Decode and pp512 in back-to-back pairs: quickdraft vs llama-bench on the same file\n"]
    for arch, r in report["pairs"].items():
        peers = list(r["ratios"])
        rows = [
            [
                i + 1,
                *(r["decode_tps"][n][i] for n in r["decode_tps"]),
                *(r["ratios"][p][i] for p in peers),
                *(r["pp512_tps"][n][i] for n in r["pp512_tps"]),
                *(r["pp512_ratios"][p][i] for p in peers),
            ]
            for i in range(len(r["decode_tps"]["quickdraft"]))
        ]
        header = [
            "pair",
            *(f"{n} tok/s" for n in r["decode_tps"]),
            *(f"vs {p}" for p in peers),
            *(f"{n} pp512" for n in r["pp512_tps"]),
            *(f"pp512 vs {p}" for p in peers),
        ]
        worst = min(r["median_ratio"].values()) if peers else float("nan")
        worst_pp = min(r["pp512_median_ratio"].values()) if peers else float("nan")
        out.append(
            f"\n## {arch} ({r['file']}, {r['weight_mb_per_token']} MB of weights a token), "
            f"tg{r['tokens']}, {report['threads']} threads, the order swapped every pair; host "
            f"read {report['read_gbs']} GB/s (torch sum) at the start\n\n"
            + table(header, rows)
            + "\n\nMedian GB/s: "
            + ", ".join(f"{n} {v}" for n, v in r["median_gbs"].items())
            + "\n\n"
            + table(
                ["quickdraft", "ratio"],
                [
                    ["decode vs best peer (median of pair ratios)", f"{worst:.2f}x"],
                    ["pp512 vs best peer (median of pair ratios)", f"{worst_pp:.2f}x"],
                ],
            )
            + "\n"
        )
    return "".join(out)


def narrow_overhead(work: Path, tokens: int, rounds: int) -> dict[str, Any]:
    """The full qwen35moe structure (40 layers: 30 Gated DeltaNet + 10 attention, 256 experts
    top 8 + a shared expert, each a MoE block) at widths where every GEMM is tiny (hidden 256):
    its decode step is the per-layer work around the kernels (Python, torch dispatch, small
    ops, fork/joins) plus the fixed cost of GEMMs one 256-value block deep, most of which a
    full-size step pays on top of streaming its weights."""
    cfg = dict(REAL["qwen35moe"])
    cfg.update(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    cfg.update(linear_num_key_heads=1, linear_num_value_heads=2, vocab_size=1024)
    cfg.update(moe_intermediate_size=256, shared_expert_intermediate_size=256)
    path = work / "qwen35moe-narrow-Q4_K_M.gguf"
    if not path.exists():
        meta = HybridLM(HybridConfig.from_dict(cfg), torch.bfloat16, torch.device("meta"))
        tensors = llama_cpp_tensors(meta.state_dict(), "qwen35moe", cfg)
        layers = cfg["num_hidden_layers"]
        plan = {
            n: (tuple(t.shape), q4_k_m_type(n, tuple(t.shape), layers)) for n, t in tensors.items()
        }
        write_gguf_streamed(path, "qwen35moe", cfg, plan, random_chunks)
    ours = Ours(path, work)
    per_token, _ = streamed_bytes(path, cfg)
    ms = [sum(ours.decode_s(tokens)) / tokens * 1e3 for _ in range(rounds + 1)][1:]
    return {
        "config": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_experts")},
        "weight_mb_per_token": round(per_token / 1e6, 1),
        "ms_per_token": [round(m, 2) for m in ms],
        "median_ms_per_token": round(statistics.median(ms), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--files", type=Path, default=Path("/tmp/quickdraft-moe"), help="file cache")
    ap.add_argument("--arch", nargs="+", default=list(REAL), choices=list(REAL))
    ap.add_argument("--llama-bench", type=Path, help="mainline llama.cpp's llama-bench")
    ap.add_argument("--ik-bench", type=Path, help="ik_llama.cpp's llama-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--qtype",
        help="llama.cpp's file type for every --arch's cut file (default Q4_K_M, gpt-oss "
        "MXFP4_MOE): Q3_K_M, Q2_K, ... as the smaller uploads are",
    )
    ap.add_argument("--name", default="moe")
    ap.add_argument("--full", action="store_true", help="the full-size files of --arch instead")
    ap.add_argument("--ours", type=Path, help=argparse.SUPPRESS)  # the child of --full
    ap.add_argument(
        "--narrow", action="store_true", help="the per-layer work of a 40-layer qwen35moe step"
    )
    ap.add_argument("--rows", action="store_true", help="a forward's cost by rows 1..8")
    ap.add_argument(
        "--pairs", type=int, help="decode and pp512 only, in this many back-to-back pairs"
    )
    ap.add_argument(
        "--mtp-cuts",
        type=int,
        nargs="+",
        help="with --full: MTP's costs on the full file instead, the head cut to these ids too",
    )
    ap.add_argument("--ours-mtp", type=Path, help=argparse.SUPPRESS)  # the child of --mtp-cuts
    args = ap.parse_args()
    if args.qtype:
        QTYPES.update({a: args.qtype for a in args.arch})
    torch.set_num_threads(args.threads)
    if args.ours:
        print(json.dumps(ours_once(args.ours, args.files, args.tokens)))
        return
    if args.ours_mtp:
        print(json.dumps(ours_mtp(args.ours_mtp, args.files, args.mtp_cuts, args.rounds)))
        return
    report: dict[str, Any] = {"machine": machine(), "threads": args.threads, "rounds": args.rounds}
    report["read_gbs"] = round(read_bandwidth_gbs(), 1)
    peers: dict[str, tuple[Path, list[str]]] = {}
    if args.llama_bench:
        peers["llama.cpp"] = (args.llama_bench, [])
    if args.ik_bench:
        peers["ik_llama.cpp"] = (args.ik_bench, ["-fmoe", "1", "-rtr", "1"])
    if args.narrow:
        report["narrow"] = narrow_overhead(args.files, args.tokens, args.rounds)
        n = report["narrow"]
        md = (
            "# The work around the kernels: a 40-layer qwen35moe step at tiny widths\n\n"
            f"{n['config']}: {n['weight_mb_per_token']} MB of weights a token, "
            f"{n['median_ms_per_token']} ms a token (rounds: {n['ms_per_token']}).\n"
        )
        series: dict[str, Sequence[float]] = {"ms": n["ms_per_token"]}
        write(
            args.name,
            report,
            md,
            bar_chart("narrow step", "ms", [str(i) for i in range(len(n["ms_per_token"]))], series),
        )
        return
    if args.rows:
        report["rows"] = {
            a: rows_cost(a, args.files, peers, args.threads, args.rounds) for a in args.arch
        }
        first = report["rows"][args.arch[0]]
        chart = bar_chart(
            f"{args.arch[0]}: forward ms by rows", "ms", [str(n) for n in ROWS], first["ms"]
        )
        write(args.name, report, markdown_rows(report), chart)
        return
    if args.pairs:
        report["pairs"] = {
            a: paired_decode(a, args.files, peers, args.threads, args.tokens, args.pairs)
            for a in args.arch
        }
        pairs = report["pairs"]
        chart = bar_chart(
            "Decode, back-to-back pairs: quickdraft over each peer",
            "x peer (median of pairs)",
            list(pairs),
            {p: [pairs[a]["median_ratio"][p] for a in pairs] for p in peers},
        )
        write(args.name, report, markdown_pairs(report), chart)
        return
    if args.full and args.mtp_cuts:
        report["mtp"] = run_full_mtp(args.files, peers, args.threads, args.mtp_cuts, args.rounds)
        proj = report["mtp"]["projected"]
        chart = bar_chart(
            "qwen35moe full size: projected MTP speedup",
            "x plain",
            [f"k={r['k']}" for r in next(iter(proj.values()))],
            {name: [r["speedup"] for r in ks] for name, ks in proj.items()},
        )
        write(args.name, report, markdown_full_mtp(report), chart)
        return
    if args.full:
        report["full"] = {
            a: run_full(a, args.files, peers, args.threads, args.tokens, args.rounds)
            for a in args.arch
        }
        write(args.name, report, markdown_full(report), plot_full(report))
        return
    report["files"] = {}
    for arch in args.arch:
        path = write_file(arch, args.files)
        cfg = config(arch)
        per_token, formats = streamed_bytes(path, cfg)
        ours = Ours(path, args.files)
        runs: dict[str, list[dict[str, float]]] = {"quickdraft": [], **{p: [] for p in peers}}
        for _ in range(args.rounds):
            runs["quickdraft"].append(ours.round(args.tokens))
            for name, (binary, extra) in peers.items():
                runs[name].append(llama_bench(binary, path, args.threads, args.tokens, extra))
        engines = {}
        for name, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            med["decode_gbs"] = round(med["decode_tps"] * per_token / 1e9, 1)
            engines[name] = {"median": med, "rounds": rs}
        report["files"][arch] = {
            "file_type": QTYPES.get(arch, "Q4_K_M"),
            "real": REAL[arch],
            "cut": CUTS[arch],
            "file_gib": round(path.stat().st_size / 2**30, 3),
            "tensors_by_format": formats,
            "weight_mb_per_token": round(per_token / 1e6, 1),
            "quickdraft_load_s": round(ours.load_s, 1),
            "quickdraft_rss_mb": ours.rss_mb,
            "engines": engines,
        }
        del ours
    write(args.name, report, markdown(report), plot(report))


def markdown(report: dict[str, Any]) -> str:
    out = [
        f"# Sparse MoE on the CPU: quickdraft vs llama.cpp and ik_llama.cpp\n\n"
        f"{report['threads']} threads, median of {report['rounds']} interleaved rounds; the "
        f"host reads {report['read_gbs']} GB/s (torch sum). Random weights at the real "
        f"per-layer widths, quantized by llama.cpp's quantizer (Q4_K_M; gpt-oss MXFP4_MOE), "
        f"the same file for every engine.\n"
    ]
    for arch, f in report["files"].items():
        eng = f["engines"]
        names = list(eng)
        rows = []
        for key, label in (
            ("decode_tps", "decode tok/s (tg128)"),
            ("decode_gbs", "weights streamed, GB/s"),
            ("pp512_tps", "pp512 tok/s"),
            ("pp5_tps", "pp5 tok/s"),
        ):
            rows.append([label, *(eng[n]["median"].get(key, "-") for n in names)])
        peers = [n for n in names if n != "quickdraft"]
        ours = eng["quickdraft"]["median"]
        extra = []
        if peers:
            best = max(eng[p]["median"]["decode_tps"] for p in peers)
            best_pp = max(eng[p]["median"]["pp512_tps"] for p in peers)
            extra.append(["decode vs best peer", f"{ours['decode_tps'] / best:.2f}x"])
            extra.append(["pp512 vs best peer", f"{ours['pp512_tps'] / best_pp:.2f}x"])
        extra.append(
            [
                "5-row forward / one-row step (context 64)",
                f"{ours['rows5_ms_at_64'] / ours['step_ms_at_64']:.2f}x",
            ]
        )
        cut = ", ".join(f"{k} {v}" for k, v in f["cut"].items())
        out.append(
            f"\n## {arch} ({cut}; {f['file_gib']} GiB, {f['weight_mb_per_token']} MB of "
            f"weights per token)\n\n"
            + table(["", *names], rows)
            + "\n"
            + table(["quickdraft", "ratio"], extra)
            + f"\nTensors by format: {f['tensors_by_format']}. quickdraft loaded in "
            f"{f['quickdraft_load_s']} s, RSS {f['quickdraft_rss_mb']} MiB.\n"
        )
    return "".join(out)


def plot(report: dict[str, Any]) -> Any:
    files = list(report["files"])
    names = list(report["files"][files[0]]["engines"]) if files else []
    series: dict[str, Sequence[float]] = {
        n: [report["files"][a]["engines"][n]["median"]["decode_tps"] for a in files] for n in names
    }
    return bar_chart("MoE decode, Q4_K_M, same file", "tok/s", files, series)


def markdown_full(report: dict[str, Any]) -> str:
    out = ["# Full-size MoE on this machine: quickdraft vs llama.cpp and ik_llama.cpp\n"]
    for arch, f in report["full"].items():
        rows = []
        for name, e in f["engines"].items():
            if "error" in e:
                rows.append([name, "failed", "-", "-", "-", "-", "-", "-"])
                continue
            per_round = " / ".join(str(g.get("decode_tps", "failed")) for g in e.get("rounds", [e]))
            rows.append(
                [
                    name,
                    e["decode_tps"],
                    per_round,
                    e["decode_gbs"],
                    e.get("pp512_tps", "-"),
                    e.get("start_s", "-"),
                    e.get("rss_mb", "-"),
                    e.get("peak_rss_mb", "-"),
                ]
            )
        written = f"written in {f['write_s']} s" if f["write_s"] >= 1 else "written before"
        out.append(
            f"\n## {arch}: real widths, {f['file_gib']} GiB Q4_K_M (random blocks, {written}), "
            f"{f['weight_mb_per_token']} MB of weights per token, "
            f"{f['machine_memory_gib']} GiB of memory, each engine alone, {f['rounds']} rounds in "
            f"swapped order (medians; peak RSS the highest)\n\n"
            + table(
                [
                    "engine",
                    "decode tok/s",
                    "decode by round",
                    "GB/s",
                    "pp512 tok/s",
                    "start s",
                    "RSS MiB",
                    "peak RSS MiB",
                ],
                rows,
            )
            + f"\nTensors by format: {f['tensors_by_format']}.\n"
        )
        vs = f.get("vs_best_peer")
        if vs:
            out.append(
                "\n"
                + table(
                    ["quickdraft", "ratio", "by round"],
                    [
                        [
                            "decode vs best peer (median of round ratios)",
                            f"{vs['decode']:.2f}x",
                            ", ".join(str(v) for v in vs["decode_rounds"]),
                        ],
                        [
                            "pp512 vs best peer (median of round ratios)",
                            f"{vs['pp512']:.2f}x",
                            ", ".join(str(v) for v in vs["pp512_rounds"]),
                        ],
                    ],
                )
                + "\n"
            )
    return "".join(out)


def plot_full(report: dict[str, Any]) -> Any:
    arch = next(iter(report["full"]))
    eng = {n: e for n, e in report["full"][arch]["engines"].items() if "error" not in e}
    series: dict[str, Sequence[float]] = {"decode": [e["decode_tps"] for e in eng.values()]}
    return bar_chart(f"{arch} full size, decode", "tok/s", list(eng), series)


if __name__ == "__main__":
    main()
