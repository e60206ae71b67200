"""Verify stage: decide which drafted tokens the target keeps. Pure tensor functions, no model code.

Contract: the target has scored the inputs `[last_committed, d_1..d_k]` in one forward, giving
k + 1 rows (row i predicts the token after input i). A `Verdict` holds the accepted draft prefix
followed by exactly one token chosen by the target, so every cycle emits >= 1 token and the
emitted sequence is distributed exactly as plain decoding from the target would be.

Glossary (vLLM's vocabulary):
  draft      the proposed tokens d_1..d_k, from any drafter.
  target     the model being served; its filtered sampling distribution is `p_target`.
  p_draft    the drafter's distribution each d_i was sampled from; None = one-hot at d_i
             (n-gram lookup, argmax drafts).
  accepted   draft tokens kept. EXCLUDES the extra token below.
  recovered  the target's token at the first rejection (replaces the rejected d_i).
  bonus      the target's extra token from row k when all k drafts were accepted.
  mean acceptance length (AL) = tokens emitted per target forward = 1 + accepted / cycles.
  lenient    per draft position, whether the relaxed rule may keep d_i although strict
             verification rejects it (`relaxed_ok`; relaxed thinking-phase acceptance,
             speculation/relaxed.py decides which rows may be lenient at all).
  relaxed    accepted drafts that only the relaxed rule kept (counted within `accepted`).

`verify` is the one entry point: greedy requests take `verify_greedy` (exact matching against
the argmax), sampled ones `verify_sampled` (lossless rejection sampling, Leviathan et al. 2023,
arXiv 2211.17192; Chen et al. 2023), which given one-hot (greedy) `p_target` returns exactly
what `verify_greedy` returns.

Relaxed acceptance (opt-in, LOSSY): with a `lenient` mask, a draft strict verification rejects
is kept where `lenient[i]` holds (the draft is among row i's top-k logits, within delta of its
argmax). Greedy rows: accept if d_i is the argmax, else if lenient. Sampled rows: the strict
test first (the rejection-sampling draw), and on its rejection the draft is still kept if
lenient and the request's own filters (top-k/top-p/min-p, grammar) give it probability > 0;
otherwise the recovered token comes from the usual residual. So the relaxed rule only ever turns
a rejection into an acceptance, and `Verdict.relaxed` counts exactly those. Without a mask (or
an all-False one) every function below is the lossless one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quickdraft.kernels.pointwise import greedy_pick
from quickdraft.request import SamplingParams, TokenLogprob
from quickdraft.speculation.sampling import TokenRng, probabilities, sample, sample_with


@dataclass(slots=True)
class Verdict:
    tokens: list[int]  # accepted drafts + ONE recovered-or-bonus token: len == accepted + 1
    accepted: int  # draft tokens kept (the extra token is not counted)
    bonus: bool  # True when all drafts were accepted, i.e. tokens[-1] came from row k
    logprobs: list[TokenLogprob] | None = None  # per token, when the request reports them
    relaxed: int = 0  # of `accepted`, the drafts only the relaxed rule kept


def relaxed_ok(
    draft: list[int], target_logits: Tensor, rows: list[bool], top_k: int, delta: float
) -> list[bool]:
    """Per draft position i: `rows[i]` (the row may be lenient) and d_i is among row i's
    `top_k` largest logits and within `delta` of the row's largest. `target_logits`
    `[k + 1, vocab]` as verified (after the request's logit controls, before temperature)."""
    k = len(draft)
    if not any(rows):
        return [False] * k
    logits = target_logits[:k].float()  # [k, vocab]
    at_draft = logits.gather(1, torch.tensor(draft, device=logits.device)[:, None])[:, 0]  # [k]
    top = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values  # [k, top_k], descending
    ok = (at_draft >= top[:, -1]) & (top[:, 0] - at_draft <= delta)  # [k]
    return [r and bool(o) for r, o in zip(rows, ok.tolist(), strict=True)]


def verify(
    draft: list[int],
    p_draft: Tensor | None,
    target_logits: Tensor,
    params: SamplingParams,
    rng: TokenRng,
    position: int,
    lenient: list[bool] | None = None,
) -> Verdict:
    """The target's `[k + 1, vocab]` logits for inputs [last, d_1..d_k] -> accepted drafts + one
    token, by the request's sampling params; `p_draft` `[k, vocab]` or None (one-hot drafts);
    `position`: the output index of the first token emitted; `lenient`: see the module
    docstring (None: strict)."""
    if params.greedy:
        return verify_greedy(draft, target_logits, lenient)
    p_target = probabilities(target_logits, params)
    return verify_sampled(draft, p_draft, p_target, rng, position, lenient)


def verify_greedy(
    draft: list[int], target_logits: Tensor, lenient: list[bool] | None = None
) -> Verdict:
    """Accept d_i while it equals the argmax of row i-1 (or `lenient[i]`); then emit the
    argmax of the first row that rejects, or of row k."""
    k = len(draft)
    assert target_logits.dim() == 2 and target_logits.shape[0] == k + 1, (
        f"need [k + 1, vocab] target logits for k={k}, got {tuple(target_logits.shape)}"
    )
    # One argmax over all rows and one device sync; the compare is k python ints.
    target_ids: list[int] = greedy_pick(target_logits)[0].tolist()  # [k + 1]
    accepted = relaxed = 0
    while accepted < k and draft[accepted] == target_ids[accepted]:
        accepted += 1
    if lenient is None or not any(lenient):
        # The accepted drafts equal the target's argmaxes: the verdict is a prefix of target_ids.
        return Verdict(target_ids[: accepted + 1], accepted, bonus=accepted == k)
    while accepted < k and (draft[accepted] == target_ids[accepted] or lenient[accepted]):
        relaxed += draft[accepted] != target_ids[accepted]
        accepted += 1
    tokens = [*draft[:accepted], target_ids[accepted]]
    return Verdict(tokens, accepted, bonus=accepted == k, relaxed=relaxed)


def verify_sampled(
    draft: list[int],
    p_draft: Tensor | None,
    p_target: Tensor,
    rng: TokenRng,
    position: int,
    lenient: list[bool] | None = None,
) -> Verdict:
    """Rejection sampling of `draft` against the target (lossless without `lenient`).

    p_target `[k + 1, vocab]`: the target's filtered distributions (`sampling.probabilities`).
    p_draft `[k, vocab]` (same filtering) or None for drafters without a distribution.
    position: the output index the first emitted token will have.

    With p_draft: accept d_i with probability min(1, p_target[i-1, d_i] / p_draft[i-1, d_i]);
    at the first rejection sample the recovered token from normalize(max(p_target - p_draft,
    0)); if all are accepted sample the bonus from p_target[k]. RNG use is fixed: k uniforms,
    then one draw, all from `rng.generator`, whatever the outcome, so a seeded request replays.

    Without (one-hot drafts, and k = 0): see `verify_one_hot`. `lenient`: the module docstring.
    """
    k = len(draft)
    assert p_target.dim() == 2 and p_target.shape[0] == k + 1, (
        f"need [k + 1, vocab] p_target for k={k}, got {tuple(p_target.shape)}"
    )
    if p_draft is None:
        return verify_one_hot(draft, p_target, rng, position, lenient)
    vocab = p_target.shape[-1]
    assert tuple(p_draft.shape) == (k, vocab), (
        f"need [k, vocab] p_draft for k={k}, got {tuple(p_draft.shape)}"
    )
    device = p_target.device
    # Flat offsets of (row i-1, d_i): one index tensor serves both [k(+1), vocab] tables.
    at_draft = torch.tensor(
        [i * vocab + d for i, d in enumerate(draft)], dtype=torch.long, device=device
    )  # [k]
    # k scalars each, fetched in one sync; the accept loop below is plain python over k floats.
    target_at_draft: list[float] = torch.take(p_target, at_draft).tolist()  # p_target[i-1, d_i]
    draft_at_draft: list[float] = torch.take(p_draft, at_draft).tolist()
    generator = rng.generator
    u: list[float] = torch.rand(k, generator=generator, device=device).tolist()  # in [0, 1)

    accepted = relaxed = 0
    while accepted < k:
        pt, pd = target_at_draft[accepted], draft_at_draft[accepted]
        # p_draft[d_i] == 0: the drafter proposed a token it gave no probability, so d_i was
        # not sampled from that row (sampling never draws a zero-probability token). The only
        # proposal we can still be lossless for is a deterministic one, so the row is treated
        # as one-hot at d_i: accept with probability p_target[d_i], recover from p_target with
        # d_i zeroed. Accepting whenever p_target[d_i] > 0 (the q -> 0 limit of the ratio)
        # would emit d_i with probability 1 here.
        ratio = pt / pd if pd > 0.0 else pt
        # Strict `<`: P(u < r) = min(r, 1) exactly for u in [0, 1), and a token the target
        # filtered out (ratio 0) is never accepted, even on a draw of exactly 0.0.
        if not u[accepted] < ratio:
            if not (lenient is not None and lenient[accepted] and pt > 0.0):
                break
            relaxed += 1  # rejected by the draw, kept by the relaxed rule
        accepted += 1

    if accepted == k:
        token = int(sample(p_target[k : k + 1], generator))
        return Verdict([*draft, token], k, bonus=True, relaxed=relaxed)

    row = accepted  # the first rejection: d_{row+1} was judged against p_target[row]
    if draft_at_draft[row] <= 0.0:
        residual = p_target[row].clone()  # [vocab]
        residual[draft[row]] = 0.0
    else:
        residual = (p_target[row] - p_draft[row]).clamp_min(0.0)  # [vocab]
    if residual.sum().item() <= 0.0:
        # p_target <= p_draft everywhere means they are equal, and then a rejection has
        # probability 0; reached only through rounding, where p_target is the right answer.
        residual = p_target[row]
    # multinomial normalises its weights itself: the residual need not be divided by its mass
    token = int(sample(residual[None], generator))  # residual[None]: [1, vocab]
    return Verdict([*draft[:row], token], row, bonus=False, relaxed=relaxed)


def verify_one_hot(
    draft: list[int],
    p_target: Tensor,
    rng: TokenRng,
    position: int,
    lenient: list[bool] | None = None,
) -> Verdict:
    """Rejection sampling of one-hot drafts, coupled to plain sampling.

    Row i samples x_i from p_target[i] with the race of output position `position + i`; d_i is
    accepted iff x_i == d_i, else x_i is the recovered token (after k accepts, x_k the bonus).
    This is the one-hot rule exactly: P(accept d_i) = p_target[i, d_i], and given a rejection
    x_i is distributed as p_target[i] with d_i removed, renormalised, i.e. the residual
    normalize(max(p_target - onehot(d_i), 0)). And every emitted token is the one plain
    sampling with the same seed would emit at its position, whatever was drafted.
    With `lenient`, a row whose x_i != d_i still keeps d_i where lenient[i] and
    p_target[i, d_i] > 0 (relaxed: lossy, module docstring).
    """
    k = len(draft)  # p_target is [k + 1, vocab] (checked by `verify_sampled`)
    vocab = p_target.shape[-1]
    tokens: list[int] = []
    relaxed = 0
    for i in range(k + 1):  # rows are sampled lazily: none past the first rejection
        token = int(sample_with(p_target[i : i + 1], rng.race(position + i, vocab)))
        lenient_row = i < k and lenient is not None and lenient[i]
        if lenient_row and token != draft[i] and float(p_target[i, draft[i]]) > 0.0:
            token = draft[i]
            relaxed += 1
        tokens.append(token)
        if i == k or token != draft[i]:
            return Verdict(tokens, i, bonus=i == k, relaxed=relaxed)
    raise AssertionError("unreachable: row k always returns")
