"""A/B benchmark of speculative decoding (over 400 lines: one run's engines, sets and report).

Speculation off vs n-gram vs suffix tree vs draft model vs adaptive (each request picks among
n-gram, suffix and the draft model per step: speculation/adaptive.py), and the Hugging Face
transformers
baselines (plain `generate`, `prompt_lookup_num_tokens`, `assistant_model`) on the same
converted weights, dtype and prompts, in ONE run.

Per prompt set (code, prose, json, repetitive, agentic): tok/s (output tokens / request wall
time, prefill included, the same for every engine) and decode-only tok/s (after the first token),
speedup vs our speculation-off (suffix also vs n-gram) and, with `peers`, vs llama.cpp on the
target's own GGUF (peers.py), mean acceptance length, acceptance rate, TTFT, and parity with
speculation off (in bf16 a k-token verify can flip near-tie argmaxes: where outputs diverge we
report the position and the target's top-2 logit gap there; a peer computes with other numerics
and is left out). Warm-up runs are excluded. Writes JSON, a markdown table and a PNG chart.

The agentic set (prompts/agentic.json, built by bench/agentic_prompts.py) replays a coding
agent's edit/test loop: sessions whose every request resends the whole conversation, with the
baseline engine's own earlier answers in it (`session_requests`); a set's "prompts" are its
requests. The drafters' shared indexes learn every output of the run, in order. Each of our
engines runs the set on a prefix cache of its own, kept across the set's requests, as `serve`
keeps one by default (`prefix_cache=False`: every request prefills its whole prompt, as in the
other sets, whose requests share nothing but the chat template's first tokens).

Our engines (none, ngram, suffix, draft, adaptive; dflash, mtp and eagle3 when given a
trained checkpoint) run every prompt of a set by default; the reference engines (the
unquantized draft model and the three transformers baselines, 2-4x slower) run the first
`reference_per_set` prompts, and every ratio between two engines is taken over the prompts both ran
(`Cell.summary`), so a comparison never mixes prompt subsets. Adaptive is also compared with the
set's best single drafter, and every engine over all sets together.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from quickdraft import hub
from quickdraft.bench.peers import PEERS, LlamaCpp
from quickdraft.bench.report import RESULTS, bar_chart, machine, table, write
from quickdraft.config import (
    BENCH_MAX_TOKENS,
    DEFAULT_DRAFT_QUANTIZATION,
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_DRAFTS,
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    DEFAULT_NUM_DRAFT_TOKENS,
    PREFILL_CHUNK,
    PrefixCacheConfig,
    SpeculativeConfig,
    parse_dtype,
)
from quickdraft.engine import EngineCore, SchedulerConfig, stream
from quickdraft.engine.core import StepStats
from quickdraft.loading import LoadedModel, load
from quickdraft.models.base import LanguageModel
from quickdraft.models.heads.dflash import DFlashConfig
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import AnySpeculation

Message = dict[str, str | None]  # a chat message; an assistant's None: the model's own answer
Prompt = str | list[Message]  # one user message, or an agentic session


def prompt_sets() -> dict[str, list[str]]:
    """The one-message sets (the serving benchmarks mix these too)."""
    text = resources.files("quickdraft.prompts").joinpath("spec_bench.json").read_text()
    data: dict[str, list[str]] = json.loads(text)
    return data


def bench_sets() -> dict[str, list[Prompt]]:
    """Every set this benchmark runs: the one-message sets and the agentic sessions."""
    text = resources.files("quickdraft.prompts").joinpath("agentic.json").read_text()
    return {**prompt_sets(), "agentic": json.loads(text)["sessions"]}


def session_requests(prompt: Prompt) -> list[list[Message]]:
    """The requests of one set entry: a prompt string is one user message; a session one
    request per assistant turn whose content is None, the messages before that turn (the
    earlier None turns still to fill with the answers, `fill`)."""
    if isinstance(prompt, str):
        return [[{"role": "user", "content": prompt}]]
    turns = [i for i, m in enumerate(prompt) if m["role"] == "assistant" and m["content"] is None]
    return [prompt[:i] for i in turns]


def prompt_ids(lm: LoadedModel, messages: list[Message]) -> list[int]:
    """A request's prompt: the chat template's rendering, or, for a model without one (a base
    model such as gemma3-270m), the turns' text one after another as a plain completion."""
    tok = lm.tokenizer
    if tok.chat_template is not None:
        return tok.encode_chat(messages)
    return tok.encode("\n\n".join(str(m["content"]) for m in messages) + "\n\n")


