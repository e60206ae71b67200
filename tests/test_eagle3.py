"""EAGLE-3 heads (models/heads/eagle3.py, drafters/eagle3.py) on tiny random-weight heads saved in
each layout users bring: the engine's head against the reference forward written from the formulas
(tests/eagle3_heads.py), the taps read against transformers' hidden states by name, greedy
speculation equal to speculation off on dense (fp32, bf16, GGUF), MoE and hybrid targets with a head
built to agree (acceptances) and random heads (rejections), and a clear error for every head that
does not fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_hf_model, write_tiny_tokenizer
from eagle3_heads import (
    HeadSpec,
    agreeing_head,
    random_head,
    reference_drafts,
    save_gguf_head,
    save_head,
)
from hybrid_models import (
    one_thread,  # noqa: F401 (autouse fixture)
    random_hybrid,
    randomize,
    save_hybrid_dir,
)
from kernel_checks import needs_kernel
from parity import packed_propose_equals_alone
from test_mtp import DENSE_CONFIG, PROMPTS, K, generate

from quickdraft.config import ModelConfig, SpeculativeConfig
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.llama import CausalLM
from quickdraft.models.heads.eagle3 import Eagle3Head
from quickdraft.request import SamplingParams
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.drafters.eagle3 import Eagle3Drafter, eagle3_drafter, load_eagle3
from quickdraft.speculation.factory import make_speculation

TARGET_LAYERS = 6  # default taps (2, 3, 3): inputs of layers 2 and 3


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Any]:
    """A tiny Qwen3 checkpoint (ours loaded fp32) and the transformers model of it."""
    directory = tmp_path_factory.mktemp("qwen3")
    hf = make_tiny_hf_model("qwen3", directory, seed=2, num_hidden_layers=TARGET_LAYERS)
    write_tiny_tokenizer(directory)
    return load(str(directory), "fp32", progress=False), hf


CASES: dict[str, tuple[str, HeadSpec]] = {
    "eagle-d2t": ("eagle", HeadSpec(draft_ids=list(range(0, 320, 2)))),
    "speculators-d2t": ("speculators", HeadSpec(draft_ids=list(range(40, 300)))),
    "bin-null-vocab": ("bin", HeadSpec()),
    "flags": (
        "speculators",
        HeadSpec(
            draft_ids=list(range(1, 320, 3)),
            flags=dict(norm_before_residual=True, norm_before_fc=True, norm_output=True),
        ),
    ),
    "two-layers-four-taps": ("eagle", HeadSpec(layers=2, taps=[1, 2, 4, 5], rope_theta=500.0)),
    "target-head-and-embed": ("eagle", HeadSpec(own_lm_head=False)),
    "own-embed-wider-head": (
        "speculators",
        HeadSpec(hidden=96, head_dim=24, own_embed=True, draft_ids=list(range(200))),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_eagle3_head_equals_the_reference_forward(
    case: str, target: tuple[LoadedModel, Any], tmp_path: Path
) -> None:
    """Taps from transformers' hidden_states[i] (the input of layer i), the head recomputed
    from scratch for every draft: the drafter's k chained greedy drafts are the reference's,
    and the first step's logits match over the draft vocabulary (-inf elsewhere)."""
    lm, hf = target
    layout, spec = CASES[case]
    tensors = random_head(spec, seed=7)
    drafter = eagle3_drafter(lm.model, save_head(tmp_path, spec, tensors, layout))
    taps = spec.taps or [2, TARGET_LAYERS // 2, TARGET_LAYERS - 3]
    assert drafter.hidden_layers == tuple(t - 1 for t in taps)  # layer outputs = next inputs
    prompt = lm.tokenizer.encode("the cat sat on the mat, the cat")
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    tapped = torch.cat([out.hidden_states[t][0] for t in taps], -1)  # [T, n * H]
    tokens = [*prompt, int(out.logits[0, -1].argmax())]
    # ours: the target's own tapped layers through the engine's path (commit, propose)
    model: Any = lm.model
    mine = model(
        torch.tensor(prompt),
        [model.new_cache(64)],
        [len(prompt)],
        hidden_layers=drafter.hidden_layers,
    )
    rows = mine.layers.flatten(1)
    torch.testing.assert_close(rows, tapped, atol=1e-5, rtol=1e-5)
    state = drafter.new_state(prompt)
    drafter.commit(state, tokens, rows)
    job = DraftJob(state, tokens, K, SamplingParams(temperature=0.0), torch.Generator())
    (draft,) = drafter.propose([job])
    head_embed = (
        tensors["embed_tokens.weight"]
        if spec.own_embed
        else model.get_parameter("model.embed_tokens.weight")
    )
    lm_head = tensors.get("lm_head.weight")
    if lm_head is None:
        lm_head = model.get_parameter("lm_head.weight")
        if spec.draft_ids is not None:
            lm_head = lm_head[spec.draft_ids]
    want, logits = reference_drafts(
        tensors, spec, tapped, torch.tensor(tokens[1:]), head_embed, lm_head, K
    )
    assert draft.tokens == want
    head = drafter.head
    assert isinstance(head, Eagle3Head)
    cache = head.new_cache(64)
    got, _, _ = head(
        torch.tensor(tokens[1:]),
        head.fuse(tapped),
        [cache],
        [len(prompt)],
        torch.tensor([len(prompt) - 1]),
    )
    cols = torch.tensor(spec.draft_ids) if spec.draft_ids is not None else torch.arange(320)
    torch.testing.assert_close(got[0, cols].double(), logits, atol=1e-4, rtol=1e-4)
    outside = torch.ones(320, dtype=torch.bool)
    outside[cols] = False
    assert bool(torch.isneginf(got[0, outside]).all())


def test_eagle3_default_taps_and_bounds() -> None:
    from quickdraft.models.heads.eagle3 import Eagle3Config

    cfg = Eagle3Config(ModelConfig.from_dict(dict(DENSE_CONFIG)), 64, None, None, "h")
    assert cfg.taps(36) == (2, 18, 33)  # Qwen3-8B's 36 layers
    with pytest.raises(ValueError, match=r"taps \[2, 1, 0\].*1 \.\. 2"):
        cfg.taps(3)


# ------------------------------------------------------------------ speculation on == off


def nudging_dense(directory: Path, dtype: str = "fp32") -> tuple[LoadedModel, Any]:
    """A Qwen3 target whose layers only nudge the residual stream (the bigram guess mostly
    wins), and the model object it was saved from."""
    config = dict(DENSE_CONFIG, num_hidden_layers=4)
    model = CausalLM(ModelConfig.from_dict(config), torch.float32)
    randomize(model, seed=3, out_scale=0.03, offset=False)
    save_hybrid_dir(model, "dense", directory, config=config)
    return load(str(directory), dtype, progress=False), model


def run_parity(
    lm: LoadedModel, head: Path, prompts: list[str], tokens: int = 40, draft_vocab: int = 0
) -> list[Any]:
    spec = make_speculation(
        lm,
        SpeculativeConfig(
            method="eagle3",
            num_draft_tokens=K,
            adaptive=False,
            draft_model=str(head),
            draft_vocab=draft_vocab,
        ),
    )
    assert spec is not None and isinstance(spec.drafter, Eagle3Drafter)
    reqs = []
    for prompt in prompts:
        plain = generate(lm, prompt, None, tokens)
        fast = generate(lm, prompt, spec, tokens)
        assert fast.output_ids == plain.output_ids, prompt
        reqs.append(fast)
    return reqs


def test_eagle3_greedy_equals_plain_with_accepts(tmp_path: Path) -> None:
    lm, model = nudging_dense(tmp_path / "t")
    head = agreeing_head(tmp_path / "h", model.get_parameter("model.norm.weight"))
    reqs = run_parity(lm, head, PROMPTS)
    drafted, accepted = sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)
    assert accepted > 0.3 * drafted  # the pipeline delivers what the head was built to draft
    per_position = [r.spec.accepted_per_position for r in reqs]  # [i]: cycles accepting > i
    assert any(len(p) >= K and p[K - 1] > 0 for p in per_position)  # all K drafts accepted


