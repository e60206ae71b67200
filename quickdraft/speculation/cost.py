"""What a forward costs: measured step-cost tables and their running calibration.

Stage: the prices the speculation policy (policy.py) decides with. `StepCost` is a table of
seconds for one forward over M packed rows, measured at start-up (`measure_step_cost`; a draft
model gets its own table, the MTP head the target's scaled by one timed head step). A table
timed on a shared machine can be off by 20% and more, more than the margin a draft decision is
made on, so every step's target forward is timed and the table is scaled by a running ratio of
measured to predicted seconds (`Calibration`: the host's speed times a premium per step shape);
a drafter's table likewise (`DraftCost`). docs/speculation.md has the measurements behind these
choices.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quickdraft.config import PREFILL_CHUNK, cache_dir
from quickdraft.kernels.build import (
    extension,
    isa,
    prefetch_bytes,
    prefetch_bytes_32,
    source_digest,
)
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.kernels.triton_gguf import DeviceGGUFWeight
from quickdraft.models.base import LanguageModel
from quickdraft.models.layers import OperandModule

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepCost:
    """Measured seconds of one target forward.

    `rows[i]` packed rows of ONE sequence cost `seconds[i]` (ascending from 1 row,
    non-decreasing). Each further sequence adds `per_seq` (attention and cache writes run per
    sequence), and each sequence with more than one row (a verify or a prefill chunk: its
    attention needs a causal mask) adds `per_masked` over a one-row sequence; the one-sequence
    table already holds one such sequence for rows >= 2."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    per_seq: float = 0.0
    per_masked: float = 0.0

    def __post_init__(self) -> None:
        assert self.rows and self.rows[0] == 1 and len(self.rows) == len(self.seconds)

    def __call__(self, rows: int, seqs: int = 1, masked: int | None = None) -> float:
        """A forward of `rows` rows over `seqs` sequences, `masked` of them with > 1 row
        (default: the one-sequence case)."""
        in_table = 1 if rows >= 2 else 0
        masked = in_table if masked is None else masked
        extra = max(0, seqs - 1) * self.per_seq + (masked - in_table) * self.per_masked
        return max(self.of_rows(rows) + extra, self.seconds[0])

    def scaled(self, factor: float) -> StepCost:
        """The same curve, every cost times `factor`."""
        return StepCost(
            self.rows,
            tuple(x * factor for x in self.seconds),
            self.per_seq * factor,
            self.per_masked * factor,
        )

    def of_rows(self, m: int) -> float:
        r, s = self.rows, self.seconds
        if m <= r[0]:
            return s[0] * max(m, 0) / r[0] if m < r[0] else s[0]
        if m >= r[-1]:
            if len(r) == 1:
                return s[0] * m
            slope = (s[-1] - s[-2]) / (r[-1] - r[-2])
            return s[-1] + slope * (m - r[-1])
        hi = bisect.bisect_left(r, m)  # the first row count >= m
        lo = hi - 1
        frac = (m - r[lo]) / (r[hi] - r[lo])
        return s[lo] + frac * (s[hi] - s[lo])


COST_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 32, 64)  # dense where the curve bends
# cached tokens before the one-sequence rows are timed: a chat request's prompt and answer.
# An extra row attends to every cached token, so at 8 the curve was near flat where requests
# pay for rows: SmolLM2 Q4, 3 rows over 1 cost +5 % after 8 tokens, +29 % after 200
COST_CONTEXT = 256
# The measurement's caches together hold at most this (two sequences at least): a hybrid
# model's cache carries its recurrent state whatever its length, ~138 MB at Qwen3.6-35B-A3B's
# shape: eight of them took a served MTP start of it to the file + 2.58 GiB (+ 1.47 without)
COST_CACHE_BYTES = 256 << 20


