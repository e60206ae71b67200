"""quickdraft.engine + core: the request API (submit / iterate / cancel / queue limit) and
continuous batching on a tiny fp32 model: concurrent greedy outputs equal single-request ones
with and without speculation, cancellation frees everything, a failing request leaves the
engine serving, a dead engine thread shows as not alive."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_checks import needs_kernel
from torch import Tensor

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import (
    Engine,
    EngineDeadError,
    QueueFullError,
    ServedModel,
    stream,
)
from quickdraft.engine.core import EngineCore
from quickdraft.engine.engine import release_openmp_workers
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.loading import LoadedModel, load
from quickdraft.request import FinishReason, SamplingParams
from quickdraft.speculation.drafters.base import Draft, DraftJob
from quickdraft.speculation.drafters.ngram import NgramDrafter
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import Speculation

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(",
    "the cat sat on the mat. the cat sat on the",
    "abcabcabcabc",
    # long enough to be prefilled in several chunks while the others decode
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(",
    "1, 2, 3, 4, 5, 6, 7,",
    "zzz yyy xxx zzz yyy",
]
MAX_TOKENS = [24, 40, 17, 30, 33, 21]
# 6 requests > 4 seats: some wait, join later, and chunks of 8 prompt rows join running decodes
SMALL_BATCH = SchedulerConfig(max_running=4, max_step_tokens=48, max_prefill_with_decodes=8)


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


def plain(lm: LoadedModel, ids: list[int], params: SamplingParams) -> list[int]:
    req = lm.new_request(ids, params)
    for _ in stream(lm, req):
        pass
    return req.output_ids


def test_engine_outputs_match_stream_and_end_with_reason(lm: LoadedModel) -> None:
    engine = Engine({"tiny": ServedModel(lm)})
    engine.start()
    try:
        ids = lm.tokenizer.encode("hello")
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        outs = list(engine.submit("tiny", ids, params))
        assert [t for o in outs for t in o.token_ids] == plain(lm, ids, params)
        assert outs[-1].finish_reason == FinishReason.LENGTH
        assert all(o.finish_reason is None for o in outs[:-1])
        assert outs[-1].completion_tokens == 20 and outs[-1].prompt_tokens == len(ids)
    finally:
        engine.stop()
    assert not engine.alive


@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_engine_concurrent_greedy_equals_single_request(
    lm: LoadedModel, near_draft_dir: Path, method: str
) -> None:
    cfg = {
        "off": SpeculativeConfig(),
        "ngram": SpeculativeConfig(
            method="ngram", num_draft_tokens=4, ngram_min=1, ngram_max=3, adaptive=False
        ),
        "draft": SpeculativeConfig(
            method="draft", num_draft_tokens=3, draft_model=str(near_draft_dir), adaptive=False
        ),
    }[method]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    ids = [lm.tokenizer.encode(p) for p in PROMPTS]
    expected = [plain(lm, i, p) for i, p in zip(ids, params, strict=True)]
    engine = Engine({"tiny": ServedModel(lm, cfg)}, scheduler=SMALL_BATCH)
    engine.start()
    try:
        handles = [engine.submit("tiny", i, p) for i, p in zip(ids, params, strict=True)]
        outs = [list(h) for h in handles]
    finally:
        engine.stop()
    got = [[t for o in out for t in o.token_ids] for out in outs]
    assert got == expected
    stats = engine.step_stats["tiny"]
    assert stats.max_batch == 4  # requests really ran together
    if method != "off":
        drafted = sum(out[-1].spec.drafted for out in outs)
        accepted = sum(out[-1].spec.accepted for out in outs)
        assert accepted > 0 and drafted > accepted  # verify and rollback both exercised
        assert stats.draft_rows == drafted and stats.accepted == accepted


def engine_outputs(
    lm: LoadedModel, cfg: SpeculativeConfig, ids: list[list[int]], params: list[SamplingParams]
) -> tuple[list[list[Any]], Engine]:
    """Every request's outputs, all submitted at once to one engine with small prompt chunks."""
    engine = Engine({"tiny": ServedModel(lm, cfg)}, scheduler=SMALL_BATCH)
    engine.start()
    try:
        handles = [engine.submit("tiny", i, p) for i, p in zip(ids, params, strict=True)]
        return [list(h) for h in handles], engine
    finally:
        engine.stop()


