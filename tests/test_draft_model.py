"""Draft-model drafter: a packed batch of jobs drafts exactly what each job drafts alone; a
restricted draft vocabulary scores its kept ids exactly as before and keeps greedy output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from parity import PROMPTS, forced_draft, greedy_parity

from quickdraft.config import SpeculativeConfig
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


FORMATS = ["fp32", "bf16-panels", "int8", "int4"]


def restricted_pair(directory: Path, fmt: str) -> tuple[Any, Any]:
    """The same tiny model loaded twice in `fmt`; the second scores ids [0, 96) and 300, 301."""
    dtype = "fp32" if fmt == "fp32" else "bf16"
    quant = fmt if fmt in ("int8", "int4") else "none"
    full = load(str(directory), dtype, progress=False, quantization=quant).model
    cut = load(str(directory), dtype, progress=False, quantization=quant).model
    cut.restrict_vocab_(90, [300, 301, 5])  # 90 -> 96 (whole panels); 5 is kept already
    return full, cut


@pytest.mark.parametrize("fmt", FORMATS)
def test_restricted_vocab_scores_the_kept_ids_as_before(tiny_model_dir: Path, fmt: str) -> None:
    """The kept prefix of the head is the same rows in the same format: those logits are the
    unrestricted model's bit for bit; the extra ids' rows are dequantized (close); every other
    id is -inf, so it can never be drafted."""
    full, cut = restricted_pair(tiny_model_dir, fmt)
    assert cut.vocab_kept == 98 and full.vocab_kept is None
    ids = torch.tensor([3, 17, 42, 99, 250, 7])
    a = full(ids, [full.new_cache(16)], [6], logit_rows=torch.arange(6)).logits
    b = cut(ids, [cut.new_cache(16)], [6], logit_rows=torch.arange(6)).logits
    assert b.shape == a.shape
    assert torch.equal(b[:, :96], a[:, :96])
    torch.testing.assert_close(b[:, [300, 301]], a[:, [300, 301]], atol=0.05, rtol=0.05)
    others = torch.ones(a.shape[1], dtype=torch.bool)
    others[:96], others[[300, 301]] = False, False
    assert bool((b[:, others] == float("-inf")).all())


def test_restricted_vocab_draft_keeps_greedy_output_and_its_own_cost_table(
    tiny_model_dir: Path, near_draft_dir: Path
) -> None:
    """A draft model scoring 160 of 320 ids: speculation still equals plain decoding, drafts
    are still accepted, and its step-cost table is another than the full head's."""
    from quickdraft.speculation.cost import cost_key
    from quickdraft.speculation.factory import make_speculation

    lm = load(str(tiny_model_dir), "fp32", progress=False)
    cfg = SpeculativeConfig(
        method="draft",
        num_draft_tokens=3,
        draft_model=str(near_draft_dir),
        draft_quantization="none",
        draft_vocab=160,
        adaptive=False,
    )
    spec = make_speculation(lm, cfg)
    assert spec is not None
    drafter = spec.drafter
    assert isinstance(drafter, DraftModelDrafter) and drafter.model.vocab_kept == 160 + len(
        [i for i in lm.eos_ids if i >= 160]
    )
    full = load(str(near_draft_dir), "fp32", progress=False).model
    assert cost_key(drafter.model) != cost_key(full)
    texts = ["the cat sat on the mat. the cat sat on the", "abcabcabcabcabc"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert greedy_parity(lm, texts, params, spec)[1] > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_draft_model_stops_where_its_chain_probability_falls_below_min_prob(
    tiny_model_dir: Path, temperature: float
) -> None:
    """With `min_prob`, a draft ends at the first token whose chain probability (the draft
    model's, of the draft so far) is below it: the same tokens as drafting all k, cut there,
    and no forward run past the cut."""
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    drafter = DraftModelDrafter(lm.model, lm.model.config.vocab_size)
    params = SamplingParams(temperature=temperature, top_k=8)
    k = 6
    cuts = set()
    for text in ("hello world", "abc", "the cat sat on the mat", "zq"):
        seq = lm.tokenizer.encode(text)
        full = drafter.propose(
            [DraftJob(drafter.new_state(seq), seq, k, params, torch.Generator().manual_seed(1))]
        )[0]
        # the chain probabilities of the full draft, from the model itself
        ids = torch.tensor(seq + full.tokens)
        logits = lm.model(
            ids, [lm.model.new_cache(len(ids))], [len(ids)], logit_rows=torch.arange(len(ids))
        )
        rows = logits.logits[len(seq) - 1 : len(seq) - 1 + k]
        if temperature == 0.0:
            probs = torch.softmax(rows, -1)
        else:
            assert full.p_draft is not None
            probs = full.p_draft
        chain = torch.cumprod(probs[torch.arange(k), full.tokens], 0).tolist()
        low, high = sorted(chain)[k // 2 - 1 : k // 2 + 1]
        min_prob = (low + high) / 2  # a floor inside this draft's range, off its values
        want = next((j + 1 for j, c in enumerate(chain) if c < min_prob), k)
        cuts.add(want)
        job = DraftJob(drafter.new_state(seq), seq, k, params, torch.Generator().manual_seed(1))
        job.min_prob = min_prob
        cut = drafter.propose([job])[0]
        assert cut.tokens == full.tokens[:want], (text, chain, min_prob)
        assert len(drafter.forwards) == want  # the catch-up rides on the first position's
    assert cuts != {k}, cuts  # some drafts were cut


def test_device_chain_drafts_what_the_token_by_token_loop_drafts(
    tiny_model_dir: Path, near_draft_dir: Path
) -> None:
    """The GPU's draft chain (argmax kept on the device, tokens read back once per propose)
    gives greedy jobs of different k the drafts, forwards, fed tokens and cache lengths of the
    per-token loop, across proposes with commits between; and speculation on it stays
    lossless end to end."""
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    runs = []
    for chain in (True, False):
        drafter = DraftModelDrafter(lm.model, lm.model.config.vocab_size)
        drafter.device_chain = chain
        seqs = [lm.tokenizer.encode(t) for t in ("hello world", "abcabc", "the cat sat")]
        states = [drafter.new_state(s) for s in seqs]
        seen = []
        for round_ in range(3):
            jobs = [
                DraftJob(st, seq, k, SamplingParams(), torch.Generator())
                for st, seq, k in zip(states, seqs, (1 + round_, 4, 2), strict=True)
            ]
            drafts = drafter.propose(jobs)
            seen.append(([d.tokens for d in drafts], list(drafter.forwards)))
            for st, seq, d in zip(states, seqs, drafts, strict=True):
                seq.extend([*d.tokens[:1], 7])  # the target kept one draft, then its own token
                drafter.commit(st, seq)
        seen.append([(st.fed, st.cache.length) for st in states])
        runs.append(seen)
    assert runs[0] == runs[1]
    from quickdraft.speculation.factory import make_speculation

    spec = make_speculation(lm, forced_draft(near_draft_dir, 4))
    assert spec is not None and isinstance(spec.drafter, DraftModelDrafter)
    spec.drafter.device_chain = True
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    assert greedy_parity(lm, PROMPTS[:4], params, spec)[1] > 0
