"""`quickdraft train-drafter --kind mtp` (training/mtp.py) and the standalone MTP head it writes,
on the tiny dense Qwen3 target of test_dflash.py. test_train_drafter.py trains it (loss, held-out
AL and the engine's acceptance rise; resume; the bench) beside the DFlash drafter.

Structure: the training forward of every chained step equals the serving MTPHead's on the
checkpoint the trainer wrote (catch-up rows with the target's hidden, then chained rows fed the
head's own post-norm output); the CLI end to end, with greedy output through `--speculative-method
mtp --draft-model DIR` identical to speculation off; a head for a target run on its GGUF's
own blocks (a quantized embedding table that is also the head); the clear errors: a dense model
with no head and no --draft-model, a head trained for another target, DFlash-only flags, an
--out that holds the other kind of drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file
from test_dflash import dense_target, generate
from test_gguf_loader import LAYERS, TYPES, write_tiny_gguf
from test_train_drafter import greedy_corpus, short_run

from quickdraft.cli import main as cli_main
from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight
from quickdraft.loading import LoadedModel, load
from quickdraft.models.layers import GGUFEmbedding, OperandModule
from quickdraft.request import SamplingParams
from quickdraft.speculation.drafters.mtp import load_mtp_head
from quickdraft.speculation.factory import make_speculation
from quickdraft.training.corpus import run_target
from quickdraft.training.loop import TrainConfig, save_checkpoint, train
from quickdraft.training.mtp import MTPTrainModel, mtp_trainer_for


def saved_head(lm: LoadedModel, out: Path, vocab_ids: torch.Tensor | None) -> MTPTrainModel:
    """A 3-step MTP head for `lm`, its weights moved away from the init (so that every tensor
    matters), saved to `out` as train-drafter saves one."""
    model = mtp_trainer_for(lm.model, 3, seed=3, dtype=torch.float32, vocab_ids=vocab_ids)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_checkpoint(model, torch.optim.AdamW(model.parameters()), 0, TrainConfig(), out, "t")
    return model


@pytest.mark.parametrize("reduced", [False, True], ids=["whole-vocab", "draft-vocab"])
def test_mtp_training_forward_equals_the_serving_head(tmp_path: Path, reduced: bool) -> None:
    """Logits of 3 chained steps at 3 anchors from the training forward (one causal pass, then
    chained rows per anchor) equal the serving MTPHead's, loaded from the checkpoint the trainer
    wrote: rows 0 .. a-1 run with the target's post-norm hidden and committed, then each chained
    row fed the previous step's post-norm output and the target's token. With a reduced draft
    vocabulary (`d2t`) on its ids, and -inf elsewhere."""
    lm = dense_target(tmp_path / "target")
    vocab_ids = torch.arange(2, 320, 3) if reduced else None
    model = saved_head(lm, tmp_path, vocab_ids)
    names = set(load_file(str(tmp_path / "model.safetensors")))  # the head's tensors only
    assert all(n.startswith("mtp.") for n in names - {"d2t"}), names
    assert ("d2t" in names) == reduced
    assert "mtp.layers.0.self_attn.q_norm.weight" in names  # the Qwen3 target's layer
    head = load_mtp_head(lm.model, tmp_path)
    scored = torch.arange(320) if vocab_ids is None else vocab_ids
    others = torch.ones(320, dtype=torch.bool)
    others[scored] = False
    if reduced:
        assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 106
        assert head.vocab is not None and head.vocab.ids.tolist() == scored.tolist()
    ids = torch.tensor(lm.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add("))[:24]
    last = lm.model.config.num_hidden_layers - 1
    corpus = run_target(lm.model, ids[None], (last,), progress=False)
    anchors = torch.tensor([[5, 12, 17]])
    got = model.logits(model.rows_hidden(corpus.ids, corpus.taps, corpus.preds, anchors))
    preds = corpus.preds[0]
    for n, a in enumerate(anchors[0].tolist()):
        cache = head.new_cache(32)
        logits, _, post = head(
            ids[1 : a + 1], corpus.taps[0, :a].float(), [cache], [a], torch.tensor([a - 1])
        )
        cache.commit(a)
        for step in range(3):
            want = logits[0, scored]
            assert (got[0, n, step].detach() - want).abs().max().item() < 1e-4, (a, step)
            assert bool((logits[0, others] == float("-inf")).all())
            token, hidden = preds[a + step : a + step + 1], post[-1:]
            logits, _, post = head(token, hidden, [cache], [1], torch.tensor([0]))
            cache.commit(cache.length + 1)
    spec = make_speculation(
        lm, SpeculativeConfig(method="mtp", draft_model=str(tmp_path), num_draft_tokens=3)
    )
    plain = generate(lm, "def add(", None, max_tokens=16)
    assert generate(lm, "def add(", spec, max_tokens=16).output_ids == plain.output_ids


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("reduced", [False, True], ids=["whole-vocab", "draft-vocab"])
def test_trained_head_quantized(tmp_path: Path, fmt: str, reduced: bool) -> None:
    """--draft-quantization int8 / int4 on a trained head: its own operands (fc, the layer's
    projections) and its draft vocabulary's rows in that format, the target's shared lm_head
    untouched; logits near the full-precision head's; greedy output still speculation off's."""
    lm = dense_target(tmp_path / "target")
    vocab_ids = torch.arange(2, 320, 3) if reduced else None
    saved_head(lm, tmp_path, vocab_ids)
    kind = Int8Weight if fmt == "int8" else Int4Weight
    full, head = load_mtp_head(lm.model, tmp_path), load_mtp_head(lm.model, tmp_path, fmt)
    assert head.quantized == fmt and isinstance(head.fc_weight, kind)
    layer_ops = [
        getattr(m, n)
        for m in head.layers.modules()
        if isinstance(m, OperandModule)
        for n in m.OPERANDS
    ]
    assert layer_ops and all(isinstance(w, kind) for w in layer_ops)
    if reduced:
        assert isinstance(head.lm_head_weight, kind)
    else:
        assert head.lm_head_weight.data_ptr() == lm.model.head.data_ptr()  # shared, as it was
    ids = torch.tensor(lm.tokenizer.encode("def add(a, b):\n    return a + b\n"))[:12]
    hidden = torch.randn(
        len(ids), lm.model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    got, want = (
        h(ids, hidden, [h.new_cache(16)], [len(ids)], torch.arange(len(ids)))[0]
        for h in (head, full)
    )
    scored = torch.arange(320) if vocab_ids is None else vocab_ids
    cos = torch.nn.functional.cosine_similarity(got[:, scored], want[:, scored], dim=-1)
    assert float(cos.min()) > (0.99 if fmt == "int8" else 0.9), cos
    config = SpeculativeConfig(
        method="mtp", draft_model=str(tmp_path), num_draft_tokens=3, draft_quantization=fmt
    )
    spec = make_speculation(lm, config)
    plain = generate(lm, "def add(", None, max_tokens=16)
    assert generate(lm, "def add(", spec, max_tokens=16).output_ids == plain.output_ids


def train_cli(target: Path, out: Path, corpus: Path, *extra: str) -> int:
    mtp = ["--kind", "mtp", "--mtp-steps", "2"]
    return cli_main(["train-drafter", str(target), *short_run(corpus, out), *mtp, *extra])


def test_cli_trains_a_loadable_mtp_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lm = dense_target(tmp_path / "target", rigged=True)
    corpus = tmp_path / "corpus.md"
    corpus.write_text("the cat sat on the mat. def add(a, b): return a + b\n" * 60)
    out = tmp_path / "head"
    assert train_cli(lm.path, out, corpus) == 0, capsys.readouterr().err
    assert "--speculative-method mtp --draft-model" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MTPHead"] and config["quickdraft"]["steps"] == 4
    assert (out / "training_curve.png").is_file() and (out / "trainer.pt").is_file()
    # the same command again with more steps resumes
    assert train_cli(lm.path, out, corpus, "--steps", "6") == 0, capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["quickdraft"]["steps"] == 6
    spec = make_speculation(
        lm, SpeculativeConfig(method="mtp", draft_model=str(out), num_draft_tokens=3)
    )
    for prompt in ("the cat", "def add("):
        plain = generate(lm, prompt, None, max_tokens=16)
        assert generate(lm, prompt, spec, max_tokens=16).output_ids == plain.output_ids
    # DFlash-only flags, and an --out that holds another kind, are clear errors (exit 2)
    assert train_cli(lm.path, out, corpus, "--block-size", "4") == 2
    assert "--block-size: not for --kind mtp" in capsys.readouterr().err
    dflash = ["train-drafter", str(lm.path), "--out", str(out), "--corpus", str(corpus)]
    assert cli_main(dflash) == 2
    assert "holds a mtp drafter, not dflash" in capsys.readouterr().err


def test_mtp_head_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A dense model with no head of its own and no --draft-model says how to get one; a head
    trained for another target names what differs."""
    lm = dense_target(tmp_path / "target")
    with pytest.raises(ValueError, match="train-drafter MODEL --kind mtp"):
        make_speculation(lm, SpeculativeConfig(method="mtp"))
    other = load(str(tiny_model_dir), "fp32")  # a Qwen2 target
    model = mtp_trainer_for(other.model, 1, dtype=torch.float32)
    head = tmp_path / "head"
    save_checkpoint(model, torch.optim.AdamW(model.parameters()), 0, TrainConfig(), head, "x")
    with pytest.raises(ValueError, match="MTP head for model_type 'qwen2'"):
        load_mtp_head(lm.model, head)