def test_eagle3_head_of_the_whole_vocabulary_takes_draft_vocab(tmp_path: Path) -> None:
    """`--draft-vocab 160` on a head that scores the whole vocabulary with the target's head:
    it scores ids 0..159 and the end-of-generation id, nothing else; greedy output still equals
    plain decoding, with drafts accepted."""
    lm, model = nudging_dense(tmp_path / "t")
    head = agreeing_head(tmp_path / "h", model.get_parameter("model.norm.weight"))
    cut, _ = load_eagle3(lm.model, head, keep=160, extra=lm.eos_ids)
    assert cut.draft_ids is not None
    assert cut.draft_ids.tolist() == sorted({*range(160), *lm.eos_ids})
    reqs = run_parity(lm, head, PROMPTS, draft_vocab=160)
    assert sum(r.spec.accepted for r in reqs) > 0


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_eagle3_hybrid_and_moe_targets(family: str, tmp_path: Path) -> None:
    """A hybrid MoE target (GDN + attention, routed experts): an agreeing head, then a random
    one (every cycle rolls back its K rows), both token-identical to plain decoding."""
    model = random_hybrid(family, seed=1)
    randomize(model, seed=1, out_scale=0.03)
    lm = load(str(save_hybrid_dir(model, family, tmp_path / "t")), "fp32")
    norm = 1 + model.get_parameter("model.norm.weight")  # (1 + w) -> the Llama convention
    reqs = run_parity(lm, agreeing_head(tmp_path / "h", norm), PROMPTS[:4], tokens=32)
    assert sum(r.spec.accepted for r in reqs) > 0.3 * sum(r.spec.drafted for r in reqs)
    spec = HeadSpec(draft_ids=list(range(0, 320, 3)))
    random = save_head(tmp_path / "r", spec, random_head(spec, seed=3), "eagle")
    reqs = run_parity(lm, random, PROMPTS[:2], tokens=24)
    assert sum(r.spec.drafted for r in reqs) >= 2 * 15


