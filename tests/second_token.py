"""The end-to-end distribution check every drafter's sampled test runs: the second emitted
token's histogram over many sampled requests against its exact marginal under the target,
sum_t1 p(t1) p(t2 | t1), by a chi-square test at ~p = 0.001."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from quickdraft.engine import stream
from quickdraft.loading import LoadedModel
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.sampling import probabilities
from quickdraft.speculation.state import Speculation

# ids -> the target's sampling distribution `[vocab]` of the token after them, and the output
# so far (what the request's controls count): the plain model with `params` by default
Distribution = Callable[[list[int], list[int]], Tensor]


def plain_distribution(lm: LoadedModel, params: SamplingParams) -> Distribution:
    model = lm.model

    def dist(ids: list[int], out: list[int]) -> Tensor:
        o = model(torch.tensor(ids), [model.new_cache(len(ids) + 1)], [len(ids)])
        return probabilities(o.logits, params)[0]

    return dist


def second_token_marginal(dist: Distribution, prompt: list[int], at: int = 1) -> Tensor:
    """Exact distribution `[vocab]` of the second emitted token (or of the one at index
    `at`: every path before it is enumerated, so keep the support small, e.g. top_k)."""
    return _marginal(dist, prompt, [], at)


def _marginal(dist: Distribution, prompt: list[int], out: list[int], at: int) -> Tensor:
    p = dist([*prompt, *out], out)
    if len(out) == at:
        return p
    marginal = torch.zeros_like(p)
    for t in p.nonzero().flatten().tolist():
        marginal += p[t] * _marginal(dist, prompt, [*out, t], at)
    return marginal


def assert_second_token_follows(
    lm: LoadedModel,
    spec: Speculation | None,
    prompt: list[int],
    params: Callable[[int], SamplingParams],
    marginal: Tensor,
    n: int,
    at: int = 1,
) -> list[Request]:
    """Run `n` requests (`params(i)` each, e.g. seed i) and chi-square their second tokens
    (or those at index `at`) against `marginal`; returns the requests (for acceptance
    checks)."""
    counts = torch.zeros_like(marginal)
    reqs = []
    for i in range(n):
        req = lm.new_request(prompt, params(i))
        for _ in stream(lm, req, spec):
            pass
        counts[req.output_ids[at]] += 1
        reqs.append(req)
    support = marginal > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = marginal[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5 + 10, (chi2, dof)  # ~p < 0.001 for these dof
    return reqs
