"""`quickdraft train-drafter`: one command from a model name and a corpus to a drafter checkpoint:
a DFlash block drafter (`--kind dflash`, the default; `--speculative-method dflash
--draft-model DIR` loads it), an MTP head for a dense target (`--kind mtp`;
`--speculative-method mtp --draft-model DIR`) or an EAGLE-3 head in vLLM's speculators layout
(`--kind eagle3`; `--speculative-method eagle3 --draft-model DIR`).

Stage: orchestration of training/corpus.py (the target pass, cached in the output folder),
training/dflash.py, training/mtp.py or training/eagle3.py (the drafter) and training/loop.py
(the loop they share, resumable: running the same command again continues from the last
checkpoint, to `steps` in all). Writes into `out`: config.json + model.safetensors (the
drafter), trainer.pt (optimizer state), train_log.jsonl and training_curve.png.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from quickdraft.loading import LoadedModel
from quickdraft.models.heads.dflash import default_target_layers
from quickdraft.models.heads.draft_vocab import read_draft_vocabulary
from quickdraft.models.heads.mtp import STANDALONE_ARCHITECTURE
from quickdraft.training.chat_data import answered_corpus, instructions, self_instructions
from quickdraft.training.corpus import (
    TapCorpus,
    build_corpus,
    default_corpus,
    load_corpus,
    read_texts,
    save_corpus,
)
from quickdraft.training.dflash import (
    default_mask_token,
    draft_vocabulary,
    trainer_for,
    vocab_coverage,
)
from quickdraft.training.eagle3 import corpus_layers, default_taps, eagle3_trainer_for
from quickdraft.training.loop import CHECKPOINT, LOG, DraftTrainModel, TrainConfig, train
from quickdraft.training.mtp import mtp_trainer_for

KINDS = ("dflash", "mtp", "eagle3")
DATA_KINDS = ("auto", "chat", "text")
INSTRUCTION_KINDS = ("auto", "self", "corpus", "mixed")


@dataclass(frozen=True, slots=True)
class DataConfig:
    corpus: tuple[str, ...] = ()  # files / dirs (default: the Python standard library)
    # "chat": instructions from the corpus answered by the target (training/chat_data.py);
    # "text": the corpus itself; "auto": chat when the model has a chat template
    data: str = "auto"
    messages: int = 1500  # chat: instructions answered
    # chat: where instructions come from: "self" (written by the target,
    # chat_data.self_instructions; its drafters fit the bench's prompts better:
    # bench/results/mtp-trained-3), "corpus" (made from the corpus's texts), "mixed" (half
    # each) or "auto": corpus when `corpus` names one, else self
    instructions: str = "auto"
    answer_tokens: int = 256  # chat: the longest answer
    draft_vocab: int = 8192  # token ids the drafter scores (0: the whole vocabulary)
    seq_len: int = 512
    max_tokens: int = 400_000  # text: corpus tokens used
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
    kind: str = "dflash",
    device: str = "cpu",
) -> dict[str, float]:
    """Train (or resume) a drafter of `kind` for `model_name` into `out`; -> a summary."""
    from quickdraft.loading import load

    if kind not in KINDS:
        raise ValueError(f"--kind {kind!r}: one of {', '.join(KINDS)}")
    if data_cfg.data not in DATA_KINDS:
        raise ValueError(f"--data {data_cfg.data!r}: one of {', '.join(DATA_KINDS)}")
    lm = load(model_name, dtype, device, progress=progress)
    model, tokenizer = lm.model, lm.tokenizer
    saved = saved_config(out, kind)  # a resumed run keeps the layout it started with
    if kind == "mtp":
        # the one tap: the last layer's output after the final norm, the hidden the MTP
        # drafter is fed (its post_norm feed)
        shape: Any = model.config
        taps: tuple[int, ...] = (shape.num_hidden_layers - 1,)
        if saved is not None and saved["quickdraft"]["chained_steps_trained"] != (
            train_cfg.mtp_steps
        ):
            raise ValueError(
                f"{out} holds an MTP head trained on "
                f"{saved['quickdraft']['chained_steps_trained']} chained steps; resume with "
                "those (--mtp-steps) or pick another --out"
            )
    elif kind == "eagle3":
        # the corpus records layer outputs; an EAGLE-3 tap names the layer whose input it is
        depth = cast(Any, model.config).num_hidden_layers
        heads = tuple(saved["eagle_aux_hidden_state_layer_ids"]) if saved else data_cfg.taps
        eagle_taps = heads or default_taps(depth)
        taps = corpus_layers(eagle_taps)
    else:
        taps, mask = dflash_layout(lm, saved, train_cfg, data_cfg)
    chat = data_cfg.data == "chat" or (
        data_cfg.data == "auto" and tokenizer.chat_template is not None
    )
    paths = list(data_cfg.corpus) or default_corpus()
    if chat:
        corpus = chat_data(lm, f"{model_name}|{dtype}", paths, taps, data_cfg, out / "data")
    else:
        eos = lm.eos_ids[0] if lm.eos_ids else 0
        corpus = build_corpus(
            model,
            tokenizer,
            f"{model_name}|{dtype}",
            paths,
            taps,
            data_cfg.seq_len,
            data_cfg.max_tokens,
            eos,
            out / "data",
            progress,
        )
    data, held_out = corpus.split(data_cfg.held_out, seed=train_cfg.seed)
    checkpoint = [out / CHECKPOINT] if (out / CHECKPOINT).is_file() else []
    # a resumed run keeps its vocabulary (none in the checkpoint: the whole one)
    vocab_ids = read_draft_vocabulary(checkpoint, model.config.vocab_size)
    if not checkpoint and 0 < data_cfg.draft_vocab < model.config.vocab_size:
        vocab_ids = draft_vocabulary(data, data_cfg.draft_vocab, lm.eos_ids)
    if kind == "mtp":
        drafter: DraftTrainModel = mtp_trainer_for(model, train_cfg.mtp_steps, vocab_ids=vocab_ids)
    elif kind == "eagle3":
        drafter = eagle3_trainer_for(model, train_cfg.mtp_steps, eagle_taps, vocab_ids=vocab_ids)
    else:
        drafter = trainer_for(
            model, train_cfg.num_layers, taps, train_cfg.block_size, mask, vocab_ids=vocab_ids
        )
    log = train(drafter, data, held_out, train_cfg, out, model_name, progress)
    plot_curve(out)
    last = log[-1] if log else {}
    lo, hi = corpus.bounds()
    return {
        "steps": float(last.get("step", 0)),
        "loss": float(last.get("loss", float("nan"))),
        "al_estimate": float(last.get("al", float("nan"))),
        "corpus_rows": float(len(corpus)),
        "corpus_tokens": float((hi - lo).sum()),
        "corpus_agreement": corpus.agreement(),
        "draft_vocab": float(model.config.vocab_size if vocab_ids is None else len(vocab_ids)),
        "held_out_vocab_coverage": 1.0
        if vocab_ids is None
        else vocab_coverage(held_out, vocab_ids),
    }


def saved_config(out: Path, kind: str) -> dict[str, Any] | None:
    """The config.json of the drafter `out` already holds (None: a fresh run); an error when
    it is of another kind."""
    path = out / "config.json"
    if not path.is_file():
        return None
    raw: dict[str, Any] = json.loads(path.read_text())
    held = {STANDALONE_ARCHITECTURE: "mtp", "Eagle3Speculator": "eagle3"}.get(
        (raw.get("architectures") or [""])[0], "dflash"
    )
    if held != kind:
        raise ValueError(f"{out} holds a {held} drafter, not {kind}: pick another --out")
    return raw


def dflash_layout(
    lm: LoadedModel, saved: dict[str, Any] | None, train_cfg: TrainConfig, data_cfg: DataConfig
) -> tuple[tuple[int, ...], int]:
    """(taps, mask token) of a DFlash drafter: the saved checkpoint's when resuming, else
    from `data_cfg` and the defaults."""
    model, shape = lm.model, cast(Any, lm.model.config)
    if saved is not None:
        taps = tuple(saved["dflash_config"]["target_layer_ids"])
        if saved["block_size"] != train_cfg.block_size or saved["num_hidden_layers"] != (
            train_cfg.num_layers
        ):
            raise ValueError(
                f"drafter with block {saved['block_size']} and {saved['num_hidden_layers']} "
                "layers already there; resume with those or pick another --out"
            )
        return taps, int(saved["dflash_config"]["mask_token_id"])
    taps = data_cfg.taps or default_target_layers(shape.num_hidden_layers, data_cfg.num_taps)
    mask = data_cfg.mask_token_id
    if mask < 0:
        specials = {
            i: t.content for i, t in lm.tokenizer.backend.get_added_tokens_decoder().items()
        }
        mask = default_mask_token(model.config.vocab_size, lm.tokenizer.vocab_size, specials)
    return taps, mask


def chat_data(
    lm: LoadedModel,
    model_key: str,
    paths: Sequence[str | Path],
    taps: Sequence[int],
    cfg: DataConfig,
    cache_dir: Path,
) -> TapCorpus:
    """The `--data chat` corpus (training/chat_data.py), from `cache_dir` when a run with the
    same instructions, target and taps made it (a resumed training skips both passes)."""
    messages = chat_messages(lm, model_key, paths, cfg, cache_dir)
    # "tail": long prompts are cut before they are answered (answered_corpus)
    key = hashlib.sha256(
        json.dumps(
            [messages, model_key, list(taps), cfg.seq_len, cfg.answer_tokens, "tail"]
        ).encode()
    )
    cached = cache_dir / f"chat-{key.hexdigest()[:16]}.pt"
    if cached.is_file():
        return load_corpus(cached)
    corpus = answered_corpus(lm, messages, cfg.answer_tokens, taps, cfg.seq_len)
    save_corpus(corpus, cached)
    return corpus


def chat_messages(
    lm: LoadedModel,
    model_key: str,
    paths: Sequence[str | Path],
    cfg: DataConfig,
    cache_dir: Path,
) -> list[str]:
    """`cfg.messages` instructions of kind `cfg.instructions` (DataConfig); the target's own
    are sampled once and kept in `cache_dir`, so a resumed run answers the same ones."""
    kind = cfg.instructions
    if kind not in INSTRUCTION_KINDS:
        raise ValueError(f"--instructions {kind!r}: one of {', '.join(INSTRUCTION_KINDS)}")
    if kind == "auto":
        kind = "corpus" if cfg.corpus else "self"
    own = {"corpus": 0, "self": cfg.messages, "mixed": cfg.messages // 2}[kind]
    messages = instructions(read_texts(paths), cfg.messages - own) if own < cfg.messages else []
    if own:
        key = hashlib.sha256(json.dumps([model_key, own]).encode()).hexdigest()[:16]
        cached = cache_dir / f"instructions-{key}.json"
        if cached.is_file():
            written: list[str] = json.loads(cached.read_text())
        else:
            written = self_instructions(lm, own)
            cache_dir.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps(written))
        # interleaved, so that a cut run still sees both kinds
        mixed = [m for pair in zip(written, messages, strict=False) for m in pair]
        n = min(len(written), len(messages))
        messages = mixed + written[n:] + messages[n:]
    return messages


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