def settle(device: torch.device) -> None:
    """Wait for the work queued on `device` (a GPU runs it asynchronously): a timing that ends
    without it measures the launches, not the step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def monotone(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent
    violators): cost cannot fall with more rows. A running maximum did that too, but carried
    one slow timing to every larger row count (a 16 ms spike at 4 rows of SmolLM2, whose 5-8
    rows take ~9 ms, priced all of them at 16 and the policy never drafted 3); pooling
    averages it with its neighbours instead."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def cost_sequences(cache_bytes: int, seqs: int, budget: int = COST_CACHE_BYTES) -> int:
    """How many sequences `measure_step_cost` times together when each one's cache holds
    `cache_bytes`: `seqs`, or as many as `budget` holds, but never below two where `seqs` asks
    for several (per_seq and per_masked need a second sequence)."""
    if seqs <= 2:
        return seqs
    return max(2, min(seqs, budget // max(cache_bytes, 1)))


def measure_step_cost(
    model: LanguageModel,
    rows: Sequence[int] = COST_ROWS,
    context: int = COST_CONTEXT,
    seqs: int = 8,
    others: int = 8,
    cache_budget: int = COST_CACHE_BYTES,
) -> StepCost:
    """Time target forwards over `rows` new tokens of one sequence after `context` cached ones
    (best of three up to 16 rows, where the draft decisions are made and noise matters, one
    run above); then `seqs` sequences (the first that one, the others after `others` cached
    tokens: prefilling every one at `context` would lengthen start-up for little) of one row
    and of two rows each, which give `per_seq` and `per_masked` (see StepCost). The best of
    three, because on a shared host one timing was seen 2x another of the same forward (a 64 ms
    `per_seq` from one start-up, 0 from the next); what noise is left, the policy's
    calibration corrects for the shapes that run. Fewer sequences where `seqs` caches would
    hold more than `cache_budget` (`cost_sequences`). ~20 s for a 1.5B model on this CPU,
    ~1 s for a 135M one."""
    device = model.device
    max_rows = max(max(rows), 2 * seqs)
    context = max(1, min(context, model.config.max_position_embeddings - max_rows - 1))
    caches = [model.new_cache(context + max_rows + 1)]
    seqs = cost_sequences(caches[0].nbytes(), seqs, cache_budget)
    lengths = [context] + [others] * (seqs - 1)
    ids = torch.randint(
        0, model.config.vocab_size, (max(sum(lengths), context + max_rows),), device=device
    )
    caches += [model.new_cache(n + max_rows + 1) for n in lengths[1:]]
    for start in range(0, context, PREFILL_CHUNK):  # the first cache's context, in chunks
        n = min(PREFILL_CHUNK, context - start)
        model(ids[start : start + n], caches[:1], [n])
        caches[0].commit(start + n)
    if seqs > 1:  # one packed forward fills the others'
        model(ids[: others * (seqs - 1)], caches[1:], lengths[1:])
        for cache in caches[1:]:
            cache.commit(others)

    def timed(per: int, num_seqs: int) -> float:
        n = per * num_seqs
        new, logit_rows = ids[context : context + n], torch.arange(n, device=device)
        best = float("inf")
        for _ in range(3 if n <= 16 else 1):
            t = time.perf_counter()
            model(new, caches[:num_seqs], [per] * num_seqs, logit_rows=logit_rows)
            settle(device)
            best = min(best, time.perf_counter() - t)
        return best

    timed(min(16, max(rows)), 1)  # warm-up: allocator, kernel build, graph capture
    seconds = monotone([timed(n, 1) for n in rows])
    table = StepCost(tuple(rows), tuple(seconds))
    if seqs < 2:
        return table
    one_row, two_rows = timed(1, seqs), timed(2, seqs)
    rows_delta = table.of_rows(2 * seqs) - table.of_rows(seqs)
    per_masked = max(0.0, (two_rows - one_row - rows_delta) / seqs)
    per_seq = max(0.0, (one_row - table.of_rows(seqs) + per_masked) / (seqs - 1))
    return StepCost(table.rows, table.seconds, per_seq, per_masked)


def clamped_ratio(measured: float, predicted: float) -> float:
    """measured / predicted within [1/4, 4]: one stalled step (a page fault, another process)
    cannot swing a running ratio."""
    return min(max(measured / predicted, 0.25), 4.0)


def running_mean(mean: float, n: int, x: float, window: int) -> float:
    """`mean` updated with its n-th value x: the plain mean of the first `window` values, then
    an exponential average over about `window`."""
    return mean + (x - mean) / min(n, window)


PREMIUM_WINDOWS = 4  # a shape's premium averages over this many of the speed's windows


@dataclass(slots=True)
class Calibration:
    """Measured over predicted forward seconds, modelled as the host's current speed times the
    step shape's own premium (what its steps say of the table's price for it against the
    others'): each step's ratio updates the speed by ratio / its shape's premium, then that
    premium by ratio / speed; each a running mean of its first `window` values, then an
    exponential average over about `window`. A shape's factor is the speed times its premium
    shrunk towards 1 (1 counting as one observation), so a shape never run follows the
    machine's speed, and so does a shape not run lately: when the host speeds up or slows down
    while the policy runs one shape, the others move with it and keep only their premium. (Kept
    as one ratio per shape, a shape measured in a slow phase stayed dear through the fast phase
    that followed, only the shapes that ran being corrected: on the full-size 35B-A3B MTP run a
    4-row verify stayed priced at ~250 ms, its measured median 232, while the policy ran only
    2-row steps.) Each ratio is clamped to [1/4, 4] so one stalled step (a page fault, another
    process) cannot swing it."""

    window: int = 10
    speed: float = 1.0
    seen: int = 0
    # per shape key: (its premium's running mean, observations)
    premiums: dict[tuple[int, int, int], tuple[float, int]] = field(default_factory=dict)

    @staticmethod
    def key(rows: int, seqs: int, masked: int) -> tuple[int, int, int]:
        # rows beyond 16 (prefill chunks) share power-of-two buckets
        bucket = rows if rows <= 16 else 1 << (rows - 1).bit_length()
        return bucket, seqs, masked

    def premium(self, key: tuple[int, int, int]) -> float:
        """The shape's premium shrunk towards 1 by its observations (at most `window`)."""
        mean, n = self.premiums.get(key, (1.0, 0))
        n = min(n, self.window)
        return (1.0 + mean * n) / (1 + n)

    def observe(self, rows: int, seqs: int, masked: int, measured: float, predicted: float) -> None:
        if measured <= 0.0 or predicted <= 0.0:
            return
        ratio = clamped_ratio(measured, predicted)
        key = self.key(rows, seqs, masked)
        self.seen += 1
        self.speed = running_mean(self.speed, self.seen, ratio / self.premium(key), self.window)
        mean, n = self.premiums.get(key, (1.0, 0))
        # premiums move slower than the speed (PREMIUM_WINDOWS windows), so that a change of
        # the host's pace shows as speed, not as the premium of the shape that ran through it
        window = PREMIUM_WINDOWS * self.window
        self.premiums[key] = (running_mean(mean, n + 1, ratio / self.speed, window), n + 1)

    def factor(self, rows: int, seqs: int, masked: int) -> float:
        return self.speed * self.premium(self.key(rows, seqs, masked))


