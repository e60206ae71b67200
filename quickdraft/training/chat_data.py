"""Chat training data for a drafter: instructions made from a local corpus, answered by the
frozen target itself (self-distillation on the target's own replies, the recipe DFlash and
EAGLE-3 train on: a drafter serves chat answers, so it should learn from them).

Stage: the `--data chat` half of `quickdraft train-drafter` (training/corpus.py holds the
plain-text one). Contract:
  instructions(texts, n, seed)       n user messages made from the corpus's texts: for code
                                     (Python sources, parsed) "write / explain / test /
                                     refactor this function", for prose "summarize / explain
                                     this paragraph" and open writing tasks on topics
                                     (words frequent in the corpus); seeded, shuffled
  self_instructions(lm, n, seed)     n user messages written by the target itself (Magpie's
                                     recipe): its chat template's user turn opened with a
                                     common opener ("Write a Python function that", "Explain",
                                     ...) and completed by sampling; deduplicated
  answer(lm, messages, max_answer)   each message chat-templated and answered greedily by the
                                     target (plain decoding, batched by the engine) ->
                                     (prompt ids, answer ids) per message
  chat_corpus(lm, pairs, layers, T)  the conversations run through the target once: TapCorpus
                                     rows of prompt + answer (cut to T), blocks start only
                                     inside the answer (lo = prompt length)
  answered_corpus(lm, messages, max_answer, layers, T)
                                     the two above in one pass: the target answers greedily,
                                     `batch` sequences per forward, and its taps and predictions
                                     are kept as it goes; the same rows, bit for bit (the
                                     kernels are batch-invariant), without the second pass
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from quickdraft.loading import LoadedModel
from quickdraft.models.base import SequenceCache
from quickdraft.request import SamplingParams
from quickdraft.training.corpus import TapCorpus, run_target

MAX_SOURCE_LINES = 40  # longer functions are not quoted whole in an instruction
# sequences the engine decodes at once: SmolLM2-135M answered 439 tok/s at 48 against 386 at 16
# (2-core AMX Xeon; 445 at 96). Greedy answers do not depend on it (batch-invariant kernels).
ANSWER_BATCH = 48
CODE_TASKS = (
    "Write a Python function `{sig}` that {doc}",
    "Implement `{sig}` in Python. {Doc}",
    "Explain what this Python function does:\n\n```python\n{src}\n```",
    "Write pytest unit tests for this function:\n\n```python\n{src}\n```",
    "Refactor this code to make it clearer, and explain your changes:\n\n```python\n{src}\n```",
    "Add type hints and a docstring to this function:\n\n```python\n{src}\n```",
)
TEXT_TASKS = (
    "Summarize the following text in a few sentences:\n\n{par}",
    "Explain this to a beginner:\n\n{par}",
    "Rewrite this paragraph in simpler words:\n\n{par}",
)
TOPIC_TASKS = (
    "Write a short story about a {a} and a {b}.",
    "Write a poem about {a}.",
    "Explain what {a} means in programming, with an example.",
    "Write a friendly email to a colleague about the {a} project.",
    "Give me five tips about {a}.",
    "Describe a day in the life of someone who works with {a} and {b}.",
)


# How a user message may start; the target writes the rest (self_instructions). Code and
# general requests in about equal shares.
OPENERS = (
    "Write a Python function that",
    "Write a Python program that",
    "Write a Python class that",
    "How do I",
    "How can I",
    "Implement",
    "Explain how",
    "What is the difference between",
    "Fix this",
    "Write a short story about",
    "Write a poem about",
    "Explain",
    "Describe",
    "Give me",
    "What are",
    "Write an email",
    "Summarize",
    "Why",
)


def _first_paragraph(doc: str) -> str:
    return re.sub(r"\s+", " ", doc.strip().split("\n\n")[0]).strip()


def _code_items(text: str) -> list[dict[str, str]]:
    """Public functions with a docstring in a Python source: signature, docstring, source."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    items = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 30 or node.end_lineno is None:
            continue
        src = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if node.end_lineno - node.lineno >= MAX_SOURCE_LINES:
            src = ""
        items.append(
            {
                "sig": f"{node.name}({ast.unparse(node.args)})",
                "doc": _first_paragraph(doc),
                "src": src,
            }
        )
    return items


