"""`quickdraft train-drafter` (training/corpus.py, training/loop.py, training/dflash.py,
training/mtp.py, training/run.py) on the tiny rigged dense target of test_dflash.py (no real
drafter can be trained in a test's time).

Structure: the training forward equals the serving forward (models/heads/dflash.py) on the
checkpoint it writes; which block rows carry a label (the corpus following the target's greedy
chain); for each kind (a DFlash drafter, an MTP head) a short training run lowers the loss and
raises acceptance in the real engine above the untrained drafter's, with greedy output still
identical to speculation off; a run resumes where it stopped; the bench runs a trained drafter; the
CLI end to end on a corpus file. tests/test_train_mtp.py: what is the MTP head's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file
from test_dflash import MASK, dense_target, generate

from quickdraft.bench.speculative import SpecBench
from quickdraft.bench.speculative import run as run_bench
from quickdraft.cli import main as cli_main
from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.speculation.drafters.dflash import load_dflash
from quickdraft.speculation.factory import make_speculation
from quickdraft.training import chat_data
from quickdraft.training import run as run_module
from quickdraft.training.chat_data import answer, chat_corpus, instructions
from quickdraft.training.corpus import TapCorpus, read_texts, run_target, token_sequences
from quickdraft.training.dflash import (
    DFlashTrainModel,
    draft_vocabulary,
    trainer_for,
    vocab_coverage,
)
from quickdraft.training.eagle3 import eagle3_trainer_for
from quickdraft.training.loop import (
    DraftTrainModel,
    TrainConfig,
    autocast_dtype,
    save_checkpoint,
    train,
)
from quickdraft.training.mtp import mtp_trainer_for
from quickdraft.training.run import DataConfig, chat_messages, read_log

TAPS = (0, 1)
KINDS = ("dflash", "mtp")


def taps_of(lm: LoadedModel, kind: str) -> tuple[int, ...]:
    """The target layers a drafter of `kind` reads: an MTP head, the last (post-norm)."""
    return TAPS if kind == "dflash" else (lm.model.config.num_hidden_layers - 1,)


def greedy_corpus(
    lm: LoadedModel, rows: int, length: int, seed: int, taps: tuple[int, ...] = TAPS
) -> TapCorpus:
    """`rows` sequences of a few random tokens, each continued greedily by the target: the
    target's own text, so every label past the prompt is known (self-distillation data)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(rows):
        prompt = torch.randint(3, 280, (4,), generator=gen).tolist()
        req = lm.new_request(prompt, SamplingParams(max_tokens=length - 4, ignore_eos=True))
        for _ in stream(lm, req, None):
            pass
        seqs.append(prompt + req.output_ids)
    return run_target(lm.model, torch.tensor(seqs), taps, progress=False)


def trainer(lm: LoadedModel, block: int = 4, seed: int = 0) -> DFlashTrainModel:
    return trainer_for(lm.model, 1, TAPS, block, MASK, seed=seed, dtype=torch.float32)


def trainer_of(kind: str, lm: LoadedModel, seed: int = 0) -> DraftTrainModel:
    """A fresh drafter of `kind` drafting 3 tokens: a 4-row DFlash block, or 3 MTP steps."""
    if kind == "mtp":
        return mtp_trainer_for(lm.model, 3, seed=seed, dtype=torch.float32)
    return trainer(lm, seed=seed)