def fill(messages: list[Message], answers: list[str]) -> list[Message]:
    """`messages` with its assistant turns of content None given `answers`, in order."""
    pending = iter(answers)
    out = [m if m["content"] is not None else {**m, "content": next(pending)} for m in messages]
    assert next(pending, None) is None, "one answer per earlier turn"
    return out


ENGINES = (
    "none",
    "ngram",
    "suffix",
    "draft",
    "adaptive",
    "dflash",
    "mtp",
    "eagle3",
    "draft_unquantized",
    "llama.cpp",
    "hf",
    "hf_prompt_lookup",
    "hf_assisted",
)
OURS = ("none", "ngram", "suffix", "draft", "adaptive", "dflash", "mtp", "eagle3")
SINGLE = ("ngram", "suffix", "draft")  # the drafters adaptive picks among
PEER_CONTEXT = 4096  # tokens of KV the peer allocates: the longest prompt + output fits
REFERENCE_ENGINES = frozenset({"draft_unquantized", "hf", "hf_prompt_lookup", "hf_assisted"})


@dataclass(slots=True)
class Run:
    tokens: list[int]
    seconds: float
    ttft: float
    drafted: int = 0
    accepted: int = 0
    cycles: int = 0
    drafters: dict[str, list[int]] = field(default_factory=dict)  # adaptive: SpecStats.drafters


def tok_s(runs: list[Run]) -> float:
    """Output tokens over the requests' whole time, prompt processing included."""
    return sum(len(r.tokens) for r in runs) / sum(r.seconds for r in runs)


def decode_tok_s(runs: list[Run]) -> float | None:
    """Tokens after the first over the time after the first (None: a run without a TTFT)."""
    if any(math.isnan(r.ttft) for r in runs):
        return None
    seconds = sum(r.seconds - r.ttft for r in runs)
    return sum(max(0, len(r.tokens) - 1) for r in runs) / seconds if seconds > 0 else None


@dataclass(slots=True)
class Cell:
    runs: dict[int, Run] = field(default_factory=dict)  # prompt index in its set -> run

    def ratio(self, other: Cell) -> float:
        """tok/s of this engine over `other`'s, on the prompts both ran."""
        both = sorted(self.runs.keys() & other.runs.keys())
        return tok_s([self.runs[i] for i in both]) / tok_s([other.runs[i] for i in both])

    def summary(self, base: Cell | None) -> dict[str, Any]:
        runs = list(self.runs.values())
        out: dict[str, Any] = {"tok_s": round(tok_s(runs), 2), "prompts": len(runs)}
        decode = decode_tok_s(runs)
        if decode is not None:
            out["decode_tok_s"] = round(decode, 2)
        if base is not None:
            out["speedup"] = round(self.ratio(base), 3)
        cycles = sum(r.cycles for r in runs)
        drafted = sum(r.drafted for r in runs)
        if cycles:
            out["mean_acceptance_length"] = round(1 + sum(r.accepted for r in runs) / cycles, 3)
        if drafted:
            out["acceptance_rate"] = round(sum(r.accepted for r in runs) / drafted, 3)
        out["ttft_s"] = round(statistics.median(r.ttft for r in runs), 3)
        out["per_prompt"] = [self.prompt_row(i, base) for i in sorted(self.runs)]
        return out

    def prompt_row(self, i: int, base: Cell | None) -> dict[str, Any]:
        """One prompt's figures: a set's mean hides that prompt lookup pays on an edit
        (the answer copies the prompt) and hardly on code written from scratch."""
        r = self.runs[i]
        row: dict[str, Any] = {"prompt": i, "tokens": len(r.tokens), "tok_s": round(tok_s([r]), 2)}
        if base is not None and i in base.runs:
            row["speedup"] = round(row["tok_s"] / tok_s([base.runs[i]]), 3)
        if r.cycles:
            row["mean_acceptance_length"] = round(1 + r.accepted / r.cycles, 3)
        return row


