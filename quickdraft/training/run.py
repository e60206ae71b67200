"""`quickdraft train-drafter`: one command from a model name and a corpus to a DFlash drafter
checkpoint that `--speculative-method dflash --draft-model DIR` loads.

Stage: orchestration of training/corpus.py (the target pass, cached in the output folder) and
training/dflash.py (the loop, resumable: running the same command again continues from the
last checkpoint, to `steps` in all). Writes into `out`: config.json + model.safetensors (the
drafter), trainer.pt (optimizer state), train_log.jsonl and training_curve.png.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quickdraft.models.dflash import default_target_layers
from quickdraft.training.corpus import build_corpus, default_corpus
from quickdraft.training.dflash import (
    LOG,
    TrainConfig,
    default_mask_token,
    train,
    trainer_for,
)


@dataclass(frozen=True, slots=True)
class DataConfig:
    corpus: tuple[str, ...] = ()  # files / dirs (default: the Python standard library)
    seq_len: int = 512
    max_tokens: int = 400_000
    held_out: float = 0.03
    num_taps: int = 4  # target layers read, spread evenly (ignored when `taps` is given)
    taps: tuple[int, ...] = ()
    mask_token_id: int = -1  # -1: default_mask_token


def train_drafter(
    model_name: str,
    out: Path,
    train_cfg: TrainConfig,
    data_cfg: DataConfig,
    dtype: str,
    progress: bool = True,
) -> dict[str, float]:
    """Train (or resume) a DFlash drafter for `model_name` into `out`; -> a summary."""
    from quickdraft.loading import load

    lm = load(model_name, dtype, progress=progress)
    model, tokenizer = lm.model, lm.tokenizer
    shape: Any = model.config
    layers = shape.num_hidden_layers
    saved = out / "config.json"
    if saved.is_file():  # a resumed run keeps the layout it started with
        raw = json.loads(saved.read_text())
        taps = tuple(raw["dflash_config"]["target_layer_ids"])
        mask = int(raw["dflash_config"]["mask_token_id"])
        if raw["block_size"] != train_cfg.block_size or raw["num_hidden_layers"] != (
            train_cfg.num_layers
        ):
            raise ValueError(
                f"{out} holds a drafter with block {raw['block_size']} and "
                f"{raw['num_hidden_layers']} layers; resume with those or pick another --out"
            )
    else:
        taps = data_cfg.taps or default_target_layers(layers, data_cfg.num_taps)
        mask = data_cfg.mask_token_id
        if mask < 0:
            specials = {
                i: t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items()
            }
            mask = default_mask_token(model.config.vocab_size, tokenizer.vocab_size, specials)
    eos = lm.eos_ids[0] if lm.eos_ids else 0
    corpus = build_corpus(
        model,
        tokenizer,
        f"{model_name}|{dtype}",
        list(data_cfg.corpus) or default_corpus(),
        taps,
        data_cfg.seq_len,
        data_cfg.max_tokens,
        eos,
        out / "data",
        progress,
    )
    data, held_out = corpus.split(data_cfg.held_out, seed=train_cfg.seed)
    drafter = trainer_for(model, train_cfg.num_layers, taps, train_cfg.block_size, mask)
    log = train(drafter, data, held_out, train_cfg, out, model_name, progress)
    plot_curve(out)
    last = log[-1] if log else {}
    return {
        "steps": float(last.get("step", 0)),
        "loss": float(last.get("loss", float("nan"))),
        "al_estimate": float(last.get("al", float("nan"))),
        "corpus_tokens": float(corpus.ids.numel()),
        "corpus_agreement": corpus.agreement(),
    }


def read_log(out: Path) -> list[dict[str, float]]:
    path = out / LOG
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curve(out: Path, title: Sequence[str] = ()) -> Path | None:
    """training_curve.png: the held-out loss and acceptance-length estimate against steps."""
    rows = [r for r in read_log(out) if r["step"] > 0]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="tab:red", label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (weighted CE)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["al"] for r in rows], color="tab:blue", label="held-out AL estimate")
    ax2.set_ylabel("acceptance length (estimate)")
    fig.legend(loc="upper center", ncol=2)
    if title:
        ax.set_title(" | ".join(title), fontsize=8)
    fig.tight_layout()
    path = out / "training_curve.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