@pytest.mark.parametrize("reduced", [False, True], ids=["whole-vocab", "draft-vocab"])
def test_training_forward_equals_the_serving_forward(tmp_path: Path, reduced: bool) -> None:
    """Logits of a block from the training forward (many blocks per sequence, masked) equal
    the serving DFlashModel's on the checkpoint the trainer wrote, for each of 3 anchors; with
    a reduced draft vocabulary (`d2t` in the checkpoint) on its ids, and -inf elsewhere."""
    lm = dense_target(tmp_path / "target", rigged=True)
    vocab_ids = torch.arange(3, 320, 3) if reduced else None
    model = trainer_for(
        lm.model, 2, TAPS, 4, MASK, seed=3, dtype=torch.float32, vocab_ids=vocab_ids
    )
    with torch.no_grad():  # away from the init, so that every tensor matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_checkpoint(model, torch.optim.AdamW(model.parameters()), 0, TrainConfig(), tmp_path, "t")
    served = load_dflash(lm.model, tmp_path)
    scored = torch.arange(320) if vocab_ids is None else vocab_ids
    if reduced:
        assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 106
        assert served.vocab is not None and served.vocab.ids.tolist() == scored.tolist()
    ids = torch.tensor(lm.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add("))[:20]
    corpus = run_target(lm.model, ids[None], TAPS, progress=False)
    anchors = torch.tensor([[5, 12, 17]])
    hidden = model.block_hidden(corpus.ids, corpus.taps, anchors)  # [1, 3, 4, H]
    embed = lm.model.get_submodule("model.embed_tokens")  # type: ignore[attr-defined]
    for n, a in enumerate(anchors[0].tolist()):
        cache = served.new_cache(32)
        served.extend_context(corpus.taps[0, :a].float(), [cache], [a])
        block = embed(torch.tensor([int(ids[a]), MASK, MASK, MASK]))
        want = served(block, [cache], [4], torch.arange(1, 4))
        got = model.logits(hidden[0, n, 1:]).detach()
        assert (got - want[:, scored]).abs().max().item() < 1e-4, a
        others = torch.ones(320, dtype=torch.bool)
        others[scored] = False
        assert bool((want[:, others] == float("-inf")).all())


def test_draft_vocabulary_keeps_the_targets_commonest_predictions(tmp_path: Path) -> None:
    """draft_vocabulary counts the target's predictions where blocks run (a chat row: its
    answer), keeps the most frequent plus the end-of-text ids; a label outside it carries no
    loss and is never right; greedy output with such a drafter stays speculation off's."""
    lm = dense_target(tmp_path / "target", rigged=True)
    corpus = greedy_corpus(lm, 12, 30, seed=2)
    corpus.lo = torch.full((12,), 10)
    counts = torch.bincount(corpus.preds[:, 9:29].flatten(), minlength=320)
    vocab = draft_vocabulary(corpus, 5, always=(2,))
    top = torch.argsort(-counts, stable=True)[:5].tolist()  # ties: the lower id
    assert vocab.tolist() == sorted({*top, 2})
    assert 0 < vocab_coverage(corpus, vocab) < 1
    model = trainer(lm)
    small = trainer_for(lm.model, 1, TAPS, 4, MASK, dtype=torch.float32, vocab_ids=vocab)
    labels, _ = small.labels(corpus.ids, corpus.preds, torch.tensor([[12] * 2] * 12))
    full, _ = model.labels(corpus.ids, corpus.preds, torch.tensor([[12] * 2] * 12))
    inside = torch.isin(full, vocab)
    assert bool((labels[inside] == torch.searchsorted(vocab, full[inside])).all())
    assert bool((labels[~inside] == -1).all())
    out = tmp_path / "small"
    save_checkpoint(small, torch.optim.AdamW(small.parameters()), 0, TrainConfig(), out, "t")
    spec = make_speculation(
        lm, SpeculativeConfig(method="dflash", draft_model=str(out), num_draft_tokens=3)
    )
    for prompt in ("the cat", "def add("):
        plain = generate(lm, prompt, None, max_tokens=16)
        assert generate(lm, prompt, spec, max_tokens=16).output_ids == plain.output_ids


def test_chat_data_from_a_corpus(tmp_path: Path) -> None:
    """--data chat: instructions made from Python functions (with their docstrings and
    source), prose paragraphs and topic words; answered greedily by the target; the corpus rows
    are prompt + answer, blocks start only inside the answer, whose tokens are the target's own
    greedy predictions there."""
    source = "\n\n".join(
        f"def scale_{i}(values, factor=2):\n"
        f'    """Multiply every number in values by factor and return the new list of them."""\n'
        f"    return [v * factor for v in values]\n"
        for i in range(5)
    )
    prose = "\n\n".join(
        " ".join(
            f"lighthouse keeper{i} watches ships crossing harbour waters nightly" for _ in range(6)
        )
        for i in range(4)
    )
    messages = instructions([source, prose], 30, seed=1)
    assert len(messages) == 30 and messages == instructions([source, prose], 30, seed=1)
    assert any("scale_" in m and "values, factor=2" in m for m in messages)  # code tasks
    assert any("lighthouse keeper" in m and m.count("watches") >= 6 for m in messages)  # text
    assert any(m.startswith(("Write a", "Explain what", "Give me", "Describe")) for m in messages)
    lm = dense_target(tmp_path / "target")
    pairs = answer(lm, messages[:6], max_answer=12, progress=False)
    assert all(len(reply) > 0 for _, reply in pairs)
    assert pairs[0][0] == lm.tokenizer.encode_chat([{"role": "user", "content": messages[0]}])
    corpus = chat_corpus(lm, pairs, TAPS, seq_len=4096, progress=False)
    lo, hi = corpus.bounds()
    for i, (prompt, reply) in enumerate(pairs):
        assert (int(lo[i]), int(hi[i])) == (len(prompt), len(prompt) + len(reply))
        assert corpus.ids[i, : hi[i]].tolist() == prompt + reply
    assert corpus.agreement() > 0.95  # the answers are the target's own greedy tokens
    anchors = corpus.anchors(torch.arange(len(corpus)), 50)
    assert bool(((anchors >= lo[:, None]) & (anchors < hi[:, None] - 1)).all())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_answered_corpus_equals_answers_then_a_target_pass(tmp_path: Path, dtype: str) -> None:
    """answered_corpus (the target answers, its taps and predictions kept as it goes, a few
    sequences per forward, slots refilled as answers end) gives the rows that answering first
    and then running each conversation through the target alone gives: the same ids and
    bounds, and in bf16 (packed panels, batch-invariant kernels) the same tap bits; prompts
    longer than half the row keep their tail."""
    directory = dense_target(tmp_path / "target").path
    lm = load(str(directory), dtype)
    long = " ".join(f"word{i}" for i in range(60))
    messages = ["def add(a, b):", "the cat sat", long, "hello there", "x = 1", "why"]
    max_answer, seq_len = 12, 80
    got = chat_data.answered_corpus(
        lm, messages, max_answer, TAPS, seq_len, batch=3, progress=False
    )
    pairs = answer(lm, messages, max_answer, progress=False)
    want = chat_corpus(lm, pairs, TAPS, seq_len, progress=False)
    assert torch.equal(got.bounds()[0], want.bounds()[0])
    assert torch.equal(got.bounds()[1], want.bounds()[1])
    # the long prompt: its tail only (answer() saw all of it, so the answers may differ)
    cut = [i for i, (p, _) in enumerate(pairs) if len(p) > seq_len // 2]
    assert cut == [2]
    keep = torch.tensor([i for i in range(len(messages)) if i not in cut])
    assert torch.equal(got.ids[keep], want.ids[keep])
    assert torch.equal(got.preds[keep], want.preds[keep])
    if dtype == "bf16":
        assert torch.equal(got.taps[keep], want.taps[keep])
    else:  # torch's fp32 GEMMs may sum a row differently at another row count
        torch.testing.assert_close(got.taps[keep], want.taps[keep], rtol=1e-2, atol=1e-2)
    lo = got.bounds()[0]
    assert int(lo[2]) == seq_len // 2 and got.ids[2, : lo[2]].tolist() == pairs[2][0][-40:]


def test_instructions_written_by_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--instructions self: the chat template's user turn, opened with an OPENERS entry and
    completed by sampling with a seed per message (the same seed, the same messages); distinct,
    each saying more than its opener. --instructions mixed interleaves them with the corpus's,
    and the written ones are kept in the data folder, so a resumed run samples nothing; auto
    picks the corpus's when one is named."""
    lm = dense_target(tmp_path / "target")
    prefix = chat_data._user_turn_prefix(lm)
    chat = lm.tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    assert chat[: len(prefix)] == prefix and len(prefix) < len(chat)
    written = chat_data.self_instructions(lm, 10, seed=3, max_tokens=6, progress=False)
    assert 0 < len(written) <= 10 and len(set(written)) == len(written)
    assert all(m.startswith(chat_data.OPENERS) for m in written)
    assert all(any(m != o and m.startswith(o) for o in chat_data.OPENERS) for m in written)
    assert written == chat_data.self_instructions(lm, 10, seed=3, max_tokens=6, progress=False)
    corpus = tmp_path / "corpus.md"
    corpus.write_text(
        ("the cat sat on the mat and watched the ships in the harbour. " * 5 + "\n\n") * 9
    )
    cfg = DataConfig(messages=8, instructions="mixed")
    calls: list[int] = []

    def sample(lm: LoadedModel, n: int) -> list[str]:
        calls.append(n)
        return [f"Write a poem about ship {i}" for i in range(n)]

    monkeypatch.setattr(run_module, "self_instructions", sample)
    messages = chat_messages(lm, "t", [corpus], cfg, tmp_path / "data")
    assert calls == [4] and len(messages) == 8
    assert messages[0::2] == [f"Write a poem about ship {i}" for i in range(4)]
    texts = read_texts([corpus])
    assert messages[1::2] == instructions(texts, 4)
    assert chat_messages(lm, "t", [corpus], cfg, tmp_path / "data") == messages
    assert calls == [4]  # the second run read them back
    # auto (the default): the corpus's when --corpus names one, else the target's own
    named = DataConfig(messages=3, corpus=(str(corpus),))
    assert chat_messages(lm, "t", [corpus], named, tmp_path / "data") == instructions(texts, 3)
    assert chat_messages(lm, "t", [corpus], DataConfig(messages=3), tmp_path / "data2") == [
        f"Write a poem about ship {i}" for i in range(3)
    ]
    with pytest.raises(ValueError, match="--instructions 'nope'"):
        chat_messages(lm, "t", [corpus], replace(cfg, instructions="nope"), tmp_path / "data")


def test_chat_instructions_do_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    """The cached answers are keyed by the instructions: two processes with different string
    hash seeds must make the same ones (topic words tie on counts)."""
    corpus = tmp_path / "notes.md"
    words = ["".join(chr(97 + (n // 26**d) % 26) for d in range(3)) + "word" for n in range(400)]
    corpus.write_text(  # 400 words, each in 6 of the 80 paragraphs: all tie
        "\n\n".join(" ".join(words[(30 * i + j) % 400] for j in range(30)) for i in range(80))
    )
    code = (
        "import hashlib, json, sys\n"
        "from quickdraft.training.chat_data import instructions\n"
        "from quickdraft.training.corpus import read_texts\n"
        "m = instructions(read_texts([sys.argv[1]]), 60)\n"
        "print(hashlib.sha256(json.dumps(m).encode()).hexdigest())\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code, str(corpus)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(digests) == 1, digests


def test_labels_are_known_while_the_corpus_follows_the_target(tmp_path: Path) -> None:
    lm = dense_target(tmp_path / "target")
    model = trainer(lm, block=5)
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    preds = torch.tensor([[11, 12, 99, 14, 15, 16, 17, 18]])  # the corpus leaves at 2 -> 3
    labels, known = model.labels(ids, preds, torch.tensor([[1, 3, 5]]))
    # anchor 1: rows at 2..5 are labelled preds[1..4] = 12, 99, 14, 15; known while ids follow
    assert labels[0, 0].tolist() == [12, 99, 14, 15]
    assert known[0, 0].tolist() == [True, True, False, False]
    assert known[0, 1].tolist() == [True, True, True, True]  # anchor 3: 14.. all followed
    assert known[0, 2].tolist() == [True, True, True, False]  # anchor 5: row 4 past the end


def acceptance(
    lm: LoadedModel, directory: Path, prompts: list[list[int]], method: str = "dflash"
) -> tuple[float, list]:
    cfg = SpeculativeConfig(
        method=method, draft_model=str(directory), num_draft_tokens=3, adaptive=False
    )
    spec = make_speculation(lm, cfg)
    accepted = drafted = 0
    outputs = []
    for prompt in prompts:
        req = lm.new_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        for _ in stream(lm, req, spec):
            pass
        accepted, drafted = accepted + req.spec.accepted, drafted + req.spec.drafted
        outputs.append(req.output_ids)
    return accepted / drafted, outputs


def short_run_config(**changes: Any) -> TrainConfig:
    """300 steps of small batches at a high rate, estimates every 100: a test's training run."""
    cfg = TrainConfig(
        steps=300,
        batch=4,
        anchors=8,
        lr=3e-3,
        warmup=5,
        eval_every=100,
        save_every=300,
        eval_blocks=64,
    )
    return replace(cfg, **changes)


@pytest.mark.parametrize("kind", KINDS)
def test_training_lowers_loss_and_raises_acceptance(tmp_path: Path, kind: str) -> None:
    """300 steps on the target's own greedy text: the loss falls, the held-out AL estimate and
    the real engine's acceptance rise above the untrained drafter's, and greedy output with the
    trained drafter is still exactly speculation off's."""
    lm = dense_target(tmp_path / "target", rigged=True)
    data, held_out = greedy_corpus(lm, 160, 40, seed=0, taps=taps_of(lm, kind)).split(0.1)
    model = trainer_of(kind, lm)
    untrained = tmp_path / "untrained"
    save_checkpoint(model, torch.optim.AdamW(model.parameters()), 0, TrainConfig(), untrained, "t")
    cfg = short_run_config(block_size=4, num_layers=1)
    log = train(model, data, held_out, cfg, tmp_path / "trained", "tiny", progress=False)
    assert [r["step"] for r in log] == [0, 100, 200, 300]
    assert log[-1]["loss"] < 0.7 * log[1]["loss"], log
    assert log[-1]["al"] > log[0]["al"] + 0.3, log
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 280, (4,), generator=gen).tolist() for _ in range(6)]
    before, _ = acceptance(lm, untrained, prompts, kind)
    after, outputs = acceptance(lm, tmp_path / "trained", prompts, kind)
    assert after > before + 0.15, (before, after)
    for prompt, out in zip(prompts, outputs, strict=True):
        req = lm.new_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        for _ in stream(lm, req, None):
            pass
        assert out == req.output_ids


def test_bf16_autocast_trains_as_fp32_does(tmp_path: Path) -> None:
    """precision "bf16" (what "auto" picks on a GPU or a CPU with AVX512-BF16 / AMX) runs the
    loss under autocast: the loss falls as far as in fp32, and the weights stay fp32."""
    lm = dense_target(tmp_path / "target", rigged=True)
    data, held_out = greedy_corpus(lm, 64, 40, seed=0, taps=taps_of(lm, "mtp")).split(0.1)
    logs = {}
    for precision in ("fp32", "bf16"):
        model = trainer_of("mtp", lm)
        cfg = short_run_config(steps=150, eval_every=50, save_every=150, precision=precision)
        log = train(model, data, held_out, cfg, tmp_path / precision, "t", progress=False)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        logs[precision] = log
        assert log[-1]["loss"] < 0.7 * log[1]["loss"], (precision, log)
    fp32, bf16 = logs["fp32"][-1], logs["bf16"][-1]
    assert bf16["loss"] != fp32["loss"], "autocast changed nothing: was it on?"
    assert abs(bf16["loss"] - fp32["loss"]) < 0.25 * fp32["loss"], logs
    assert bf16["al"] > logs["bf16"][0]["al"] + 0.2, logs
    # the rule "auto" follows, and a clear error for anything else
    assert autocast_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert autocast_dtype("fp32", torch.device("cuda")) is None
    assert autocast_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="precision 'fp16'"):
        autocast_dtype("fp16", torch.device("cpu"))


@pytest.mark.parametrize("kind", KINDS)
def test_training_resumes_where_it_stopped(tmp_path: Path, kind: str) -> None:
    lm = dense_target(tmp_path / "target", rigged=True)
    data, held_out = greedy_corpus(lm, 8, 32, seed=1, taps=taps_of(lm, kind)).split(0.25)
    out = tmp_path / "run"
    cfg = TrainConfig(
        block_size=4,
        num_layers=1,
        steps=6,
        batch=2,
        anchors=4,
        eval_every=3,
        save_every=3,
        eval_blocks=16,
    )
    train(trainer_of(kind, lm), data, held_out, cfg, out, "tiny", progress=False)
    stopped = json.loads((out / "config.json").read_text())["quickdraft"]["steps"]
    assert stopped == 6
    saved = load_file(str(out / "model.safetensors"))
    longer = replace(cfg, steps=9)
    resumed = trainer_of(kind, lm, seed=99)  # other init: the checkpoint must replace it
    log = train(resumed, data, held_out, longer, out, "tiny", progress=False)
    assert [r["step"] for r in log] == [9]  # no step 0 again: it went on from 6
    assert [r["step"] for r in read_log(out)] == [0, 3, 6, 9]
    assert json.loads((out / "config.json").read_text())["quickdraft"]["steps"] == 9
    # it went on from step 6's weights (a seed-99 start would be far from them after 3 steps)
    again = trainer_of(kind, lm, seed=99)
    again.load_state_dict(saved)
    moved = max(
        (a - b).abs().max()
        for a, b in zip(resumed.state_dict().values(), again.state_dict().values(), strict=True)
    )
    assert 0 < float(moved) < 0.05, moved


def short_run(corpus: Path, out: Path) -> list[str]:
    """train-drafter flags for a 4-step run on `corpus` as plain text into `out`."""
    return [
        *("--dtype", "fp32", "--out", str(out), "--corpus", str(corpus), "--data", "text"),
        *("--seq-len", "32", "--steps", "4", "--batch", "2", "--anchors", "4"),
        *("--eval-every", "2", "--save-every", "2"),
    ]


def test_cli_trains_a_loadable_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lm = dense_target(tmp_path / "target", rigged=True)
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.py").write_text("def add(a, b):\n    return a + b\n" * 40)
    (text / "b.md").write_text("the cat sat on the mat. " * 60)
    (text / "skip.bin").write_bytes(b"\x00" * 10)
    assert len(read_texts([text])) == 2
    out = tmp_path / "drafter"
    dflash = ["--layers", "1", "--block-size", "4", "--taps", "0,1", "--mask-token-id", str(MASK)]
    run = [*short_run(text, out), *dflash, "--precision", "bf16"]
    code = cli_main(["train-drafter", str(lm.path), *run])
    assert code == 0, capsys.readouterr().err
    assert torch.load(out / "trainer.pt", weights_only=False)["config"]["precision"] == "bf16"
    assert "--speculative-method dflash" in capsys.readouterr().out
    assert (out / "training_curve.png").is_file() and (out / "trainer.pt").is_file()
    drafter = load_dflash(lm.model, out)
    assert drafter.cfg.target_layer_ids == TAPS and drafter.cfg.block_size == 4
    plain = generate(lm, "the cat", None, max_tokens=12)
    spec = make_speculation(
        lm, SpeculativeConfig(method="dflash", draft_model=str(out), num_draft_tokens=3)
    )
    assert generate(lm, "the cat", spec, max_tokens=12).output_ids == plain.output_ids
    # a bad corpus path is a clear error, exit 2
    assert cli_main(["train-drafter", str(lm.path), "--corpus", str(tmp_path / "none")]) == 2
    assert "no such file" in capsys.readouterr().err
    shutil.rmtree(out)


def test_token_sequences_cut_and_join() -> None:
    class Chars:
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    rows = token_sequences(Chars(), ["abc", "de"], 3, 100, eos=0)  # type: ignore[arg-type]
    assert rows.tolist() == [[97, 98, 99], [0, 100, 101]]  # the trailing eos is cut off
    with pytest.raises(ValueError, match="fewer than one sequence"):
        token_sequences(Chars(), ["a"], 8, 100, eos=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [*KINDS, "eagle3"])
def test_bench_runs_a_trained_drafter(tiny_model_dir: Path, tmp_path: Path, kind: str) -> None:
    """`quickdraft bench --dflash DIR` / `--mtp DIR` / `--eagle3 DIR`: the drafter runs as
    engine "dflash" / "mtp" / "eagle3" beside the others, its greedy output identical to
    speculation off (fp32; the tiny Qwen2 target: q/k/v biases in the MTP head's layer)."""
    lm = load(str(tiny_model_dir), "fp32")
    vocab = lm.model.config.vocab_size
    model: DraftTrainModel
    if kind == "mtp":
        model = mtp_trainer_for(lm.model, 2, dtype=torch.float32)
    elif kind == "eagle3":  # taps: the input of the tiny target's last layer, three times
        last = lm.model.config.num_hidden_layers - 1
        model = eagle3_trainer_for(lm.model, 2, (last,) * 3, dtype=torch.float32)
    else:
        model = trainer_for(lm.model, 1, (0,), 4, vocab - 1, dtype=torch.float32)
    out = tmp_path / kind
    save_checkpoint(model, torch.optim.AdamW(model.parameters()), 0, TrainConfig(), out, "tiny")
    report = run_bench(
        SpecBench(
            str(tiny_model_dir),
            None,
            dtype="fp32",
            tokens=10,
            per_set=2,
            sets=("code",),
            k=3,
            hf=False,
            out_dir=tmp_path,
            reference_per_set=0,
            **{kind: str(out)},
        )
    )
    cell = report["results"]["code"][kind]
    assert cell["prompts"] == 2 and cell["identical"] == 2 and cell["speedup_vs_ngram"] > 0
    assert f"| code | {kind} | 2 |" in (tmp_path / "speculative.md").read_text()
