"""Training data for a drafter: a text corpus run through the frozen target once.

Stage: the data half of `quickdraft train-drafter` (training/dflash.py trains on it).
Contract:
  read_texts(paths, suffixes)       the text of every file under `paths` (dirs walked, sorted)
  token_sequences(tok, texts, T)    the texts tokenized, joined by EOS, cut into [S, T] rows
  run_target(model, seqs, layers)   TapCorpus: per position the target's outputs at `layers`
                                    (what a drafter's context is made of) and its own greedy
                                    next token (the label: self-distillation, the drafter learns
                                    what the target says, not what the corpus says)
  build_corpus(...)                 the three above, cached on disk by corpus + target + layers
Each sequence starts at position 0 and is run alone, so its rows are exactly what the target
computes for that text at those positions when serving.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from quickdraft.models.base import LanguageModel
from quickdraft.tokenizer import Tokenizer

DEFAULT_SUFFIXES = (".py", ".md", ".rst", ".txt")
MAX_FILE_BYTES = 400_000  # larger files are mostly data, not text


def default_corpus() -> list[Path]:
    """The corpus when the user names none: the Python standard library's sources (code with
    docstrings and comments in English), on every machine that runs quickdraft."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def read_texts(
    paths: Sequence[str | Path], suffixes: Sequence[str] = DEFAULT_SUFFIXES
) -> list[str]:
    """Every readable UTF-8 file under `paths` whose name ends in one of `suffixes` (a file named
    directly is read whatever its suffix), in sorted order; ValueError if none is found."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(
                f
                for f in sorted(p.rglob("*"))
                if f.suffix in suffixes and f.is_file() and "site-packages" not in f.parts
            )
        else:
            raise ValueError(f"corpus path {p}: no such file or directory")
    texts = []
    for f in files:
        try:
            if f.stat().st_size > MAX_FILE_BYTES:
                continue
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            texts.append(text)
    if not texts:
        raise ValueError(f"corpus {[str(p) for p in paths]}: no text files ({', '.join(suffixes)})")
    return texts


def token_sequences(
    tokenizer: Tokenizer, texts: Sequence[str], seq_len: int, max_tokens: int, eos: int
) -> Tensor:
    """The texts tokenized and joined with `eos` between them, cut into rows of `seq_len`
    (the last partial row dropped), at most `max_tokens` in all -> [S, seq_len] int64."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
        ids.append(eos)
        if len(ids) >= max_tokens:
            break
    rows = min(len(ids), max_tokens) // seq_len
    if rows == 0:
        raise ValueError(f"corpus has {len(ids)} tokens: fewer than one sequence of {seq_len}")
    return torch.tensor(ids[: rows * seq_len], dtype=torch.int64).view(rows, seq_len)


@dataclass(slots=True)
class TapCorpus:
    ids: Tensor  # [S, T] int64 token ids (rows shorter than T padded past `hi`)
    taps: Tensor  # [S, T, len(layers) * H] bf16: the target's outputs at `layers` per position
    preds: Tensor  # [S, T] int64: the target's greedy next token after each position
    layers: tuple[int, ...]
    # per row, the positions a block may start at: [lo, hi - 1) (a chat row: its answer);
    # None: [1, T - 1)
    lo: Tensor | None = None  # [S] int64
    hi: Tensor | None = None  # [S] int64: the row's length

    def __len__(self) -> int:
        return self.ids.shape[0]

    def bounds(self) -> tuple[Tensor, Tensor]:
        """(lo, hi) per row (the defaults filled in)."""
        s, t = self.ids.shape
        lo = self.lo if self.lo is not None else torch.ones(s, dtype=torch.int64)
        hi = self.hi if self.hi is not None else torch.full((s,), t, dtype=torch.int64)
        return lo, hi

    def anchors(self, rows: Tensor, n: int, gen: torch.Generator | None = None) -> Tensor:
        """`n` random block starts per row of `rows` -> [len(rows), n], uniform in each row's
        [lo, hi - 1)."""
        lo, hi = (b[rows] for b in self.bounds())
        span = (hi - 1 - lo).clamp(min=1)
        u = torch.rand(len(rows), n, generator=gen)
        return lo[:, None] + (u * span[:, None]).long().clamp(max=span[:, None] - 1)

    def subset(self, rows: Tensor) -> TapCorpus:
        lo = None if self.lo is None else self.lo[rows]
        hi = None if self.hi is None else self.hi[rows]
        return TapCorpus(self.ids[rows], self.taps[rows], self.preds[rows], self.layers, lo, hi)

    def split(self, held_out: float, seed: int = 0) -> tuple[TapCorpus, TapCorpus]:
        """(train, held-out): a seeded random `held_out` fraction (at least one row) aside."""
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        n = max(1, round(held_out * len(self))) if len(self) > 1 else 0
        return self.subset(order[n:]), self.subset(order[:n])

    def predicted(self) -> Tensor:
        """[S, T] bool: the positions whose greedy prediction a block row is labelled with
        (q in [lo - 1, hi - 1): the prediction of token q + 1, where blocks start and run)."""
        lo, hi = self.bounds()
        pos = torch.arange(self.ids.shape[1])
        return (pos[None] >= lo[:, None] - 1) & (pos[None] < hi[:, None] - 1)

    def agreement(self) -> float:
        """How often the corpus's next token is the target's greedy one, where blocks start."""
        same = self.ids[:, 1:] == self.preds[:, :-1]
        return float(same[self.predicted()[:, :-1]].float().mean())