def ours(
    lm: LoadedModel, ids: list[int], n: int, spec: AnySpeculation | None, core: EngineCore | None
) -> Run:
    """One request on `core` (None: a core of its own, no prefix cache)."""
    req = lm.new_request(ids, SamplingParams(max_tokens=n))
    t = time.perf_counter()
    for _ in stream(lm, req, spec, core):
        pass
    seconds = time.perf_counter() - t
    s = req.spec
    return Run(
        req.output_ids, seconds, req.timing.ttft or 0.0, s.drafted, s.accepted, s.cycles, s.drafters
    )


@dataclass
class Batch:
    """What `serve_batch` measured: output tok/s (prefills included), each request's output
    ids, and the core's counters (steps, drafted and accepted rows, ...)."""

    tok_s: float
    outputs: list[list[int]]
    stats: StepStats


def serve_batch(
    lm: LoadedModel,
    spec: AnySpeculation | None,
    prompts: list[list[int]],
    tokens: int,
    concurrency: int,
) -> Batch:
    """`prompts` (token ids) served `concurrency` at a time by a fresh EngineCore, greedy,
    `tokens` each whatever the end-of-generation ids say."""
    core = EngineCore(lm, SchedulerConfig(max_running=concurrency))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    reqs = [lm.new_request(p, params) for p in prompts]
    t = time.perf_counter()
    for req in reqs:
        core.add(req, spec)
    while core.has_work:
        core.step()
    seconds = time.perf_counter() - t
    outputs = [list(r.output_ids) for r in reqs]
    return Batch(sum(len(o) for o in outputs) / seconds, outputs, core.stats)


def compare(
    lm: LoadedModel,
    specs: dict[str, AnySpeculation | None],
    prompts: list[list[int]],
    tokens: int,
    concurrency: int,
    rounds: int,
) -> dict[str, Any]:
    """Every method in `specs` (None: speculation off, named "off") over the same prompts
    `concurrency` at a time, alternating per round: median output tok/s and speedup over off
    (the ratio of medians, and the median of each round's ratio), acceptance rate (accepted /
    drafted), drafted and emitted rows a step, and whether every output equals off's."""
    runs: dict[str, list[Batch]] = {name: [] for name in specs}
    for _ in range(rounds):
        for name, spec in specs.items():
            runs[name].append(serve_batch(lm, spec, prompts, tokens, concurrency))
    off = runs["off"]
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        tps = statistics.median(r.tok_s for r in rs)
        drafted = sum(r.stats.draft_rows for r in rs)
        steps = sum(r.stats.steps for r in rs)
        emitted = sum(len(o) for r in rs for o in r.outputs)
        # each round against off's in the same round (seconds apart): steadier on a host whose
        # rounds move by more than the methods differ
        ratios = [r.tok_s / o.tok_s for r, o in zip(rs, off, strict=True)]
        out[name] = {
            "tok_s": round(tps, 2),
            "tok_s_rounds": [round(r.tok_s, 2) for r in rs],
            "speedup": round(tps / statistics.median(r.tok_s for r in off), 3),
            "round_ratios": [round(x, 3) for x in ratios],
            "paired_speedup": round(statistics.median(ratios), 3),
            "acceptance_rate": round(sum(r.stats.accepted for r in rs) / drafted, 3)
            if drafted
            else None,
            "drafted_per_step": round(drafted / steps, 2),
            "emitted_per_step": round(emitted / steps, 3),
            "identical_outputs": all(r.outputs == o.outputs for r, o in zip(rs, off, strict=True)),
        }
    return out


def compare_table(results: dict[str, Any]) -> str:
    """`compare`'s results as a markdown table, a row a method."""
    rows = [
        [
            name,
            r["tok_s"],
            f"{r['speedup']:.3f}x",
            f"{r['paired_speedup']:.3f}x",
            r["acceptance_rate"] if r["acceptance_rate"] is not None else "-",
            r["emitted_per_step"],
            r["identical_outputs"],
        ]
        for name, r in results.items()
    ]
    head = ["speculation", "tok/s", "vs off", "vs off, paired", "acceptance", "tokens a step"]
    return table([*head, "identical"], rows)


