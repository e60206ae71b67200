"""Relaxed thinking-phase acceptance: which verify rows may accept a draft leniently.

Stage: between the target forward and `verify` (engine/spec_cycle.py), per request. Opt-in and
LOSSY (TensorRT-LLM's "relaxed acceptance"): inside a reasoning block, `<think>` ... `</think>`,
the exact wording matters less than the answer after it, so a draft the target would reject is
kept when it is among the verify row's top-k logits and within `delta` of its argmax
(verify.py `relaxed_ok`, `RelaxedThinking`). Outside the block, verification stays exact.

Contract:
  think_tokens(tokenizer)        the model's block markers: `<think>` / `</think>` as single
                                 tokens of its vocabulary (Qwen3, QwQ, DeepSeek-R1 ship them as
                                 added tokens), or None, and then nothing is ever relaxed
  ThinkScan.inside(tokens)       whether the committed tokens end inside a block: the last
                                 marker among them is `<think>` (a template that opens the block
                                 in the prompt counts; one that writes `<think></think>` to turn
                                 thinking off leaves it closed). Incremental: each committed
                                 token is scanned once.
  lenient_rows(inside, draft)    per draft position i: whether row i (which judges d_i) may be
                                 lenient. Its state is the committed tokens + d_1..d_{i-1}: the
                                 row is inside when that state is, and d_i is not `</think>`
                                 itself (a draft closing the block is always verified strictly),
                                 so every row after a closing draft is strict too.
"""

from __future__ import annotations

from dataclasses import dataclass

from quickdraft.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    open: int
    close: int


def think_tokens(tokenizer: Tokenizer) -> ThinkTokens | None:
    """`<think>` and `</think>` when both are single tokens of `tokenizer`, else None."""
    ids = [tokenizer.token_id(text) for text in (THINK_OPEN, THINK_CLOSE)]
    if ids[0] is None or ids[1] is None:
        return None
    return ThinkTokens(ids[0], ids[1])


@dataclass(slots=True)
class ThinkScan:
    """Whether a request's committed tokens end inside a reasoning block, kept incrementally
    (committed tokens only grow: the rejected drafts never reach it)."""

    think: ThinkTokens
    scanned: int = 0  # committed tokens already looked at
    is_inside: bool = False

    def inside(self, tokens: list[int]) -> bool:
        assert len(tokens) >= self.scanned, "committed tokens never shrink"
        for t in tokens[self.scanned :]:
            if t == self.think.open:
                self.is_inside = True
            elif t == self.think.close:
                self.is_inside = False
        self.scanned = len(tokens)
        return self.is_inside


def lenient_rows(inside: bool, draft: list[int], think: ThinkTokens) -> list[bool]:
    """Per draft position: may its row accept leniently (module docstring)."""
    rows = []
    for token in draft:
        rows.append(inside and token != think.close)
        if token == think.open:
            inside = True
        elif token == think.close:
            inside = False
    return rows