@dataclass(frozen=True, slots=True)
class StepShape:
    """A forward's shape: rows, sequences, and sequences with > 1 row (a step's target forward
    before drafting, or one drafter forward)."""

    rows: int
    seqs: int
    masked: int = 0


@dataclass(slots=True)
class DraftCost:
    """Seconds of a drafter's forwards: its own step-cost table,
    timed at start-up, times the running ratio of measured to predicted draft phases (the mean
    of the first `window` phases, then an exponential average; each ratio clamped to [1/4, 4]
    like `Calibration`'s). The engine times every draft phase and tells it which forwards that
    phase ran (`observe`)."""

    table: StepCost
    window: int = 10
    ratio: float = 1.0
    seen: int = 0

    def __call__(self, shape: StepShape) -> float:
        """One forward of `shape`; 0 for an empty one."""
        if shape.seqs == 0:
            return 0.0
        return self.table(shape.rows, shape.seqs, shape.masked) * self.ratio

    def observe(self, forwards: Sequence[StepShape], seconds: float) -> None:
        """One draft phase: the forwards it ran, and how long the whole phase took."""
        predicted = sum(self.table(f.rows, f.seqs, f.masked) for f in forwards if f.seqs)
        if predicted <= 0.0 or seconds <= 0.0:
            return
        self.seen += 1
        self.ratio = running_mean(
            self.ratio, self.seen, clamped_ratio(seconds, predicted), self.window
        )


_TABLES: weakref.WeakKeyDictionary[Any, StepCost] = weakref.WeakKeyDictionary()
REMEASURE_ENV = "QUICKDRAFT_REMEASURE_COST"  # "1": measure again and replace the stored table
TABLE_VERSION = 3  # bump when measure_step_cost changes what it measures


