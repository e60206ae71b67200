"""Sampling: turn target logits into a token, identically for plain decode, drafters and verify.

`probabilities()` applies, in this order, temperature -> top-k -> top-p -> min-p and returns the
distribution that is actually sampled from; speculative verification compares exactly these
distributions, so filtering can never make verification lossy. temperature == 0 means greedy.
"""

from __future__ import annotations

import secrets

import torch
from torch import Tensor

from quickdraft.request import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """SplitMix64's output function (Steele et al. 2014): a 64-bit bijective mixer."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class TokenRng:
    """One request's randomness, in two parts.

    `race(position, vocab)`: the Exp(1) vector that picks the output token at `position` (its
    index in the request's output) by `sample_with`. It is a function of (seed, position)
    alone, so a token sampled this way does not depend on what was drafted before it, how
    many drafts a step had, or whether speculation was on: seeded sampling with speculation
    off and with one-hot drafts (n-gram) emits the same tokens (see `verify.verify_sampled`).
    Each position's vector decides one emitted token, once, so the draws stay independent.
    `generator`: one sequential stream for draws whose number depends on the run: a draft
    model's samples, the accept uniforms and recovered/bonus tokens against a draft
    distribution.
    """

    @classmethod
    def for_params(cls, params: SamplingParams, device: torch.device | str = "cpu") -> TokenRng:
        """A request's randomness: its `seed`, or a fresh one when unseeded."""
        return cls(secrets.randbits(63) if params.seed is None else params.seed, device)

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._race = torch.Generator(device=device)
        self._key = _splitmix64(seed & _MASK64)

    def race(self, position: int, vocab: int) -> Tensor:
        """Exp(1) draws `[1, vocab]` for output position `position` (>= 0)."""
        self._race.manual_seed(_splitmix64(self._key ^ position) >> 1)  # 63 bits: any torch
        return torch.empty(1, vocab, device=self.device).exponential_(1.0, generator=self._race)


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits `[N, vocab]` -> the sampling distribution `[N, vocab]` (fp32, rows sum to 1).

    For greedy params this is the one-hot argmax, so greedy is the temperature->0 limit and
    rejection sampling against it reduces to exact matching.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shift the max to 0 before dividing: a tiny temperature then sends every other logit to
    # -inf instead of the max to +inf (inf - inf = NaN in softmax). A temperature that is 0
    # in fp32 (< 1.4e-45) would still give 0 / 0 at the max, so the max is set, not divided.
    shifted = logits - logits.amax(-1, keepdim=True)  # [N, vocab], <= 0
    logits = torch.where(shifted == 0, 0.0, shifted / params.temperature)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(top_p_drop(probs, params.top_p), 0.0)
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(-1, keepdim=True)


# Top-p first looks among this many likeliest tokens: a full sort of SmolLM2's 49,152-token
# row cost ~4.4 ms a row here (one thread), top-1024 ~0.45 ms.
TOP_P_CANDIDATES = 1024


def top_p_drop(probs: Tensor, top_p: float) -> Tensor:
    """probs `[N, vocab]` -> `[N, vocab]` bool, the tokens top-p drops: a token whose
    likelier tokens' mass (strictly before it, in descending order) already reaches `top_p`;
    the likeliest is always kept (a top_p that is 0 in fp32, e.g. 5e-324, would otherwise drop
    it too). `reference_top_p_drop` sorts the whole row. Here a row whose TOP_P_CANDIDATES
    likeliest tokens hold the mass with room to spare ranks only them and drops every other
    token: the same set (the full sort's running sums begin with the same values; the margin
    covers its rounding past them). Other rows (flat ones) are sorted whole."""
    if probs.shape[-1] <= 2 * TOP_P_CANDIDATES:
        return reference_top_p_drop(probs, top_p)
    top, order = probs.topk(TOP_P_CANDIDATES, dim=-1)  # descending
    total = top.cumsum(-1)
    drop_top = total - top >= top_p
    drop_top[:, 0] = False
    drop = torch.ones_like(probs, dtype=torch.bool).scatter(-1, order, drop_top)
    flat = total[:, -1] < top_p + 1e-5  # the nucleus may reach past the candidates
    if bool(flat.any()):
        drop[flat] = reference_top_p_drop(probs[flat], top_p)
    return drop


def reference_top_p_drop(probs: Tensor, top_p: float) -> Tensor:
    """`top_p_drop` by a full sort of every row."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    drop_sorted[..., 0] = False
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """probs `[N, vocab]` -> token ids `[N]`.

    Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i exactly
    (the Gumbel-max trick in another form), in two vectorised passes; torch.multinomial costs
    ~20 ms on a 150k-token row here.
    """
    return sample_with(probs, torch.empty_like(probs).exponential_(1.0, generator=generator))


def sample_with(probs: Tensor, race: Tensor) -> Tensor:
    """probs `[N, vocab]`, race `[N, vocab]` of Exp(1) draws -> token ids `[N]`."""
    return (probs / race).argmax(-1)