def _paragraphs(text: str, python: bool) -> list[str]:
    """Prose paragraphs: a Python source's docstrings, any other file's blank-line blocks."""
    if python:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            return []
        docs = [
            ast.get_docstring(n) or ""
            for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
        ]
        blocks = [b for d in docs for b in d.split("\n\n")]
    else:
        blocks = text.split("\n\n")
    out = []
    for block in blocks:
        par = re.sub(r"\s+", " ", block).strip()
        if 200 <= len(par) <= 1200 and sum(c.isalpha() for c in par) > 0.7 * len(par):
            out.append(par)
    return out


def instructions(texts: Sequence[str], n: int, seed: int = 0) -> list[str]:
    """`n` user messages from the corpus (module docstring): about a third each code, text and
    topic tasks, as far as the corpus has material for them; ValueError if it has none."""
    rng = random.Random(seed)
    code: list[dict[str, str]] = []
    pars: list[str] = []
    words: Counter[str] = Counter()
    for text in texts:
        python = "def " in text or "import " in text
        if python:
            code.extend(_code_items(text))
        found = _paragraphs(text, python)
        pars.extend(found)
        for par in found:
            words.update(set(re.findall(r"\b[a-z]{5,12}\b", par)))
    # common, not the commonest; ties by the word (set order varies with the hash seed)
    ranked = sorted(words.items(), key=lambda wc: (-wc[1], wc[0]))
    topics = [w for w, _ in ranked[100:600]]
    out: list[str] = []
    for i in range(n):
        kind = i % 3
        if kind == 0 and code:
            item = rng.choice(code)
            tasks = [t for t in CODE_TASKS if item["src"] or "{src}" not in t]
            doc = item["doc"].rstrip(".")
            out.append(
                rng.choice(tasks).format(
                    sig=item["sig"],
                    doc=doc[:1].lower() + doc[1:] + ".",
                    Doc=doc + ".",
                    src=item["src"],
                )
            )
        elif kind == 1 and pars:
            out.append(rng.choice(TEXT_TASKS).format(par=rng.choice(pars)))
        elif len(topics) >= 2:
            a, b = rng.sample(topics, 2)
            out.append(rng.choice(TOPIC_TASKS).format(a=a, b=b))
        elif code or pars:
            out.append(
                rng.choice(TEXT_TASKS).format(par=rng.choice(pars))
                if pars
                else CODE_TASKS[0].format(sig=code[0]["sig"], doc=code[0]["doc"])
            )
    if not out:
        raise ValueError("the corpus has neither Python functions nor prose paragraphs")
    rng.shuffle(out)
    return out


def _require_chat_template(lm: LoadedModel) -> None:
    if lm.tokenizer.chat_template is None:
        raise ValueError("--data chat needs a model with a chat template; use --data text")


def _user_turn_prefix(lm: LoadedModel) -> list[int]:
    """The chat template's ids up to where a user message's text starts (the common prefix of
    two one-message chats that differ only in that text)."""
    _require_chat_template(lm)
    tok = lm.tokenizer
    a = tok.encode_chat([{"role": "user", "content": "a"}])
    b = tok.encode_chat([{"role": "user", "content": "b"}])
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:n]