@needs_kernel
def test_eagle3_bf16_packed_target(tmp_path: Path, kernels_enabled: None) -> None:
    """bf16 on the packed kernels, the head packed like the target: identical to plain."""
    lm, model = nudging_dense(tmp_path / "t", "bf16")
    head = agreeing_head(tmp_path / "h", model.get_parameter("model.norm.weight"))
    reqs = run_parity(lm, head, PROMPTS[:4], tokens=32)
    assert sum(r.spec.accepted for r in reqs) > 0


def test_eagle3_gguf_target(home: Path, tmp_path: Path) -> None:
    """A Q4_K/Q6_K GGUF target run in its own formats, the head sharing its quantized
    embedding and head rows: identical to plain."""
    from test_gguf_loader import HIDDEN, TYPES, VOCAB, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "t.gguf", "qwen3", TYPES["qwen3"])
    lm = load(str(path), "gguf", progress=False)
    spec = HeadSpec(
        target_hidden=HIDDEN,
        hidden=HIDDEN,
        vocab=VOCAB,
        taps=[1, 1, 1],
        own_lm_head=False,
        draft_ids=list(range(0, VOCAB, 2)),
    )
    head = save_head(tmp_path / "h", spec, random_head(spec, seed=2), "eagle")
    reqs = run_parity(lm, head, PROMPTS[:2], tokens=24)
    assert sum(r.spec.drafted for r in reqs) > 0