def tokens(outs: list[Any]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@needs_kernel
@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_engine_bf16_concurrent_greedy_equals_single_request(
    bf16_pair: tuple[Path, Path], method: str, kernels_enabled: None
) -> None:
    """bf16 on the kernels: a request decoded in a batch of 4 (its prompt in chunks of up to 48
    or 8 rows, other requests' prompt chunks joining its steps, drafts of others verified
    beside its own) gets the tokens it gets alone with speculation off, its prompt prefilled in
    one forward: every op's result for a row is independent of the rows that share its
    forward."""
    target_dir, draft_dir = bf16_pair
    lm16 = load(str(target_dir), "bf16", progress=False)
    cfg = {
        "off": SpeculativeConfig(),
        "ngram": SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False),
        "draft": SpeculativeConfig(
            method="draft",
            num_draft_tokens=3,
            draft_model=str(draft_dir),
            draft_quantization="none",
            adaptive=False,
        ),
    }[method]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    ids = [lm16.tokenizer.encode(p) for p in PROMPTS]
    alone = [plain(lm16, i, p) for i, p in zip(ids, params, strict=True)]
    together, engine = engine_outputs(lm16, cfg, ids, params)
    assert [tokens(outs) for outs in together] == alone
    assert engine.step_stats["tiny"].max_batch == 4  # requests really ran together
    if method != "off":
        assert sum(outs[-1].spec.accepted for outs in together) > 0


def test_engine_async_cancel_frees_the_request(lm: LoadedModel) -> None:
    engine = Engine({"tiny": ServedModel(lm)})
    engine.start()

    async def consume() -> list[FinishReason | None]:
        handle = engine.submit(
            "tiny", lm.tokenizer.encode("abc"), SamplingParams(max_tokens=200, ignore_eos=True)
        ).bind_loop()
        reasons = []
        async for out in handle:
            reasons.append(out.finish_reason)
            handle.cancel()
        return reasons

    try:
        reasons = asyncio.run(consume())
        assert reasons[-1] == FinishReason.ABORT and len(reasons) < 200
        assert engine.num_running == 0
        outs = list(engine.submit("tiny", [1, 2, 3], SamplingParams(max_tokens=3)))
        assert outs[-1].finished  # the engine still serves after a cancellation
    finally:
        engine.stop()


def test_engine_cancel_many_mid_stream_leaks_nothing(lm: LoadedModel) -> None:
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=3, ngram_min=1, adaptive=False)
    engine = Engine({"tiny": ServedModel(lm, cfg)}, scheduler=SMALL_BATCH)
    engine.start()
    try:
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        handles = [engine.submit("tiny", lm.tokenizer.encode(p), params) for p in PROMPTS * 2]
        for h in handles:  # cancel each once it streams (or while it still waits)
            h.cancel()
        ends = [list(h)[-1] for h in handles]
        assert all(o.finish_reason == FinishReason.ABORT for o in ends)
        assert all(o.completion_tokens < 300 for o in ends)
        assert engine.num_running == 0 and engine.num_waiting == 0
        ids = lm.tokenizer.encode("hello")
        small = SamplingParams(max_tokens=12, ignore_eos=True)
        after = list(engine.submit("tiny", ids, small))
        assert [t for o in after for t in o.token_ids] == plain(lm, ids, small)
    finally:
        engine.stop()


def test_core_abort_frees_caches_and_drafter_state(lm: LoadedModel) -> None:
    spec = make_speculation(lm, SpeculativeConfig(method="ngram", adaptive=False))
    core = EngineCore(lm, SMALL_BATCH)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    seqs = [core.add(lm.new_request(lm.tokenizer.encode(p), params), spec) for p in PROMPTS]
    for _ in range(6):
        core.step()
    running = list(core.scheduler.running)
    assert running and all(s.cache is not None and s.spec is not None for s in running)
    for seq in seqs:
        core.abort(seq)
    assert not core.has_work
    assert all(s.cache is None and s.spec is None for s in seqs)
    assert all(s.request.finish_reason == FinishReason.ABORT for s in seqs)
    assert core.step() == []


POISON = [300, 301, 302]  # a prompt of ids the tokenizer never produces


class PoisonedNgram(NgramDrafter):
    """Fails any propose() whose batch holds the poisoned request: the engine must fail that
    request alone."""

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        if any(job.tokens[: len(POISON)] == POISON for job in jobs):
            raise RuntimeError("poisoned drafter state")
        return super().propose(jobs)


class EngineKiller(BaseException):
    """Not an Exception: no request-level handler catches it, so the engine thread dies."""


class KillingNgram(NgramDrafter):
    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        raise EngineKiller("boom")


def forced_ngram(drafter: NgramDrafter) -> Speculation:
    return Speculation(SpeculativeConfig(method="ngram", adaptive=False), drafter, None)