def self_instructions(
    lm: LoadedModel,
    n: int,
    seed: int = 0,
    max_tokens: int = 64,
    batch: int = ANSWER_BATCH,
    progress: bool = True,
) -> list[str]:
    """Up to `n` user messages written by the target (module docstring): each an opener from
    OPENERS completed by sampling (temperature 1, top-p 0.95, its own seed), at most
    `max_tokens` more tokens; the distinct ones that say more than the opener, in order."""
    tok = lm.tokenizer
    prefix = _user_turn_prefix(lm)
    rng = random.Random(seed)
    openers = [rng.choice(OPENERS) for _ in range(n)]
    prompts = [prefix + tok.encode(o, add_special_tokens=False) for o in openers]
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed * n + i)
        for i in range(n)
    ]
    outputs = _generate(lm, prompts, params, batch, "target instructions", progress)
    seen: set[str] = set()
    out: list[str] = []
    for opener, ids in zip(openers, outputs, strict=True):
        rest = tok.decode([t for t in ids if t not in lm.eos_ids]).rstrip()
        text = (opener + rest).strip()
        if rest.strip() and text not in seen:
            seen.add(text)
            out.append(text)
    return out


def _generate(
    lm: LoadedModel,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    batch: int,
    desc: str,
    progress: bool,
) -> list[list[int]]:
    """Each prompt's output ids, the engine running `batch` at a time."""
    from quickdraft.engine.core import EngineCore
    from quickdraft.engine.scheduler import SchedulerConfig
    from quickdraft.engine.sequence import SeqStatus

    core = EngineCore(lm, SchedulerConfig(max_running=batch))
    seqs = [core.add(lm.new_request(p, sp), None) for p, sp in zip(prompts, params, strict=True)]
    bar = tqdm(total=len(seqs), desc=desc, unit="msg", disable=not progress)
    done = 0
    while core.has_work:
        core.step()
        finished = sum(s.status == SeqStatus.FINISHED for s in seqs)
        bar.update(finished - done)
        done = finished
    bar.close()
    failed = [s.error for s in seqs if s.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(seqs)} failed ({desc}), the first: {failed[0]}")
    return [list(s.request.output_ids) for s in seqs]