def calibrated_temperature(logits: torch.Tensor, accuracy: float) -> float:
    """The logit scale T at which the mean top probability of softmax(T logits) is `accuracy`
    (bisection in log T): the staged head as sure of its guesses as they are right."""
    lo, hi = -6.0, 6.0
    for _ in range(40):
        mid = (lo + hi) / 2
        top = torch.softmax(logits * math.exp(mid), -1).max(-1).values.mean().item()
        lo, hi = (mid, hi) if top < accuracy else (lo, mid)
    return math.exp((lo + hi) / 2)


def forward_seconds(
    model: LanguageModel, rows: int, context: int = 64, reps: int = 5, vocab: int = 1000
) -> float:
    """Best of `reps` forwards of `rows` random ids (< `vocab`) after `context` committed ones
    (seconds)."""
    best = float("inf")
    for _ in range(reps):
        cache = model.new_cache(context + rows + 8)
        if context:
            model(torch.randint(0, vocab, (context,)), [cache], [context])
            cache.commit(context)
        ids = torch.randint(0, vocab, (rows,))
        t = time.perf_counter()
        model(ids, [cache], [rows])
        best = min(best, time.perf_counter() - t)
    return best


def hf_run(model: Any, ids: list[int], n: int, eos: tuple[int, ...], **kw: Any) -> Run:
    x = torch.tensor([ids], device=model.device)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=list(eos),
            **kw,
        )
    new = out[0, len(ids) :].tolist()  # on a GPU: waits for the last token
    seconds = time.perf_counter() - t
    return Run(new, seconds, float("nan"))


def divergence(
    lm: LoadedModel, ids: list[int], ref: list[int], got: list[int]
) -> dict[str, Any] | None:
    """Where `got` leaves `ref`, and the target's top-2 logit gap at that position."""
    pos = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
    if pos is None:
        return None if len(ref) == len(got) else {"position": min(len(ref), len(got)), "gap": None}
    model = lm.model
    seq = ids + ref[:pos]
    cache = model.new_cache(len(seq))
    logits = model(torch.tensor(seq), [cache], [len(seq)]).logits[-1]
    top = torch.topk(logits, 2).values
    return {"position": pos, "top2_logit_gap": round(float(top[0] - top[1]), 4)}


@dataclass(frozen=True, slots=True)
class SpecBench:
    """What `run` measures. `draft` runs the draft model with `draft_quantization` weights;
    when that is not "none" the unquantized draft model runs too, as `draft_unquantized`, so
    the table shows both. `per_set`: prompts per set for our engines (None: all);
    `reference_per_set`: for the reference engines (REFERENCE_ENGINES); 0 leaves them out
    (nothing of theirs is loaded)."""

    target: str = DEFAULT_MODEL
    draft: str | None = None  # None: the target's paired draft model (config.DEFAULT_DRAFTS)
    dtype: str = DEFAULT_DTYPE
    tokens: int = BENCH_MAX_TOKENS
    per_set: int | None = None
    sets: tuple[str, ...] | None = None  # None: every set
    k: int = DEFAULT_NUM_DRAFT_TOKENS
    hf: bool = True  # the transformers baselines
    draft_quantization: str = DEFAULT_DRAFT_QUANTIZATION
    reference_per_set: int = 2
    peers: tuple[str, ...] = ()  # peers.PEERS run on the target's GGUF, every prompt
    out_dir: Path = RESULTS
    # a DFlash checkpoint dir (e.g. from `quickdraft train-drafter`): runs as engine "dflash",
    # drafting up to its block size - 1 tokens per cycle
    dflash: str | None = None
    # a standalone MTP head dir for the target (`quickdraft train-drafter --kind mtp`): runs as
    # engine "mtp", drafting up to k tokens per cycle
    mtp: str | None = None
    # token ids the draft model and the learned heads score (`--draft-vocab`; 0: all)
    draft_vocab: int = DEFAULT_DRAFT_VOCAB
    # an EAGLE-3 head dir for the target (`quickdraft train-drafter --kind eagle3`, or one
    # brought from vLLM / SpecForge): runs as engine "eagle3", drafting up to k tokens per cycle
    eagle3: str | None = None
    # the agentic set on a prefix cache per engine (module docstring)
    prefix_cache: bool = True
    device: str = "auto"  # where our engines run (loading.resolve_device)
    # False (`--no-adaptive`): every engine drafts k tokens each cycle, no cost model; the
    # adaptive engine (which prices its drafters with the cost model) is left out
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.reference_per_set < 0:
            raise ValueError(f"reference_per_set must be >= 0, got {self.reference_per_set}")
        unknown = sorted(set(self.peers) - set(PEERS))
        if unknown:
            raise ValueError(f"unknown peers {unknown}; choose from {list(PEERS)}")

    @property
    def draft_model(self) -> str | None:
        """The draft model: the one given, else the target's packaged pair; None when the
        target has none (the draft-model engines and transformers' assisted run are left out)."""
        return self.draft or DEFAULT_DRAFTS.get(self.target)