def test_mtp_head_for_a_gguf_target(home: Path, tmp_path: Path) -> None:
    """A dense Llama run on its GGUF's own blocks (`--dtype gguf`: bf16 activations, the
    embedding table left quantized and tied to the head): a head trained for it drafts through
    the target's embedding lookup and quantized head, and greedy output with it equals
    speculation off. This random target's text has no pattern to learn, so the head learns
    its training texts by heart (loss ~0.1): from their first tokens, drafts are accepted."""
    lm = load(str(write_tiny_gguf(tmp_path / "tiny.gguf", "llama", TYPES["llama"])), "gguf")
    assert isinstance(lm.model.get_submodule("model.embed_tokens"), GGUFEmbedding)
    data, held_out = greedy_corpus(lm, 24, 28, seed=0, taps=(LAYERS - 1,)).split(0.1)
    cfg = TrainConfig(steps=250, batch=4, anchors=8, lr=3e-3, warmup=5, eval_blocks=64)
    out = tmp_path / "head"
    train(mtp_trainer_for(lm.model, 2), data, held_out, cfg, out, "tiny", progress=False)
    spec = make_speculation(
        lm,
        SpeculativeConfig(method="mtp", draft_model=str(out), num_draft_tokens=3, adaptive=False),
    )
    accepted = 0
    for prompt in data.ids[:3, :4].tolist():
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        plain, fast = lm.new_request(prompt, params), lm.new_request(prompt, params)
        for _ in stream(lm, plain, None):
            pass
        for _ in stream(lm, fast, spec):
            pass
        assert fast.output_ids == plain.output_ids, prompt
        accepted += fast.spec.accepted
    assert accepted > 20, accepted  # of 72 output tokens