def answer(
    lm: LoadedModel,
    messages: Sequence[str],
    max_answer: int,
    batch: int = ANSWER_BATCH,
    progress: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """Each message as a one-turn chat answered greedily by the target (module docstring)."""
    tok = lm.tokenizer
    _require_chat_template(lm)
    prompts = [tok.encode_chat([{"role": "user", "content": m}]) for m in messages]
    params = [SamplingParams(max_tokens=max_answer)] * len(prompts)
    outputs = _generate(lm, prompts, params, batch, "target answers", progress)
    return list(zip(prompts, outputs, strict=True))


def chat_corpus(
    lm: LoadedModel,
    pairs: Sequence[tuple[list[int], list[int]]],
    layers: Sequence[int],
    seq_len: int,
    progress: bool = True,
) -> TapCorpus:
    """The conversations (prompt + answer, cut to `seq_len`; prompts longer than half of it
    keep their tail) through the target (module docstring); rows with fewer than 4 answer
    tokens are dropped."""
    rows, lo, hi = [], [], []
    for prompt, reply in pairs:
        prompt = prompt[-(seq_len // 2) :]
        seq = (prompt + reply)[:seq_len]
        if len(seq) - len(prompt) < 4:
            continue
        rows.append(seq + [0] * (seq_len - len(seq)))
        lo.append(len(prompt))
        hi.append(len(seq))
    if not rows:
        raise ValueError("no answer of 4 tokens or more to train on")
    lengths = torch.tensor(hi)
    corpus = run_target(lm.model, torch.tensor(rows), layers, progress, lengths)
    corpus.lo = torch.tensor(lo)
    return corpus


class _Answering:
    """One conversation being answered by `answered_corpus`: its cache and, per position so
    far, the id, the taps and the target's greedy prediction."""

    def __init__(self, index: int, prompt: list[int], limit: int, cache: SequenceCache) -> None:
        self.index, self.lo, self.limit = index, len(prompt), limit
        self.cache: SequenceCache | None = cache
        self.ids = list(prompt)
        self.taps: list[Tensor] = []
        self.preds: list[Tensor] = []

    def take(self, taps: Tensor, preds: Tensor, eos: Sequence[int]) -> bool:
        """Record the rows just run; True while the answer goes on (its next id appended).
        An answer that ends frees its cache and keeps its rows compact (bf16 taps): 2,500
        SmolLM2 answers' caches alone would hold ~17 GB."""
        assert self.cache is not None
        self.cache.commit(self.cache.length + taps.shape[0])
        self.taps.append(taps.to(torch.bfloat16))
        self.preds.append(preds)
        nxt = int(preds[-1])
        if nxt not in eos and len(self.ids) - self.lo < self.limit:
            self.ids.append(nxt)
            return True
        self.cache = None
        self.taps, self.preds = [torch.cat(self.taps)], [torch.cat(self.preds)]
        return False


@torch.inference_mode()
def answered_corpus(
    lm: LoadedModel,
    messages: Sequence[str],
    max_answer: int,
    layers: Sequence[int],
    seq_len: int,
    batch: int = ANSWER_BATCH,
    progress: bool = True,
) -> TapCorpus:
    """`chat_corpus(lm, answer(lm, messages, max_answer), layers, seq_len)` in one pass (module
    docstring): each message chat-templated (prompts longer than half of `seq_len` keep their
    tail) and answered greedily, to EOS (not kept) or `max_answer` tokens or `seq_len` in all;
    each prompt runs alone, then the answers' rows run `batch` sequences to a forward, every
    answer token fed once (the last too, for its taps). Rows with fewer than 4 answer tokens
    are dropped."""
    _require_chat_template(lm)
    model, tok = lm.model, lm.tokenizer
    chats = [tok.encode_chat([{"role": "user", "content": m}]) for m in messages]
    prompts = [p[-(seq_len // 2) :] for p in chats]
    hidden = tuple(layers)
    done: list[_Answering] = []
    active: list[_Answering] = []
    waiting = list(enumerate(prompts))[::-1]
    bar = tqdm(total=len(prompts), desc="target answers", unit="msg", disable=not progress)
    while waiting or active:
        while waiting and len(active) < batch:  # admit: the prompt alone, every row scored
            i, prompt = waiting.pop()
            limit = min(max_answer, seq_len - len(prompt))
            cache = model.new_cache(len(prompt) + limit)
            seq = _Answering(i, prompt, limit, cache)
            out = model(
                torch.tensor(prompt),
                [cache],
                [len(prompt)],
                logit_rows=torch.arange(len(prompt)),
                hidden_layers=hidden,
            )
            assert out.layers is not None
            if seq.take(out.layers.flatten(1), out.logits.argmax(-1), lm.eos_ids):
                active.append(seq)
            else:
                done.append(seq)
                bar.update(1)
        if not active:
            continue
        out = model(
            torch.tensor([s.ids[-1] for s in active]),
            [s.cache for s in active if s.cache is not None],
            [1] * len(active),
            hidden_layers=hidden,
        )
        assert out.layers is not None
        taps, preds = out.layers.flatten(1), out.logits.argmax(-1)
        going = []
        for j, s in enumerate(active):
            if s.take(taps[j : j + 1], preds[j : j + 1], lm.eos_ids):
                going.append(s)
            else:
                done.append(s)
                bar.update(1)
        active = going
    bar.close()
    done = sorted((s for s in done if len(s.ids) - s.lo >= 4), key=lambda s: s.index)
    if not done:
        raise ValueError("no answer of 4 tokens or more to train on")
    width = len(layers) * model.config.hidden_size
    ids = torch.zeros(len(done), seq_len, dtype=torch.int64)
    preds_all = torch.zeros_like(ids)  # padding: id 0 predicts 0, as run_target leaves it
    taps_all = torch.zeros(len(done), seq_len, width, dtype=torch.bfloat16)
    for r, s in enumerate(done):  # every id was fed once: one taps / preds row each
        n = len(s.ids)
        ids[r, :n] = torch.tensor(s.ids)
        preds_all[r, :n] = s.preds[0]
        taps_all[r, :n] = s.taps[0]
    lo = torch.tensor([s.lo for s in done])
    hi = torch.tensor([len(s.ids) for s in done])
    return TapCorpus(ids, taps_all, preds_all, hidden, lo, hi)
