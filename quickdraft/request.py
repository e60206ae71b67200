"""A generation request and its output bookkeeping: EOS, stop strings, max_tokens.

`Request.append(ids)` takes the tokens a step produced (one, or a whole accepted speculative
block) and consumes them one by one, stopping exactly at the first EOS / stop string / max_tokens:
tokens after that point are dropped, the text is cut at the stop string, and the text that could
still be the start of a stop string is held back from streaming until it is resolved.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import StrEnum

from torch import Tensor

from quickdraft.grammar import Grammar
from quickdraft.images import ImageLayout
from quickdraft.tokenizer import IncrementalDetokenizer, Tokenizer

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0  # |bias|, OpenAI's range
MAX_RELAXED_TOP_K = 64  # relaxed thinking acceptance: the widest top-k a request may ask for
POOLINGS = ("last", "mean", "cls")  # how an embedding request pools its prompt's rows


class SamplingError(ValueError):
    """An invalid sampling parameter; `param` names it (the HTTP edge's 400 `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RelaxedThinking:
    """Relaxed (lossy, opt-in) acceptance inside a reasoning block (speculation/relaxed.py): a
    draft the target would reject is kept when it is among the verify row's `top_k` logits and
    within `delta` of the row's largest. top_k 0: off (strict verification everywhere)."""

    top_k: int = 0
    delta: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.top_k <= MAX_RELAXED_TOP_K:
            raise SamplingError(
                f"relaxed_thinking.top_k must be in [0, {MAX_RELAXED_TOP_K}], got {self.top_k}",
                "relaxed_thinking",
            )
        if not (0.0 <= self.delta <= 1e4):  # also refuses NaN
            raise SamplingError(
                f"relaxed_thinking.delta must be in [0, 1e4] logits, got {self.delta}",
                "relaxed_thinking",
            )

    @property
    def enabled(self) -> bool:
        return self.top_k > 0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request samples (quickdraft/speculation/sampling.py applies them). temperature 0
    is greedy; top_k 0, top_p 1 and min_p 0 are off.

    Applied to the target's logits before those, at every position, with the output as of that
    position (speculation/logits.py): `logit_bias` ((token id, bias) pairs, added), then
    `repetition_penalty` (prompt and output tokens, 1 = off), `frequency_penalty` /
    `presence_penalty` (output tokens, 0 = off), then the `grammar` mask. `logprobs`: how many
    top alternatives to report per output token (0: the chosen token's only; None: off);
    `prompt_logprobs` the same for the prompt's tokens (the prefill then scores every row and
    skips the prefix cache, whose rows were never scored).
    `relaxed_thinking`: this request's relaxed acceptance inside a reasoning block (None: the
    model's `SpeculativeConfig.relaxed_thinking`; `RelaxedThinking()`: off). `pooling`: an
    embedding request (/v1/embeddings): the prefill also pools the prompt's post-final-norm
    hidden rows into `Request.embedding` ("last": the last row, "mean": their mean, "cls": the
    first; the two that read more than the last row skip the prefix cache, as prompt_logprobs
    does); the one token it samples is not the point."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: end the output like an EOS, ignore_eos or not
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    grammar: Grammar | None = None
    relaxed_thinking: RelaxedThinking | None = None
    skip_special_tokens: bool = True  # False: the text keeps them (gpt-oss's harmony markers)
    pooling: str | None = None  # "last" / "mean" / "cls": pool the prompt's hidden rows

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, rule: str) -> None:
            if not ok:
                raise SamplingError(f"{param} must be {rule}, got {getattr(self, param)!r}", param)

        check(self.max_tokens >= 1, "max_tokens", ">= 1")
        t = self.temperature
        check(0.0 <= t <= 2.0 and not math.isnan(t), "temperature", "in [0, 2]")
        check(self.top_k >= 0, "top_k", ">= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
        check(all(self.stop), "stop", "non-empty strings")
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(-2.0 <= v <= 2.0 and not math.isnan(v), name, "in [-2, 2]")
        r = self.repetition_penalty
        check(0.0 < r <= 10.0 and not math.isnan(r), "repetition_penalty", "in (0, 10]")
        check(
            all(
                t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS and not math.isnan(b)
                for t, b in self.logit_bias
            ),
            "logit_bias",
            f"token ids >= 0 with biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            check(lp is None or 0 <= lp <= MAX_TOP_LOGPROBS, name, f"in [0, {MAX_TOP_LOGPROBS}]")
        check(self.pooling in (None, *POOLINGS), "pooling", f"one of {', '.join(POOLINGS)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_every_prompt_row(self) -> bool:
        """Whether every prompt row must run (none from the prefix cache): its logprobs are
        reported, or its pooling reads more than the last row."""
        return self.prompt_logprobs is not None or self.pooling in ("mean", "cls")

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the target's logits before sampling (bias, penalties,
        grammar)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.grammar is not None
        )


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """An output token's log-probability under the target's raw distribution, with the
    `top` most likely tokens of that position ((id, logprob), most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0  # 1 + the tokens more likely than it (0: not computed)


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens
    ABORT = "abort"  # cancelled by the client


@dataclass(slots=True)
class Timing:
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.created


@dataclass(slots=True)
class SpecStats:
    """Speculation telemetry of one request (vLLM's counting: accepted excludes the bonus)."""

    method: str = "none"
    cycles: int = 0  # target forwards after prefill (each emits >= 1 token)
    drafted: int = 0
    accepted: int = 0
    # accepted drafts that strict verification would have rejected (relaxed thinking-phase
    # acceptance; included in `accepted`)
    relaxed: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [pos] -> times accepted
    drafted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # method "adaptive": drafter name -> [cycles it drafted in, drafted, accepted]
    drafters: dict[str, list[int]] = field(default_factory=dict)

    def record(
        self, num_drafted: int, num_accepted: int, num_relaxed: int = 0, drafter: str = ""
    ) -> None:
        """One verify cycle; `drafter`: which drafter of an adaptive request drafted it."""
        self.cycles += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.relaxed += num_relaxed
        if drafter and num_drafted:
            counts = self.drafters.setdefault(drafter, [0, 0, 0])
            counts[0] += 1
            counts[1] += num_drafted
            counts[2] += num_accepted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target forward, bonus included: 1 + accepted / cycles."""
        return 1.0 + self.accepted / self.cycles if self.cycles else 0.0

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "method": self.method,
            "cycles": self.cycles,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "relaxed_accepted": self.relaxed,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": self.accepted_per_position,
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
        }
        if self.drafters:
            out["drafters"] = {k: list(v) for k, v in self.drafters.items()}
        return out

    def summary(self) -> str:
        return (
            f"spec={self.method} drafted {self.drafted} accepted {self.accepted} "
            f"(relaxed {self.relaxed}) "
            f"({100 * self.acceptance_rate:.0f}%) AL {self.mean_acceptance_length:.2f} "
            f"cycles {self.cycles} draft {self.draft_seconds:.2f}s "
            f"verify {self.verify_seconds:.2f}s"
        )


class Request:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        eos_ids: tuple[int, ...],
        request_id: str = "",
        tenant: str = "",
        images: ImageLayout | None = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        # the prompt's images (their placeholder rows are `prompt_ids`' image tokens), if any
        self.images = images
        # the prompt as the prefix cache keys its blocks: an image's placeholder rows carry its
        # content digest (`ImageLayout.keys`), so another image behind the same ids never matches
        self.prompt_keys = prompt_ids if images is None else images.keys(prompt_ids)
        self.id = request_id
        self.tenant = tenant  # who sent it: drafters share what they learn only within one
        self.prompt_ids = prompt_ids
        self.params = params
        self.eos_ids = (() if params.ignore_eos else eos_ids) + params.stop_token_ids
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # per output id, when params.logprobs is set
        # per prompt id after the first, when params.prompt_logprobs is set (its prefill rows)
        self.prompt_logprobs: list[TokenLogprob] = []
        # params.pooling: the prompt's pooled hidden rows (fp32 [hidden]; a sum until the last
        # prompt row ran, for "mean"), set by the prefill (engine/spec_cycle.py `pool`)
        self.embedding: Tensor | None = None
        self.text = ""
        self.sent = 0  # chars of `text` already handed out by stream_delta()
        self.finish_reason: FinishReason | None = None
        # what ended a STOP (vLLM's `stop_reason`): a stop string, a `stop_token_ids` id, or
        # None for the model's own end of generation
        self.stop_reason: str | int | None = None
        self.timing = Timing()
        self.spec = SpecStats()
        self._detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._max_stop = max((len(s) for s in params.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def key_ids(self) -> list[int]:
        """`all_ids` as the prefix cache keys blocks (`prompt_keys`, then the output)."""
        return self.prompt_keys + self.output_ids

    def append(self, ids: list[int], logprobs: list[TokenLogprob] | None = None) -> int:
        """Consume generated ids in order (with their logprobs, if reported); return how many
        were kept (<= len(ids))."""
        if self.timing.first_token is None:
            self.timing.first_token = time.perf_counter()
        kept = 0
        for tok in ids:
            if self.finished:
                break
            kept += 1
            if tok in self.eos_ids:
                if tok in self.params.stop_token_ids:
                    self.stop_reason = tok
                self._finish(FinishReason.STOP)
                break
            self.output_ids.append(tok)
            if logprobs is not None:
                self.logprobs.append(logprobs[kept - 1])
            old_len = len(self.text)
            self.text += self._detok.push(tok)
            if self._max_stop and self._cut_at_stop(old_len):
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self._finish(FinishReason.LENGTH)
        return kept

    def abort(self) -> None:
        if not self.finished:
            self._finish(FinishReason.ABORT)

    def stream_delta(self) -> str:
        """New text safe to show: excludes a tail that may still become a stop string."""
        end = len(self.text)
        if not self.finished and self._max_stop:
            end -= self._pending_stop_prefix()
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def _cut_at_stop(self, old_len: int) -> bool:
        search_from = max(0, old_len - self._max_stop + 1)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        at, self.stop_reason = min(hits)
        self.text = self.text[:at]
        self._finish(FinishReason.STOP)
        return True

    def _pending_stop_prefix(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        text = self.text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.params.stop):
                return n
        return 0

    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.timing.finished = time.perf_counter()
