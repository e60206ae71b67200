"""Draft-model drafter: a packed batch of jobs drafts exactly what each job drafts alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quickdraft.loading import load
from quickdraft.request import SamplingParams
from quickdraft.speculation.cost import StepShape
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.drafters.draft_model import DraftModelDrafter


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_draft_model_batched_propose_equals_one_by_one(
    tiny_model_dir: Path, temperature: float
) -> None:
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    drafter = DraftModelDrafter(lm.model, lm.model.config.vocab_size)
    seqs = [lm.tokenizer.encode(t) for t in ("hello world", "abc", "the cat sat on the mat")]
    ks = [3, 1, 5]
    params = SamplingParams(temperature=temperature)

    def jobs(states: list[object], seed: int) -> list[DraftJob]:
        return [
            DraftJob(st, seq, k, params, torch.Generator().manual_seed(seed + i))
            for i, (st, seq, k) in enumerate(zip(states, seqs, ks, strict=True))
        ]

    batched_states = [drafter.new_state(s) for s in seqs]
    single_states = [drafter.new_state(s) for s in seqs]
    for cycle in range(3):  # later cycles resync after the previous drafts were rejected
        batched = drafter.propose(jobs(batched_states, 10 * cycle))
        single = [drafter.propose([j])[0] for j in jobs(single_states, 10 * cycle)]
        assert [d.tokens for d in batched] == [d.tokens for d in single]
        assert [len(d.tokens) for d in batched] == ks
        for b, s in zip(batched, single, strict=True):
            if temperature == 0.0:
                assert b.p_draft is None and s.p_draft is None
            else:
                assert b.p_draft is not None and s.p_draft is not None
                torch.testing.assert_close(b.p_draft, s.p_draft)
        # the target "accepted" the first draft and added one token of its own
        for i, d in enumerate(batched):
            seqs[i] = [*seqs[i], d.tokens[0], 7]
        for st, seq in zip(batched_states + single_states, seqs + seqs, strict=True):
            drafter.commit(st, seq, None)


def test_draft_model_lists_the_forwards_of_each_propose(tiny_model_dir: Path) -> None:
    """The engine times a draft phase against the drafter's cost table for the forwards that
    phase ran (`forwards`): a prompt catch-up, the per-position steps, an idle phase fed whole
    or in chunks, and several requests packed into one forward."""
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    drafter = DraftModelDrafter(lm.model, lm.model.config.vocab_size)
    seq = lm.tokenizer.encode("the cat sat on the mat, the cat sat on the mat")
    state = drafter.new_state(seq)
    drafter.propose([DraftJob(state, seq, 1, SamplingParams(), torch.Generator())])
    assert drafter.forwards == [StepShape(len(seq), 1, 1)]  # the prompt, masked
    draft = drafter.propose([DraftJob(state, seq, 3, SamplingParams(), torch.Generator())])
    assert len(draft[0].tokens) == 3
    assert drafter.forwards == [StepShape(1, 1, 0)] * 3  # resync of 1 token + 2 more steps
    seq = [*seq, *range(40, 60)]  # an idle phase: 20 committed tokens the drafter never saw
    other = lm.tokenizer.encode("a dog ran in the park")
    fresh = drafter.new_state(other)
    pairs = ((state, seq), (fresh, other))
    drafter.propose([DraftJob(s, t, 2, SamplingParams(), torch.Generator()) for s, t in pairs])
    # packed: the idle phase and the new prompt, then one row each
    assert drafter.forwards == [StepShape(20 + len(other), 2, 2), StepShape(2, 2, 0)]
