"""`quickdraft train-drafter --kind eagle3` (training/eagle3.py) on the tiny dense Qwen3 target
of test_dflash.py: the training forward of every training-time-test step equals the serving
EAGLE-3 head's (models/heads/eagle3.py) on the checkpoint the trainer wrote, in vLLM's speculators
layout; the command line end to end (resume included), with greedy output through
`--speculative-method eagle3 --draft-model DIR` identical to speculation off; the clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file
from test_dflash import dense_target, generate
from test_train_drafter import short_run

from quickdraft.cli import main as cli_main
from quickdraft.config import SpeculativeConfig
from quickdraft.models.heads.eagle3 import Eagle3Head
from quickdraft.speculation.drafters.eagle3 import load_eagle3
from quickdraft.speculation.factory import make_speculation
from quickdraft.training.corpus import run_target
from quickdraft.training.eagle3 import corpus_layers, eagle3_trainer_for
from quickdraft.training.loop import TrainConfig, save_checkpoint

TAPS = (1, 2, 2)  # inputs of layers 1 and 2 of the 3-layer target


@pytest.mark.parametrize("reduced", [False, True], ids=["whole-vocab", "draft-vocab"])
def test_eagle3_training_forward_equals_the_serving_head(tmp_path: Path, reduced: bool) -> None:
    """Logits of 3 steps at 3 anchors from the training forward (one causal pass over the
    target's taps, then chained rows per anchor fed the previous pre-norm output and the
    target's token) equal the serving head's, loaded from the checkpoint the trainer wrote."""
    lm = dense_target(tmp_path / "target")
    vocab_ids = torch.arange(2, 320, 3) if reduced else None
    model = eagle3_trainer_for(lm.model, 3, TAPS, seed=3, dtype=torch.float32, vocab_ids=vocab_ids)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_checkpoint(model, torch.optim.AdamW(model.parameters()), 0, TrainConfig(), tmp_path, "t")
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "layers.0.hidden_norm.weight" in names and "lm_head.weight" in names
    assert ("d2t" in names) == reduced
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == list(TAPS)
    head, taps = load_eagle3(lm.model, tmp_path)
    assert isinstance(head, Eagle3Head) and taps == TAPS
    scored = torch.arange(320) if vocab_ids is None else vocab_ids
    ids = torch.tensor(lm.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add("))[:24]
    corpus = run_target(lm.model, ids[None], corpus_layers(TAPS), progress=False)
    anchors = torch.tensor([[5, 12, 17]])
    got = model.logits(model.rows_hidden(corpus.ids, corpus.taps, corpus.preds, anchors))
    preds = corpus.preds[0]
    for n, a in enumerate(anchors[0].tolist()):
        cache = head.new_cache(32)
        g = head.fuse(corpus.taps[0, :a].float())
        logits, pre, _ = head(ids[1 : a + 1], g, [cache], [a], torch.tensor([a - 1]))
        cache.commit(a)
        for step in range(3):
            want = logits[0, scored]
            assert (got[0, n, step].detach() - want).abs().max().item() < 1e-4, (a, step)
            token, hidden = preds[a + step : a + step + 1], pre[-1:]
            logits, pre, _ = head(token, hidden, [cache], [1], torch.tensor([0]))
            cache.commit(cache.length + 1)


def test_cli_trains_a_loadable_eagle3_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lm = dense_target(tmp_path / "target", rigged=True)
    corpus = tmp_path / "corpus.md"
    corpus.write_text("the cat sat on the mat. def add(a, b): return a + b\n" * 60)
    out = tmp_path / "head"
    argv = ["train-drafter", str(lm.path), *short_run(corpus, out), "--method", "eagle3"]
    taps = ["--taps", ",".join(map(str, TAPS)), "--mtp-steps", "2"]
    assert cli_main([*argv, *taps]) == 0, capsys.readouterr().err
    assert "--speculative-method eagle3 --draft-model" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quickdraft"]["steps"] == 4 and config["quickdraft"]["ttt_steps"] == 2
    # the same command again with more steps resumes (the taps come from the checkpoint)
    assert cli_main([*argv, "--steps", "6", "--mtp-steps", "2"]) == 0, capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["quickdraft"]["steps"] == 6
    spec = make_speculation(
        lm, SpeculativeConfig(method="eagle3", draft_model=str(out), num_draft_tokens=3)
    )
    for prompt in ("the cat", "def add("):
        plain = generate(lm, prompt, None, max_tokens=16)
        assert generate(lm, prompt, spec, max_tokens=16).output_ids == plain.output_ids
    assert cli_main([*argv, "--block-size", "4"]) == 2
    assert "--block-size: not for --kind eagle3" in capsys.readouterr().err
    assert cli_main(["train-drafter", str(lm.path), *short_run(corpus, out), "--kind", "mtp"]) == 2
    assert "holds a eagle3 drafter, not mtp" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"taps \[0, 1, 2\].*1 \.\. 2"):
        eagle3_trainer_for(lm.model, 2, (0, 1, 2))
