"""How well a trained drafter fits the bench's prompts against its own held-out answers: the
trainer's per-step rates c_j (row j right given rows < j right) and AL estimate, on the held-out
rows of the training corpus and on the target's greedy answers to the bench's code and prose
prompts. A gap between the two is a distribution shift in the training data, not a serving bug
(the real AL of `bench/dflash_fixed_k.py` follows the bench-prompt estimate).

    python bench/drafter_fit.py DRAFTER_DIR [--model smollm2-135m] [--anchors 256]

DRAFTER_DIR is a `quickdraft train-drafter` output (DFlash or `--kind mtp`) with its data/
cache; the held-out split is the trainer's (3 %, seed 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from quickdraft.bench.speculative import prompt_sets
from quickdraft.loading import load
from quickdraft.models.heads.dflash import DFlashConfig
from quickdraft.models.heads.draft_vocab import read_draft_vocabulary
from quickdraft.training.chat_data import answer, chat_corpus
from quickdraft.training.corpus import load_corpus
from quickdraft.training.dflash import trainer_for
from quickdraft.training.loop import DraftTrainModel
from quickdraft.training.mtp import mtp_trainer_for
from quickdraft.training.run import saved_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter", type=Path)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--anchors", type=int, default=256, help="anchors per row")
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load(args.model, "gguf", "cpu", progress=False)
    out: Path = args.drafter
    files = [out / "model.safetensors"]
    vocab_ids = read_draft_vocabulary(files, lm.model.config.vocab_size)
    mtp = saved_config(out, "mtp") if (out / "config.json").is_file() else None
    model: DraftTrainModel
    if mtp is not None:
        steps = int(mtp["quickdraft"]["chained_steps_trained"])
        model = mtp_trainer_for(lm.model, steps, vocab_ids=vocab_ids)
    else:
        cfg = DFlashConfig.from_dir(out)
        model = trainer_for(
            lm.model,
            cfg.layers.num_hidden_layers,
            cfg.target_layer_ids,
            cfg.block_size,
            cfg.mask_token_id,
            vocab_ids=vocab_ids,
        )
    model.load_state_dict(load_file(str(files[0])), strict=True)
    model.eval()
    data = load_corpus(sorted((out / "data").glob("*.pt"))[0])
    corpora = {"held-out": data.split(0.03)[1]}
    for name in ("code", "prose"):
        pairs = answer(lm, prompt_sets()[name], 128, progress=False)
        corpora[f"bench {name}"] = chat_corpus(lm, pairs, data.layers, 512, progress=False)
    for name, corpus in corpora.items():
        c = model.step_rates(corpus, args.anchors)
        al = 1 + float(c.cumprod(0).sum())
        print(f"{name:12s} c_j {[round(float(x), 3) for x in c]}  AL estimate {al:.3f}")


if __name__ == "__main__":
    main()