def run(opts: SpecBench) -> dict[str, Any]:
    """Every engine over every chosen prompt; writes speculative.{json,md,png} in out_dir."""
    host = machine()  # at the start: the code recorded is the code measured
    target, draft, dtype, tokens, k = opts.target, opts.draft_model, opts.dtype, opts.tokens, opts.k
    per_set, reference_per_set = opts.per_set, opts.reference_per_set
    draft_quantization = opts.draft_quantization
    hf = opts.hf and reference_per_set > 0
    all_sets = bench_sets()
    chosen = list(opts.sets or all_sets)
    lm = load(target, dtype, opts.device)
    cost_model = opts.adaptive  # False: k drafts every cycle
    specs: dict[str, AnySpeculation | None] = {
        "none": None,
        "ngram": make_speculation(
            lm, SpeculativeConfig(method="ngram", num_draft_tokens=k, adaptive=cost_model)
        ),
        "suffix": make_speculation(
            lm, SpeculativeConfig(method="suffix", num_draft_tokens=k, adaptive=cost_model)
        ),
    }
    quants = {} if draft is None else {"draft": draft_quantization}
    if draft is not None and draft_quantization != "none" and reference_per_set > 0:
        quants["draft_unquantized"] = "none"
    for name, quant in quants.items():
        specs[name] = make_speculation(
            lm,
            SpeculativeConfig(
                method="draft",
                num_draft_tokens=k,
                draft_model=draft,
                draft_quantization=quant,
                draft_vocab=opts.draft_vocab,
                adaptive=cost_model,
            ),
        )
    drafters = ("ngram", "suffix", "draft") if draft is not None else ("ngram", "suffix")
    if opts.adaptive:
        specs["adaptive"] = make_speculation(
            lm,
            SpeculativeConfig(
                method="adaptive",
                num_draft_tokens=k,
                draft_model=draft,
                draft_quantization=draft_quantization,
                adaptive_drafters=drafters,
            ),
        )
    if opts.dflash is not None:
        block = DFlashConfig.from_dir(opts.dflash).block_size
        specs["dflash"] = make_speculation(
            lm,
            SpeculativeConfig(
                method="dflash",
                draft_model=opts.dflash,
                num_draft_tokens=max(k, block - 1),
                draft_vocab=opts.draft_vocab,
                adaptive=cost_model,
            ),
        )
    for method, head in (("mtp", opts.mtp), ("eagle3", opts.eagle3)):  # k drafts a cycle
        if head is not None:
            specs[method] = make_speculation(
                lm,
                SpeculativeConfig(
                    method=method,
                    draft_model=head,
                    num_draft_tokens=k,
                    draft_vocab=opts.draft_vocab,
                    adaptive=cost_model,
                ),
            )
    hf_models: dict[str, Any] = {}
    if hf:
        import transformers

        torch_dtype = parse_dtype(dtype)
        # on the device our engines run on, so that each comparison is on one machine part
        device = lm.model.device
        reference: Any = transformers.AutoModelForCausalLM.from_pretrained(
            str(lm.path), dtype=torch_dtype
        )
        hf_models["target"] = reference.to(device).eval()
        if draft is not None:
            assistant: Any = transformers.AutoModelForCausalLM.from_pretrained(
                str(hub.resolve(draft, dtype)), dtype=torch_dtype
            )
            hf_models["assistant"] = assistant.to(device).eval()
    cores: dict[str, EngineCore] = {}  # the current set's engine cores with a prefix cache
    engines: dict[str, Any] = {
        name: (lambda ids, name=name, s=s: ours(lm, ids, tokens, s, cores.get(name)))
        for name, s in specs.items()
    }
    if hf:
        tgt, asst = hf_models["target"], hf_models.get("assistant")
        engines["hf"] = lambda ids: hf_run(tgt, ids, tokens, lm.eos_ids)
        engines["hf_prompt_lookup"] = lambda ids: hf_run(
            tgt, ids, tokens, lm.eos_ids, prompt_lookup_num_tokens=k
        )
        if asst is not None:
            engines["hf_assisted"] = lambda ids: hf_run(
                tgt, ids, tokens, lm.eos_ids, assistant_model=asst
            )
    peer_versions: dict[str, str] = {}
    if "llama.cpp" in opts.peers:
        peer = LlamaCpp(hub.gguf_file(target), torch.get_num_threads(), PEER_CONTEXT)
        peer_versions["llama.cpp"] = f"llama-cpp-python {peer.version}"

        def llama_cpp_run(ids: list[int]) -> Run:
            r = peer.generate(ids, tokens, lm.eos_ids)
            return Run(r.tokens, r.seconds, r.ttft)

        engines["llama.cpp"] = llama_cpp_run
    warm = prompt_ids(lm, [{"role": "user", "content": "Say hi."}])
    for fn in engines.values():
        fn(warm)  # warm-up (JIT kernels, allocator, HF caches): excluded
    results: dict[str, Any] = {}
    every: dict[str, list[Run]] = {name: [] for name in OURS if name in engines}  # all sets
    for set_name in chosen:
        cores.clear()
        if set_name == "agentic" and opts.prefix_cache:
            for name in specs:
                config = SchedulerConfig(max_running=1, max_step_tokens=PREFILL_CHUNK)
                cores[name] = EngineCore(lm, config, PrefixCacheConfig())
        cells = {name: Cell() for name in engines}
        parity: dict[str, list[Any]] = {
            name: [] for name in engines if name != "none" and name not in PEERS
        }
        requests = [
            (turns, n)
            for prompt in all_sets[set_name]
            for n, turns in enumerate(session_requests(prompt))
        ][:per_set]
        answers: list[str] = []  # the baseline's answers earlier in the current session
        for i, (turns, n) in enumerate(requests):
            answers = answers[:n]  # n == 0: a new session
            ids = prompt_ids(lm, fill(turns, answers))
            for name, fn in engines.items():
                if name not in REFERENCE_ENGINES or i < reference_per_set:
                    cells[name].runs[i] = fn(ids)
            ref = cells["none"].runs[i].tokens
            answers.append(lm.tokenizer.decode(ref))
            for name in parity:
                if i in cells[name].runs:
                    got = cells[name].runs[i].tokens
                    parity[name].append(divergence(lm, ids, ref, got))
        base = cells["none"]
        row: dict[str, Any] = {}
        for name, cell in cells.items():
            row[name] = cell.summary(None if name == "none" else base)
            cache = cores[name].prefix if name in cores else None
            if cache is not None:  # prompt tokens looked up / served from the cache
                row[name]["prefix_cache"] = {
                    "queries": cache.stats.queries,
                    "hits": cache.stats.hits,
                }
            if name in parity:
                row[name]["identical"] = sum(p is None for p in parity[name])
                row[name]["divergences"] = [p for p in parity[name] if p is not None]
        for name in ("suffix", "dflash", "mtp", "eagle3"):
            if name in cells:
                row[name]["speedup_vs_ngram"] = round(cells[name].ratio(cells["ngram"]), 3)
        if "adaptive" in cells:
            singles = [name for name in SINGLE if name in cells]
            best = max(singles, key=lambda name: tok_s(list(cells[name].runs.values())))
            row["adaptive"]["best_single"] = best
            ratio = cells["adaptive"].ratio(cells[best])
            row["adaptive"]["speedup_vs_best_single"] = round(ratio, 3)
            # drafter -> [cycles it drafted in, drafted, accepted], over the set's prompts
            picks: dict[str, list[int]] = {}
            for r in cells["adaptive"].runs.values():
                for name, counts in r.drafters.items():
                    total = picks.setdefault(name, [0, 0, 0])
                    for j, n in enumerate(counts):
                        total[j] += n
            row["adaptive"]["drafters"] = picks
        for name in ("hf_prompt_lookup", "hf_assisted"):
            if name in row:
                row[name]["speedup_vs_hf"] = round(cells[name].ratio(cells["hf"]), 3)
        if "llama.cpp" in row:
            for name in OURS:
                if name in row:
                    row[name]["speedup_vs_llama_cpp"] = round(
                        cells[name].ratio(cells["llama.cpp"]), 3
                    )
        if "draft" in row and "hf_assisted" in row:
            row["draft"]["speedup_vs_hf_assisted"] = round(
                cells["draft"].ratio(cells["hf_assisted"]), 3
            )
        results[set_name] = row
        for name, runs in every.items():
            runs.extend(cells[name].runs.values())
        print(set_name, json.dumps(row), flush=True)
    # every set's requests together: output tokens over their time
    overall = {name: round(tok_s(runs), 2) for name, runs in every.items() if runs}
    report = {
        "bench": "speculative",
        "target": target,
        "draft": draft,
        "draft_quantization": draft_quantization,
        "dtype": dtype,
        "tokens": tokens,
        "prompts_per_set": per_set,
        "reference_prompts_per_set": reference_per_set,
        "k_max": k,
        "cost_model": opts.adaptive,  # False: k drafts every cycle
        "agentic_prefix_cache": opts.prefix_cache,  # peers run without one
        "peers": peer_versions,
        "machine": host,
        "results": results,
        "overall_tok_s": overall,
    }
    write(
        "speculative",
        report,
        markdown(report),
        bar_chart(
            f"{target} ({dtype}): speculation A/B",
            "tok/s",
            chosen,
            {
                e: [results[s][e]["tok_s"] for s in chosen]
                for e in ENGINES
                if e in results[chosen[0]]
            },
        ),
        opts.out_dir,
    )
    return report