def test_engine_failing_request_is_isolated_and_engine_serves_on(lm: LoadedModel) -> None:
    served = ServedModel(lm, SpeculativeConfig(method="ngram"), forced_ngram(PoisonedNgram()))
    engine = Engine({"tiny": served}, scheduler=SMALL_BATCH)
    engine.start()
    try:
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        good_ids = [lm.tokenizer.encode(p) for p in PROMPTS[:3]]
        bad = engine.submit("tiny", POISON, params)
        good = [engine.submit("tiny", i, params) for i in good_ids]
        with pytest.raises(RuntimeError, match="poisoned"):
            list(bad)
        got = [[t for o in h for t in o.token_ids] for h in good]
        assert got == [plain(lm, i, params) for i in good_ids]
        assert engine.alive and engine.step_stats["tiny"].failed == 1
        again = list(engine.submit("tiny", good_ids[0], params))
        assert again[-1].finish_reason == FinishReason.LENGTH
    finally:
        engine.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_engine_thread_death_makes_alive_false(lm: LoadedModel) -> None:
    served = ServedModel(lm, SpeculativeConfig(method="ngram"), forced_ngram(KillingNgram()))
    engine = Engine({"tiny": served})
    engine.start()
    handle = engine.submit("tiny", [65, 66, 67], SamplingParams(max_tokens=20, ignore_eos=True))
    with pytest.raises(EngineDeadError):
        list(handle)
    assert engine._thread is not None
    engine._thread.join(5)
    assert not engine.alive and isinstance(engine.error, EngineKiller)
    with pytest.raises(EngineDeadError):
        engine.submit("tiny", [65], SamplingParams())


class HiddenRecorder:
    """An n-gram drafter that declares `needs_hidden` and records what commit() receives."""

    name = "hidden-recorder"
    needs_hidden = True
    hidden_history = True
    hidden_layers: tuple[int, ...] = ()  # the post-final-norm hidden

    def __init__(self) -> None:
        self.ngram = NgramDrafter(1, 3)
        self.records: dict[tuple[int, ...], list[tuple[int, Tensor]]] = {}  # prompt -> commits

    def new_state(
        self, prompt_ids: list[int], tenant: str = ""
    ) -> tuple[Any, list[tuple[int, Tensor]]]:
        record = self.records.setdefault(tuple(prompt_ids), [])
        return self.ngram.new_state(prompt_ids, tenant), record

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        inner = [DraftJob(j.state[0], j.tokens, j.k, j.params, j.generator) for j in jobs]
        return self.ngram.propose(inner)

    def commit(self, state: Any, tokens: list[int], hidden: Tensor | None) -> None:
        assert hidden is not None
        state[1].append((len(tokens), hidden.clone()))  # [n, hidden]

    def free(self, state: Any) -> None:
        self.ngram.free(state[0])


def test_engine_hidden_states_reach_drafter_once_per_committed_position(
    lm: LoadedModel,
) -> None:
    """Chunked prefill, batching and rollback: the rows a needs_hidden drafter receives are
    the target's hidden states of positions [len(tokens) - 1 - n, len(tokens) - 1), each
    committed position exactly once, equal to a full forward's."""
    recorder = HiddenRecorder()
    spec = Speculation(SpeculativeConfig(method="ngram", adaptive=False), recorder, None)
    core = EngineCore(lm, SMALL_BATCH)
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    seqs = [core.add(lm.new_request(lm.tokenizer.encode(p), params), spec) for p in PROMPTS[:4]]
    while core.has_work:
        core.step()
    assert sum(s.request.spec.accepted for s in seqs) > 0
    model = lm.model
    for seq in seqs:
        tokens = seq.request.all_ids
        rows, position = [], 0
        for length, hidden in recorder.records[tuple(seq.request.prompt_ids)]:
            assert length - 1 - len(hidden) == position  # contiguous: each position once
            rows.append(hidden)
            position = length - 1
        assert position == len(tokens) - 1  # every committed position but the last one
        cache = model.new_cache(len(tokens))
        full = model(torch.tensor(tokens), [cache], [len(tokens)], return_hidden=True).hidden
        assert full is not None  # [len(tokens), hidden]
        torch.testing.assert_close(torch.cat(rows), full[:-1], atol=1e-4, rtol=1e-4)


def test_engine_release_openmp_workers_keeps_torch_working(lm: LoadedModel) -> None:
    if not torch.backends.openmp.is_available():
        pytest.skip("torch without OpenMP")
    x = torch.ones(256, 256)
    (x @ x).sum()  # a parallel region: this thread now has an OpenMP pool
    assert release_openmp_workers()
    ids = lm.tokenizer.encode("hello")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    first = plain(lm, ids, params)
    assert release_openmp_workers()  # the pool came back for the decode; free it again
    assert plain(lm, ids, params) == first


def test_engine_rejects_unknown_model_and_full_queue(lm: LoadedModel) -> None:
    engine = Engine({"tiny": ServedModel(lm)}, max_waiting=0)
    engine.start()
    try:
        with pytest.raises(ValueError, match="unknown model 'nope'"):
            engine.submit("nope", [1], SamplingParams())
        with pytest.raises(QueueFullError):
            engine.submit("tiny", [1], SamplingParams())
    finally:
        engine.stop()
