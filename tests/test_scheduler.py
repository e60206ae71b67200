"""quickdraft.engine.scheduler against a fake runner: budgets, chunked prefill, joining and
leaving, cancellation and draft slots. No model: caches are counters and tokens are made up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from quickdraft.config import SpeculativeConfig
from quickdraft.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from quickdraft.engine.sequence import SeqStatus, Sequence
from quickdraft.request import FinishReason, Request, SamplingParams
from quickdraft.speculation.cost import StepCost, StepShape
from quickdraft.speculation.drafters.base import Draft
from quickdraft.speculation.drafters.ngram import NgramDrafter
from quickdraft.speculation.policy import BatchPolicy, Candidate
from quickdraft.speculation.sampling import TokenRng
from quickdraft.speculation.state import Speculation
from quickdraft.tokenizer import Tokenizer


class ProfileDrafter:
    """A drafter the policy prices by the request's acceptance profile, as it prices a draft
    model (a scored lookup would be looked up first, and these made-up tokens never repeat).
    The harness makes its drafts up itself, so nothing asks this one for any."""

    needs_hidden = hidden_history = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.forwards: list[StepShape] = []

    def new_state(self, prompt_ids: list[int], tenant: str = "") -> None:
        return None

    def propose(self, jobs: object) -> list[Draft]:
        raise AssertionError("the harness drafts itself")

    def commit(self, state: object, tokens: list[int], hidden: object) -> None:
        pass

    def free(self, state: object) -> None:
        pass


class FakeCache:
    def __init__(self, capacity: int) -> None:
        self.length = 0
        self.capacity = capacity

    def reserve(self, num_new: int) -> None:
        pass

    def commit(self, length: int) -> None:
        self.length = length

    def nbytes(self) -> int:
        return 0


class Harness:
    """A scheduler plus a fake runner that accepts `accept` drafts per cycle."""

    def __init__(self, tokenizer: Tokenizer, config: SchedulerConfig, accept: int = 0) -> None:
        self.tokenizer = tokenizer
        self.caches: list[FakeCache] = []
        self.sched = Scheduler(config, self._new_cache, lambda: StepCost((1, 64), (1.0, 1.0)), 512)
        self.accept = accept
        self.plans: list[StepPlan] = []

    def _new_cache(self, capacity: int) -> FakeCache:
        self.caches.append(FakeCache(capacity))
        return self.caches[-1]

    def add(self, prompt_len: int, max_tokens: int, spec: Speculation | None = None) -> Sequence:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request([65 + i % 20 for i in range(prompt_len)], params, self.tokenizer, (2,))
        seq = Sequence(req, spec, TokenRng(0))
        self.sched.add(seq)
        return seq

    def step(self) -> StepPlan:
        plan = self.sched.schedule()
        self.plans.append(plan)
        for item in plan.items:
            seq = item.seq
            assert seq.cache is not None
            accepted = min(item.k, self.accept)
            seq.cache.commit(seq.cache.length + item.num_tokens + accepted)
            if item.samples:
                made_up = [70 + (seq.num_tokens + i) % 10 for i in range(accepted + 1)]
                self.sched.postprocess(item, made_up, item.k, accepted)
        return plan


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def test_scheduler_chunks_long_prefill_without_stalling_decodes(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer, SchedulerConfig(4, max_step_tokens=32, max_prefill_with_decodes=8))
    a, b = h.add(3, 40), h.add(4, 40)
    h.step()  # both prompts in one step
    assert a.decoding and b.decoding
    long = h.add(50, 5)
    chunks = []
    while not long.request.output_ids:
        plan = h.step()
        rows = {id(i.seq): i.num_tokens for i in plan.items}
        assert rows[id(a)] == 1 and rows[id(b)] == 1  # the decodes run every step
        chunks.append(rows[id(long)])
        assert plan.num_rows <= 32
    assert chunks == [8, 8, 8, 8, 8, 8, 2]
    # alone, a prompt takes the whole budget per step
    h2 = Harness(tokenizer, SchedulerConfig(1, max_step_tokens=16))
    solo = h2.add(40, 2)
    assert [h2.step().items[0].num_tokens for _ in range(3)] == [16, 16, 8]
    assert len(solo.request.output_ids) == 1


def test_scheduler_joins_in_order_up_to_max_running_and_frees_at_once(
    tokenizer: Tokenizer,
) -> None:
    h = Harness(tokenizer, SchedulerConfig(max_running=2, max_step_tokens=64))
    seqs = [h.add(5, n) for n in (2, 6, 3, 4)]
    finished_order = []
    while h.sched.has_work:
        before = {id(s) for s in h.sched.running}
        h.step()
        assert len(h.sched.running) <= 2
        for s in seqs:
            if s.request.finished and s not in finished_order:
                assert id(s) in before  # it ran in the step that finished it ...
                assert s not in h.sched.running and s.cache is None  # ... and left at once
                finished_order.append(s)
    assert [len(s.request.output_ids) for s in seqs] == [2, 6, 3, 4]
    admitted = [i.seq for p in h.plans for i in p.items if i.num_tokens == 5]
    assert admitted == seqs  # FIFO admission
    assert all(s.status == SeqStatus.FINISHED for s in seqs)
    assert len(h.caches) == 4


def test_scheduler_abort_frees_waiting_and_running(tokenizer: Tokenizer) -> None:
    freed = []

    class CountingNgram(NgramDrafter):
        def free(self, state: object) -> None:
            freed.append(state)
            super().free(state)  # type: ignore[arg-type]

    spec = Speculation(SpeculativeConfig(method="ngram"), CountingNgram(), None)
    h = Harness(tokenizer, SchedulerConfig(max_running=1, max_step_tokens=64))
    running, waiting = h.add(5, 50, spec), h.add(5, 50, spec)
    h.step()
    h.step()
    assert running.status == SeqStatus.RUNNING and waiting.status == SeqStatus.WAITING
    h.sched.abort(waiting)
    assert waiting not in h.sched.waiting and waiting.cache is None
    h.sched.abort(running)
    assert not h.sched.has_work and running.cache is None and running.spec is None
    assert len(freed) == 1  # only the admitted one had drafter state
    assert running.request.finish_reason == FinishReason.ABORT
    assert waiting.request.finish_reason == FinishReason.ABORT
    h.sched.abort(running)  # idempotent


def test_scheduler_drafts_only_while_decoding_within_room_and_budget(
    tokenizer: Tokenizer,
) -> None:
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    spec = Speculation(cfg, NgramDrafter(), None)
    h = Harness(tokenizer, SchedulerConfig(max_running=2, max_step_tokens=8), accept=1)
    a, b = h.add(3, 7, spec), h.add(3, 30, spec)
    first = h.step()
    assert [i.k for i in first.items] == [0, 0]  # prefill steps never draft
    sums = []
    while a.status == SeqStatus.RUNNING:
        out_before = {id(s): len(s.request.output_ids) for s in (a, b)}
        plan = h.step()
        assert plan.num_rows <= 8
        for item in plan.items:
            room = item.seq.request.params.max_tokens - out_before[id(item.seq)] - 1
            assert 0 <= item.k <= min(4, room)  # never drafts past max_tokens
        sums.append(sum(i.k for i in plan.items))
    assert sums[0] == 6 and max(sums) <= 6  # 2 decode rows + 6 draft rows = the budget
    assert min(sums) < 6  # near its end `a` had less room than its k
    assert len(a.request.output_ids) == 7 and a.request.finish_reason == FinishReason.LENGTH


def test_scheduler_config_rejects_budget_below_batch() -> None:
    with pytest.raises(ValueError, match="max_step_tokens"):
        SchedulerConfig(max_running=8, max_step_tokens=4)


@pytest.mark.parametrize(("accept", "catch_up", "remaining"), [(2, 2, 16), (1, 1, 17)])
def test_scheduler_tells_the_policy_catch_up_and_tokens_left(
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    accept: int,
    catch_up: int,
    remaining: int,
) -> None:
    """A request's first draft needs its whole context fed to the drafter; after a drafting
    step only the newest token, and the last draft too when all were accepted (a draft model
    feeds d_1..d_{k-1}); `remaining` is what max_tokens still allows."""
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=2)
    spec = Speculation(cfg, ProfileDrafter(), None)
    h = Harness(tokenizer, SchedulerConfig(max_running=1, max_step_tokens=16), accept=accept)
    seq = h.add(5, 20, spec)
    h.step()  # prefill: the first token
    seen: list[tuple[int, int]] = []
    choose = BatchPolicy.choose

    def spy(self: BatchPolicy, cands: list[Candidate], *args: Any) -> list[int]:
        seen.extend((c.catch_up, c.remaining) for c in cands)
        return choose(self, cands, *args)

    monkeypatch.setattr(BatchPolicy, "choose", spy)
    h.step()
    h.step()
    assert h.plans[1].items[0].k == 2  # a flat cost: the ceiling
    assert seen[0] == (6, 19)  # 5 prompt tokens + 1 output, none seen by the drafter yet
    assert seen[1] == (catch_up, remaining)  # the step drafted 2 and emitted accept + 1
    assert seq.spec is not None and seq.spec.synced == seq.num_tokens - catch_up