# ------------------------------------------------------------------ heads that do not fit


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "other-width": (
        dict(target_hidden_size=96),
        r"target_hidden_size 96 .*another target; this one has 64",
    ),
    "other-vocab": (dict(vocab_size=500), r"vocab_size 500.*320.*another tokenizer"),
    "no-d2t": (dict(draft_vocab_size=100), r"draft_vocab_size 100 but no d2t"),
    "unknown-flag": (dict(norm_after_everything=True), r"unknown EAGLE-3 flag norm_after_every"),
    "fc-norm": (dict(fc_norm=True), r"fc_norm = True.*not supported"),
    "taps": (dict(eagle_aux_hidden_state_layer_ids=[1, 2, 6]), r"taps \[1, 2, 6\]"),
    "rope": (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"rope type 'llama3'"),
    "eagle1": (dict(eagle_config={"use_aux_hidden_state": False}), r"use_aux_hidden_state"),
    "act": (dict(hidden_act="gelu"), r"hidden_act 'gelu'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_eagle3_head_that_does_not_fit_fails_by_name(
    case: str, target: tuple[LoadedModel, Any], tmp_path: Path
) -> None:
    lm, _ = target
    change, message = BAD[case]
    spec = HeadSpec()
    directory = save_head(tmp_path, spec, random_head(spec, seed=1), "eagle")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message) as info:
        eagle3_drafter(lm.model, directory)
    assert str(directory) in str(info.value)