def markdown(report: dict[str, Any]) -> str:
    draft = (
        f"draft {report['draft']} ({report.get('draft_quantization', 'none')} weights)"
        if report["draft"]
        else "no draft model"
    )
    lines = [
        f"target {report['target']}, {draft}, {report['dtype']}, "
        f"{report['tokens']} tokens, "
        + (
            f"k <= {report['k_max']}"
            if report.get("cost_model", True)
            else f"k = {report['k_max']} every cycle (no cost model)"
        )
        + "; speedups are over the prompts both engines ran",
        "",
        "| set | engine | prompts | tok/s | decode tok/s | speedup vs none | vs ngram "
        "| vs llama.cpp | vs best single | AL | accept rate | TTFT s | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for set_name, row in report["results"].items():
        for name in ENGINES:
            if name not in row:
                continue
            c = row[name]
            speedup = c.get("speedup", 1.0 if name == "none" else "")
            ttft = c["ttft_s"] if c["ttft_s"] == c["ttft_s"] else ""  # NaN: not measured (HF)
            cells = [
                set_name,
                name,
                c.get("prompts", ""),
                c["tok_s"],
                c.get("decode_tok_s", ""),
                speedup,
                c.get("speedup_vs_ngram", ""),
                c.get("speedup_vs_llama_cpp", ""),
                f"{c['speedup_vs_best_single']} ({c['best_single']})" if "best_single" in c else "",
                c.get("mean_acceptance_length", ""),
                c.get("acceptance_rate", ""),
                ttft,
                c.get("identical", ""),
            ]
            lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    vs_hf = [
        f"{set_name} {row['draft']['speedup_vs_hf_assisted']}x"
        for set_name, row in report["results"].items()
        if "speedup_vs_hf_assisted" in row.get("draft", {})
    ]
    if vs_hf:
        lines += ["", "draft vs transformers assisted generation: " + ", ".join(vs_hf)]
    overall = report.get("overall_tok_s", {})
    if overall:
        lines += [
            "",
            "all sets together, tok/s: " + ", ".join(f"{k} {v}" for k, v in overall.items()),
        ]
    picks = [
        f"{set_name} {row['adaptive']['drafters']}"
        for set_name, row in report["results"].items()
        if row.get("adaptive", {}).get("drafters")
    ]
    if picks:
        lines += [
            "",
            "adaptive, drafter -> [cycles drafted in, drafted, accepted]: " + "; ".join(picks),
        ]
    return "\n".join(lines) + "\n"