@torch.inference_mode()
def run_target(
    model: LanguageModel,
    seqs: Tensor,
    layers: Sequence[int],
    progress: bool = True,
    lengths: Tensor | None = None,  # [S] each row's length (default: all of T)
) -> TapCorpus:
    """Each row of `seqs` [S, T] (its first `lengths[i]` tokens) through the target alone, from
    position 0 (module docstring); a row's padding gets zero taps and its own ids as preds."""
    s, t = seqs.shape
    taps = torch.zeros(s, t, len(layers) * model.config.hidden_size, dtype=torch.bfloat16)
    preds = seqs.clone()
    for i in tqdm(range(s), desc="target pass", unit="seq", disable=not progress):
        n = t if lengths is None else int(lengths[i])
        out = model(
            seqs[i, :n],
            [model.new_cache(n)],
            [n],
            logit_rows=torch.arange(n),
            hidden_layers=tuple(layers),
        )
        assert out.layers is not None
        taps[i, :n] = out.layers.flatten(1).to(torch.bfloat16)  # [n, len(layers) * H]
        preds[i, :n] = out.logits.argmax(-1)
    return TapCorpus(seqs, taps, preds, tuple(layers), None, lengths)


def build_corpus(
    model: LanguageModel,
    tokenizer: Tokenizer,
    model_key: str,  # names the target's weights in the cache key
    paths: Sequence[str | Path],
    layers: Sequence[int],
    seq_len: int,
    max_tokens: int,
    eos: int,
    cache_dir: Path | None,
    progress: bool = True,
) -> TapCorpus:
    """The target's TapCorpus of the texts under `paths`, from `cache_dir` when a run with the
    same corpus, target and layers made it before (a resumed training skips the target pass)."""
    seqs = token_sequences(tokenizer, read_texts(paths), seq_len, max_tokens, eos)
    key = hashlib.sha256()
    key.update(seqs.numpy().tobytes())
    key.update(f"{model_key}|{list(layers)}".encode())
    cached = None if cache_dir is None else cache_dir / f"corpus-{key.hexdigest()[:16]}.pt"
    if cached is not None and cached.is_file():
        return load_corpus(cached)
    corpus = run_target(model, seqs, layers, progress)
    if cached is not None:
        save_corpus(corpus, cached)
    return corpus


def save_corpus(corpus: TapCorpus, path: Path) -> None:
    """`corpus` to `path` (a temporary name first: a kill never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fields = {"ids": corpus.ids, "taps": corpus.taps, "preds": corpus.preds, "lo": corpus.lo}
    torch.save({**fields, "hi": corpus.hi, "layers": list(corpus.layers)}, tmp)
    tmp.replace(path)


def load_corpus(path: Path) -> TapCorpus:
    saved = torch.load(path)
    return TapCorpus(
        saved["ids"],
        saved["taps"],
        saved["preds"],
        tuple(saved["layers"]),
        saved.get("lo"),
        saved.get("hi"),
    )