def test_eagle3_broken_files_fail_by_name(target: tuple[LoadedModel, Any], tmp_path: Path) -> None:
    lm, _ = target
    spec = HeadSpec()
    tensors = random_head(spec, seed=1)
    wrong = dict(tensors, **{"fc.weight": torch.zeros(64, 128)})  # two taps' width
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 128\).*3 taps"):
        eagle3_drafter(lm.model, save_head(tmp_path / "a", spec, wrong, "eagle"))
    extra = dict(tensors, **{"layers.0.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(
        ValueError, match=r"model.safetensors: unexpected tensor 'midlayer.self_attn.q_norm"
    ):
        eagle3_drafter(lm.model, save_head(tmp_path / "b", spec, extra, "eagle"))
    missing = {n: t for n, t in tensors.items() if n != "norm.weight"}
    with pytest.raises(ValueError, match=r"lacks tensors: \['norm.weight'\]"):
        eagle3_drafter(lm.model, save_head(tmp_path / "c", spec, missing, "speculators"))
    pickled = save_head(tmp_path / "d", spec, tensors, "bin")
    torch.save({"fc.weight": tensors["fc.weight"], "code": print}, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"not a weights-only checkpoint"):
        eagle3_drafter(lm.model, pickled)
    with pytest.raises(ValueError, match=r"needs the head: --draft-model"):
        make_speculation(lm, SpeculativeConfig(method="eagle3", adaptive=False))


def test_eagle3_gguf_head_equals_its_safetensors(
    target: tuple[LoadedModel, Any], tmp_path: Path
) -> None:
    """llama.cpp's eagle3 GGUF of a head (permuted q/k, F16 MLP, int64 d2t) drafts what the
    safetensors head with the same (F16-rounded) values drafts, with the same logits."""
    lm, _ = target
    spec = HeadSpec(draft_ids=list(range(0, 320, 2)), flags=dict(norm_before_residual=True))
    tensors = random_head(spec, seed=9)
    for name, t in tensors.items():  # the values the GGUF's F16 MLP holds
        if ".mlp." in name:
            tensors[name] = t.half().float()
    taps = [2, TARGET_LAYERS // 2, TARGET_LAYERS - 3]
    (tmp_path / "g").mkdir()
    gguf_file = save_gguf_head(tmp_path / "g" / "head.gguf", spec, tensors, taps)
    heads = [
        eagle3_drafter(lm.model, save_head(tmp_path / "s", spec, tensors, "speculators")),
        eagle3_drafter(lm.model, gguf_file),
        eagle3_drafter(lm.model, tmp_path / "g"),  # the directory holding it
    ]
    prompt = lm.tokenizer.encode("abcabcabc, the cat")
    model: Any = lm.model
    out = model(
        torch.tensor(prompt),
        [model.new_cache(64)],
        [len(prompt)],
        hidden_layers=heads[0].hidden_layers,
        logit_rows=torch.tensor([len(prompt) - 1]),
    )
    tokens = [*prompt, int(out.logits[-1].argmax())]
    drafts = []
    for drafter in heads:
        assert drafter.hidden_layers == heads[0].hidden_layers
        state = drafter.new_state(prompt)
        drafter.commit(state, tokens, out.layers.flatten(1))
        job = DraftJob(state, tokens, K, SamplingParams(temperature=0.0), torch.Generator())
        drafts.append(drafter.propose([job])[0].tokens)
    assert drafts[0] == drafts[1] == drafts[2] and len(drafts[0]) == K
    logits = []  # every row's, over a long prompt: RoPE pairs reach far back
    for drafter in heads[:2]:
        head = drafter.head
        assert isinstance(head, Eagle3Head)
        rows = torch.arange(len(prompt))
        g = head.fuse(out.layers.flatten(1))
        logits.append(
            head(torch.tensor(tokens[1:]), g, [head.new_cache(64)], [len(prompt)], rows)[0]
        )
    assert torch.equal(logits[0], logits[1])  # the same values in fp32: the same bits


def test_eagle3_gguf_of_another_architecture_fails_by_name(
    target: tuple[LoadedModel, Any], tmp_path: Path
) -> None:
    from test_gguf_loader import TYPES, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", TYPES["llama"])
    with pytest.raises(ValueError, match=r"llama.gguf: GGUF architecture 'llama', not an EAGLE-3"):
        eagle3_drafter(target[0].model, path)
    with pytest.raises(ValueError, match=r"no such EAGLE-3 head"):
        eagle3_drafter(target[0].model, tmp_path / "missing")


def test_eagle3_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`quickdraft generate --speculative-method eagle3 --draft-model HEAD` prints what plain
    decoding prints (and the vLLM-style JSON names the method too)."""
    from quickdraft.cli import main as cli_main

    _, model = nudging_dense(tmp_path / "t")  # saved with the byte-level tokenizer
    head = agreeing_head(tmp_path / "h", model.get_parameter("model.norm.weight"))
    base = ["generate", "--model", str(tmp_path / "t"), "--dtype", "fp32", "--max-tokens", "24"]
    texts = []
    for extra in (
        ["--speculative-method", "none"],
        ["--speculative-method", "eagle3", "--draft-model", str(head)],
        ["--speculative-config", json.dumps({"method": "eagle3", "model": str(head)})],
    ):
        assert cli_main([*base, *extra, "the cat sat on the"]) == 0
        texts.append(capsys.readouterr().out.splitlines()[0])
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) > len("the cat sat on the")


def test_eagle3_batched_propose_equals_alone(
    target: tuple[LoadedModel, Any], tmp_path: Path
) -> None:
    """Jobs of different lengths, k and sampling packed into one propose (one packed fc over
    every job's taps, one catch-up forward) draft what each drafts alone."""
    lm, _ = target
    spec = HeadSpec(draft_ids=list(range(0, 320, 2)))
    drafter = eagle3_drafter(lm.model, save_head(tmp_path, spec, random_head(spec, 4), "eagle"))
    model: Any = lm.model

    def prime(prompt: list[int]) -> tuple[Any, list[int]]:
        fwd = model(
            torch.tensor(prompt),
            [model.new_cache(64)],
            [len(prompt)],
            hidden_layers=drafter.hidden_layers,
        )
        tokens = [*prompt, int(fwd.logits[-1].argmax())]
        state = drafter.new_state(prompt)
        drafter.commit(state, tokens, fwd.layers.flatten(1))
        return state, tokens

    packed_propose_equals_alone(drafter, prime, K)
