"""Structured outputs: a request's grammar (JSON object, JSON schema, regex, EBNF, tool calls)
compiled by xgrammar for one tokenizer, and a matcher per request that says which tokens may
come next.

Why xgrammar: its per-token mask costs 0.008 ms mean (0.09 max) against llguidance's 0.077
mean (4.2 max) on the structured-output set's schemas with the Qwen2.5 vocabulary, 2-core EPYC
(bench/grammar_backends.py, docs/structured.md).

`Grammar` is the request's description (frozen, hashable: it lives in `SamplingParams`);
`GrammarCompiler.compile` turns it into a compiled grammar (cached by xgrammar per source
string) and raises `GrammarError` for a schema / regex / grammar xgrammar refuses; a `Matcher`
walks one request's tokens: `fill` writes the next token's bitmask, `apply` masks logits by
it, `accept` / `rollback` move it, which is what speculative verification needs
(speculation/logits.py).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from quickdraft.tokenizer import Tokenizer

GrammarKind = Literal["json_object", "json_schema", "regex", "ebnf", "tool_calls"]

# Hermes / Qwen2.5 tool-call syntax, `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`:
# xgrammar's structural tag for it is registered as "qwen_3" (Qwen3 kept Qwen2.5's format)
TOOL_FORMAT = "qwen_3"


class GrammarError(ValueError):
    """A grammar that cannot be compiled; `param` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Grammar:
    """What the output must match. `source`: the JSON schema (JSON text), the regex, the EBNF,
    or for `tool_calls` the JSON list of allowed tools ({"name", "parameters"}) and whether
    several calls may follow each other (`parallel`)."""

    kind: GrammarKind
    source: str = ""
    param: str = "response_format"  # the request field it came from (for 400s)
    parallel: bool = True

    @classmethod
    def tool_calls(
        cls, tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool
    ) -> Grammar:
        """`tools` / `tool_choice` in the Chat Completions shape; `tool_choice` "required" or
        a named function (an "auto" choice is not constrained)."""
        source = json.dumps({"tools": tools, "tool_choice": tool_choice}, sort_keys=True)
        return cls("tool_calls", source, "tool_choice", parallel)


class GrammarCompiler:
    """One tokenizer's xgrammar compiler; thread-safe (the server compiles off the event loop,
    the engine thread builds matchers)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr  # imported here: a server without structured outputs never pays

        self._xgr = xgr
        self.vocab_size = vocab_size
        # xgrammar reads the vocabulary (byte-level or sentencepiece) from a transformers view
        # of the same tokenizer.json; ids past the tokenizer's vocabulary (padding rows of the
        # embedding) are never allowed
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(stop_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> Any:
        """The compiled grammar (xgrammar caches it per source); GrammarError if refused."""
        xgr = self._xgr
        try:
            with self._lock:
                if grammar.kind == "json_object":
                    return self._compiler.compile_builtin_json_grammar()
                if grammar.kind == "json_schema":
                    return self._compiler.compile_json_schema(grammar.source, any_whitespace=False)
                if grammar.kind == "regex":
                    return self._compiler.compile_regex(grammar.source)
                if grammar.kind == "ebnf":
                    return self._compiler.compile_grammar(grammar.source)
                spec = json.loads(grammar.source)
                tag = xgr.get_model_structural_tag(
                    TOOL_FORMAT,
                    tools=spec["tools"],
                    tool_choice=spec["tool_choice"],
                    reasoning="disabled",
                    parallel_tool_calls=grammar.parallel,
                    max_whitespace_cnt=2,  # a model can pad JSON with whitespace forever
                )
                return self._compiler.compile_structural_tag(tag)
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            what = {"regex": "regex", "ebnf": "grammar"}.get(grammar.kind, "JSON schema")
            msg = f"{grammar.param}: invalid {what}: {_first_line(exc)}"
            raise GrammarError(msg, grammar.param) from None

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(self, self.compile(grammar))


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its time stamp and C++ source location."""
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:300]


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, compiler: GrammarCompiler, compiled: Any) -> None:
        xgr = compiler._xgr
        self.vocab_size = compiler.vocab_size
        self._m = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self._fill = xgr.allocate_token_bitmask  # [rows, ceil(vocab / 32)] int32
        self._apply = xgr.apply_token_bitmask_inplace

    def bitmask(self, rows: int) -> Tensor:
        return self._fill(rows, self.vocab_size)

    def fill(self, bitmask: Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and no move) if the grammar does not allow it."""
        return bool(self._m.accept_token(token))

    def rollback(self, n: int) -> None:
        if n > 0:
            self._m.rollback(n)

    def forced_text(self) -> str:
        """The longest text every continuation allowed from here starts with (a JSON key the
        schema requires next, the punctuation around it); "" where there is a choice."""
        return str(self._m.find_jump_forward_string())

    def apply(self, logits: Tensor, bitmask: Tensor) -> None:
        """Set the logits `[rows, vocab]` (fp32) of the tokens `bitmask` disallows to -inf, in
        place."""
        self._apply(logits, bitmask, vocab_size=self.vocab_size)

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())