def _operand_format(weight: object) -> str:
    """An operand's format as the cost key names it: its type, and a GGUF weight's block
    formats (two GGUFs of one architecture, Q4_K_M and Q8_0, step at different speeds)."""
    name = type(weight).__name__
    if isinstance(weight, (GGUFWeight, DeviceGGUFWeight)):
        name += "[" + "+".join(p.fmt.name for p in weight.parts) + "]"
    return name


PACKAGE = Path(__file__).resolve().parents[1]  # quickdraft/


@functools.cache
def python_digest(root: Path = PACKAGE) -> str:
    """A hash of the Python sources under `root` (the package): what runs around the kernels.
    A table timed by other code is stale: one stored by an earlier version on this host priced
    a second row at +1 % of a SmolLM2 step where the code then running paid +11-25 %."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def cost_key(model: LanguageModel) -> dict[str, Any]:
    """What a step's cost depends on: the model's architecture, dtype and weight formats, and
    the host (ISA, threads, torch, the kernels' sources and the Python around them). Not the
    weights' values."""
    formats: Counter[str] = Counter()
    inner = getattr(model, "inner", model)  # a device wrapper's model (models/graphs.py)
    if isinstance(inner, nn.Module):
        for module in inner.modules():
            if isinstance(module, OperandModule):
                formats.update(_operand_format(getattr(module, name)) for name in module.OPERANDS)
    return {
        "version": TABLE_VERSION,
        "model": type(model).__qualname__,
        "config": repr(model.config),
        "dtype": str(model.dtype),
        "operands": [[name, count] for name, count in sorted(formats.items())],  # as in JSON
        **({} if model.vocab_kept is None else {"vocab_kept": model.vocab_kept}),
        "isa": isa(),
        **(
            {"gpu": torch.cuda.get_device_name(model.device)} if model.device.type == "cuda" else {}
        ),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "code": python_digest(),
        **(
            {
                "kernels": source_digest(),
                "prefetch": prefetch_bytes(),
                "prefetch_32": prefetch_bytes_32(),
            }
            if extension() is not None
            else {"kernels": "none"}
        ),
    }


def _table_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "step-cost" / f"{digest}.json"


def _read_table(path: Path, key: dict[str, Any]) -> StepCost | None:
    """The stored table for `key`, or None (none stored, another key, or unreadable)."""
    try:
        raw = json.loads(path.read_text())
        if raw["key"] != key:
            return None
        return StepCost(
            tuple(int(r) for r in raw["rows"]),
            tuple(float(x) for x in raw["seconds"]),
            float(raw["per_seq"]),
            float(raw["per_masked"]),
        )
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return None


def _write_table(path: Path, key: dict[str, Any], table: StepCost) -> None:
    text = json.dumps(
        {
            "key": key,
            "rows": table.rows,
            "seconds": table.seconds,
            "per_seq": table.per_seq,
            "per_masked": table.per_masked,
        },
        indent=1,
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache costs a re-measure next start, nothing else
        log.warning("could not store the step-cost table at %s: %s", path, exc)


def model_cost(model: LanguageModel) -> StepCost:
    """`model`'s step-cost table, measured once per machine: kept while the model object
    lives, and on disk under `cache_dir()/step-cost/`, keyed by `cost_key` (a new model,
    format, thread count, CPU or kernel build measures again, ~20 s for a 1.5B model on this
    class of CPU; QUICKDRAFT_REMEASURE_COST=1 forces it). Only what prices drafts asks for
    it: adaptive speculation. The engine's calibration corrects a stored table that the host's
    load has since made wrong, as it does a freshly measured one."""
    table = _TABLES.get(model)
    if table is not None:
        return table
    key = cost_key(model)
    path = _table_path(key)
    table = None if os.environ.get(REMEASURE_ENV) == "1" else _read_table(path, key)
    if table is None:
        table = measure_step_cost(model)
        _write_table(path, key, table)
    _TABLES[model] = table
    return table


def known_cost(model: LanguageModel) -> StepCost | None:
    """The table `model_cost` holds for `model`, without measuring one."""
    return _TABLES.get(model)


def use_cost(model: LanguageModel, table: StepCost) -> None:
    """Price `model` by `table` from now on instead of measuring (a table measured before)."""
    _TABLES[model] = table
