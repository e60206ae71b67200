"""What a request does to the target's logits before sampling, position by position, so that a
verify step sees exactly what sequential decoding would: logit bias, repetition / frequency /
presence penalties, a grammar mask; and the logprobs it reports.

Contract (SpecCycle calls these for one request per step):
  cut(draft)                  the longest prefix of a draft the grammar allows (the rest could
                              never be accepted: verify would mask it out)
  forced(draft, n)            tokens of the text the grammar forces after the draft (JSON keys,
                              punctuation): appended to a short draft, free to propose
  apply(logits, draft)        `[k + 1, vocab]` target rows for inputs [last, d_1..d_k] -> the
                              rows sampling sees: row i is shaped with the output as it would be
                              after d_1..d_i were accepted (penalty counts, grammar state), which
                              is what plain decoding computes at that position
  commit(tokens)              the step's emitted tokens (accepted drafts + one), after verify
  logprobs(raw, tokens, n)    each emitted token's log-probability in the RAW target row that
                              chose it (before bias, penalties, temperature, grammar: vLLM's
                              default "raw_logprobs"), with the top n of that row
Row i of the target's verify logits equals its plain-decode logits bit for bit (the kernels are
batch-invariant, docs/numerics.md), and everything here is elementwise per row, so greedy output
is identical with speculation on and off, and sampling is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from quickdraft.grammar import Matcher
from quickdraft.request import SamplingParams, TokenLogprob


class LogitControls:
    """One request's logit shaping; `matcher` is its grammar position (None: no grammar)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        vocab: int,
        matcher: Matcher | None = None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        """`encode`: text -> token ids (plain text, no special tokens), for `forced`."""
        self.params = params
        self.vocab = vocab
        self.matcher = matcher
        self.encode = encode
        # ids were checked against the vocabulary with the request (LoadedModel.new_request)
        assert all(t < vocab for t, _ in params.logit_bias), "logit_bias id beyond the vocabulary"
        self.bias: Tensor | None = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab)
            for token, value in params.logit_bias:
                self.bias[token] = value
        self.penalize = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self.repetition = params.repetition_penalty
        # output counts (frequency / presence; repetition: with the prompt's tokens)
        self.counts = torch.zeros(vocab)
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool)
        valid = [t for t in prompt_ids if t < vocab]
        if valid:
            self.in_prompt[torch.tensor(valid)] = True

    def forced(self, draft: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens of the text the grammar forces after `draft` (which it
        allows): free drafts, since the target can only follow them (its tokenization of the
        text may still differ: then verification stops there, as for any draft)."""
        m = self.matcher
        if m is None or self.encode is None or limit <= 0:
            return []
        walked = self._walk(draft)
        out: list[int] = []
        text = "" if m.terminated else m.forced_text()
        for tok in self.encode(text)[:limit] if text else []:
            if not m.accept(tok):
                break
            out.append(tok)
        m.rollback(walked + len(out))
        return out

    def _walk(self, tokens: list[int]) -> int:
        """Advance the matcher by `tokens` while it allows them and has not ended (a drafted
        stop token ends it); return how many it took, for the rollback."""
        m = self.matcher
        assert m is not None
        n = 0
        while n < len(tokens) and not m.terminated and m.accept(tokens[n]):
            n += 1
        return n

    def cut(self, draft: list[int]) -> int:
        """How many leading draft tokens the grammar allows (all of them without a grammar)."""
        m = self.matcher
        if m is None:
            return len(draft)
        n = self._walk(draft)  # nothing after a stop token: the request ends there
        m.rollback(n)
        return n

    def apply(self, logits: Tensor, draft: list[int]) -> Tensor:
        """`logits` `[k + 1, vocab]` -> shaped fp32 rows (a new tensor); `draft` the k tokens
        (all allowed by the grammar: `cut` ran first)."""
        return self._shape(logits, draft, 0)

    def shape_next(self, logits: Tensor, drafted: list[int]) -> Tensor:
        """A drafter's `[1, vocab]` row for the position after its `drafted` tokens, shaped as
        the target's will be there: drafts then follow the grammar and the penalties too."""
        return self._shape(logits, drafted, len(drafted))

    def _shape(self, logits: Tensor, draft: list[int], first: int) -> Tensor:
        """Row j of `logits` is the position after draft[: first + j] (committed output first);
        len(draft) >= first + rows - 1."""
        rows = logits.float().clone()
        n = rows.shape[0]
        if self.bias is not None:
            rows += self.bias
        if self.repetition != 1.0 or self.penalize:
            # per row: the state after the drafts before it; only draft columns differ by row
            counts = self.counts.expand(n, -1).clone()
            for i, d in enumerate(draft[: first + n - 1]):
                counts[max(0, i + 1 - first) :, d] += 1
            if self.repetition != 1.0:
                r = self.repetition
                seen = self.in_prompt | (counts > 0)
                rows = torch.where(seen, torch.where(rows > 0, rows / r, rows * r), rows)
            if self.penalize:
                p = self.params
                rows -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        m = self.matcher
        if m is not None and not m.terminated:  # terminated: only with ignore_eos; free text
            walked = self._walk(draft[:first])
            mask = m.bitmask(n)
            for i in range(n):
                if m.terminated:  # a row after a drafted stop token: never sampled from
                    break
                m.fill(mask, i)
                if i < n - 1:
                    walked += self._walk(draft[first + i : first + i + 1])
            m.rollback(walked)
            m.apply(rows, mask)
        return rows

    def commit(self, tokens: list[int]) -> None:
        """The tokens a step emitted (in order): counts and the grammar advance by them."""
        for t in tokens:
            if t < self.vocab:
                self.counts[t] += 1
            if self.matcher is not None and not self.matcher.terminated:
                self.matcher.accept(t)


def token_logprobs(
    raw: Tensor, tokens: list[int], top: int, ranks: bool = False
) -> list[TokenLogprob]:
    """raw `[len(tokens), vocab]` target rows (row i chose tokens[i]) -> per token its
    log-probability and the `top` most likely tokens of its row."""
    logp = torch.log_softmax(raw.float(), dim=-1)  # [n, vocab]
    picked = logp.gather(1, torch.tensor(tokens)[:, None])  # [n, 1]
    # `ranks`: each token's 1 + the tokens more likely (a pass over the vocabulary; 0: not asked)
    rank = ((logp > picked).sum(dim=-1) + 1).tolist() if ranks else [0] * len(tokens)
    chosen = picked[:, 0].tolist()
    if top > 0:
        values, ids = logp.topk(top, dim=-1)
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        tops = [tuple(zip(i, v, strict=True)) for i, v in pairs]
    else:
        tops = [() for _ in tokens]
    rows = zip(tokens, chosen, tops, rank, strict=True)
    return [TokenLogprob(t, lp, tp, r) for t, lp, tp, r in rows]
