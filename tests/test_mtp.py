"""MTP self-speculation (drafters/mtp.py, models/heads/mtp.py) on tiny random-weight checkpoints:
greedy output token-identical to speculation off for each hybrid family and for a dense target
carrying a head, with a random head (rejections) and with a head built to agree with the target
(acceptances at every position, every rollback count); batched propose; the pre-norm feed;
structural checks without real checkpoints: head weight names round trip, missing or unsupported
head fails fast, the disable switch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_models import (
    HYBRID_CONFIGS,
    copying_head,
    mtp_head_for,
    one_thread,  # noqa: F401 (autouse fixture)
    random_hybrid,
    randomize,
    save_hybrid_dir,
)
from parity import packed_propose_equals_alone
from safetensors.torch import load_file, save_file

from quickdraft.bench.speculative import prompt_sets
from quickdraft.config import ModelConfig, SpeculativeConfig
from quickdraft.engine import Engine, ServedModel, stream
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.kernels import PanelWeight, kernels_available
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.llama import CausalLM
from quickdraft.models.formats.loader import load_model
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.cost import model_cost
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.drafters.mtp import MTPDrafter, load_mtp_head, mtp_drafter
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import Speculation

FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
K = 4
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(",
    "the cat sat on the mat. the cat sat on the",
    '{"name": "x", "id": 1}, {"name": ',
    "abcabcabcabc",
    "Hello, world! Hello",
    "1, 2, 3, 4, 5,",
    "for i in range(10):\n",
    "zzz yyy xxx",
]
SPEC = SpeculativeConfig(method="mtp", num_draft_tokens=K, adaptive=False)  # always K drafts
DENSE_CONFIG: dict[str, Any] = dict(
    model_type="qwen3",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    eos_token_id=2,
)


def generate(lm: LoadedModel, prompt: str, spec: Speculation | None, tokens: int = 64) -> Request:
    req = lm.new_request(
        lm.tokenizer.encode(prompt), SamplingParams(max_tokens=tokens, ignore_eos=True)
    )
    for _ in stream(lm, req, spec):
        pass
    return req


def accept_counts(reqs: list[Request]) -> list[int]:
    """Cycles per number of accepted drafts 0..K (all cycles here draft K, bar the last few)."""
    hist = [0] * (K + 1)
    for req in reqs:
        at_least = [*req.spec.accepted_per_position, 0]  # [i]: cycles accepting > i drafts
        hist[0] += req.spec.cycles - at_least[0]
        for a in range(1, K + 1):
            hist[a] += at_least[a - 1] - (at_least[a] if a < len(at_least) else 0)
    return hist


def run_parity(lm: LoadedModel, prompts: list[str] = PROMPTS, tokens: int = 64) -> list[Request]:
    spec = make_speculation(lm, SPEC)
    assert spec is not None
    reqs = []
    for prompt in prompts:
        plain = generate(lm, prompt, None, tokens)
        fast = generate(lm, prompt, spec, tokens)
        assert fast.output_ids == plain.output_ids, prompt
        reqs.append(fast)
    return reqs


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_greedy_equals_plain_with_accepts_at_every_position(
    family: str, tmp_path: Path
) -> None:
    """8 prompts x 64 tokens. The target's layers only nudge the residual stream and the head
    predicts the target's embedding-only (bigram) guess: drafts are accepted often but not
    always, so every accept count 0..K (every rollback count) occurs."""
    model = random_hybrid(family, seed=1)
    randomize(model, seed=1, out_scale=0.03)
    lm = load(str(save_hybrid_dir(model, family, tmp_path, copying_head(model))), "fp32")
    reqs = run_parity(lm)
    drafted, accepted = sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)
    assert accepted / drafted > 0.3
    hist = accept_counts(reqs)
    assert all(n > 0 for n in hist), hist


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_random_head_greedy_equals_plain(family: str, tmp_path: Path) -> None:
    """A full-scale random target (state errors would flip tokens) with a random head: nearly
    every cycle rejects at once (the rollback of all K drafted rows)."""
    model = random_hybrid(family, seed=1)
    lm = load(str(save_hybrid_dir(model, family, tmp_path, mtp_head_for(model, 2))), "fp32")
    reqs = run_parity(lm, PROMPTS[:3], tokens=48)
    assert sum(r.spec.drafted for r in reqs) >= 3 * 40  # drafted every cycle


@pytest.mark.skipif(not kernels_available(), reason="needs the C++ kernels (AVX2/FMA/F16C)")
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_bf16_greedy_equals_plain_on_the_prompt_set(family: str, tmp_path: Path) -> None:
    """bf16 (packed panels, batch-invariant kernels: the Gated DeltaNet verify, gated attention,
    routed experts) on the repo's fixed prompt set, 3 code, 3 prose and 3 JSON prompts of
    quickdraft/prompts/spec_bench.json, 48 tokens each: MTP self-speculation equals
    speculation off token for token, with drafts accepted and rejected."""
    model = random_hybrid(family, seed=1)
    lm = load(str(save_hybrid_dir(model, family, tmp_path, copying_head(model))), "bf16")
    sets = prompt_sets()
    prompts = [p for name in ("code", "prose", "json") for p in sets[name][:3]]
    reqs = run_parity(lm, prompts, tokens=48)
    drafted, accepted = sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)
    assert 0 < accepted < drafted


@pytest.mark.skipif(not kernels_available(), reason="needs the C++ kernels (AVX2/FMA/F16C)")
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_bf16_batch_of_4_equals_alone(family: str, tmp_path: Path) -> None:
    """bf16 hybrid with MTP on: 6 requests through the engine, 4 at a time (their prompts in
    chunks of up to 48 or 8 rows beside other requests' decode and verify rows) each get the
    tokens they get alone with speculation off, their prompt prefilled in one forward. The
    target's layers nudge the residual stream, so the copying head's drafts are accepted
    often: with full-scale layers acceptance was a matter of luck (0-2 drafts of ~700)."""
    model = random_hybrid(family, seed=1)
    randomize(model, seed=1, out_scale=0.3)
    lm = load(str(save_hybrid_dir(model, family, tmp_path, copying_head(model))), "bf16")
    sets = prompt_sets()
    prompts = [p for name in ("code", "prose", "json") for p in sets[name][:2]]
    alone = [generate(lm, p, None, 40).output_ids for p in prompts]
    scheduler = SchedulerConfig(max_running=4, max_step_tokens=48, max_prefill_with_decodes=8)
    engine = Engine({"m": ServedModel(lm, SPEC)}, scheduler=scheduler)
    engine.start()
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        handles = [engine.submit("m", lm.tokenizer.encode(p), params) for p in prompts]
        outs = [list(h) for h in handles]
    finally:
        engine.stop()
    assert [[t for o in out for t in o.token_ids] for out in outs] == alone
    assert engine.step_stats["m"].max_batch == 4  # requests really ran together
    assert sum(out[-1].spec.accepted for out in outs) > 0


def test_mtp_dense_target_with_head(tmp_path: Path) -> None:
    """A dense (Qwen3) target carrying an `mtp.*` head: same drafter, same guarantees."""
    model = CausalLM(ModelConfig.from_dict(DENSE_CONFIG), torch.float32)
    randomize(model, seed=3, out_scale=0.03, offset=False)
    directory = save_hybrid_dir(model, "dense", tmp_path, copying_head(model), config=DENSE_CONFIG)
    lm = load(str(directory), "fp32")
    assert isinstance(lm.model, CausalLM)
    reqs = run_parity(lm, PROMPTS[:4], tokens=32)
    assert sum(r.spec.accepted for r in reqs) > 0.3 * sum(r.spec.drafted for r in reqs)


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    model = random_hybrid("qwen3_5_moe", seed=1)
    randomize(model, seed=1, out_scale=0.03)
    head = copying_head(model)
    return load(
        str(save_hybrid_dir(model, "qwen3_5_moe", tmp_path_factory.mktemp("a"), head)), "fp32"
    )


def primed_state(lm: LoadedModel, drafter: MTPDrafter, prompt: list[int]) -> tuple[Any, list[int]]:
    """A drafter state after the prompt's prefill (its hidden rows committed)."""
    model = lm.model
    out = model(torch.tensor(prompt), [model.new_cache(64)], [len(prompt)], return_hidden=True)
    tokens = [*prompt, int(out.logits[-1].argmax())]
    state = drafter.new_state(prompt)
    drafter.commit(state, tokens, out.hidden)
    return state, tokens


def test_mtp_batched_propose_equals_alone(agreeing: LoadedModel) -> None:
    """Jobs of different lengths and k packed into one propose draft what each drafts alone
    (greedy and seeded sampling)."""
    drafter = mtp_drafter(agreeing.model, agreeing.path)
    packed_propose_equals_alone(drafter, lambda p: primed_state(agreeing, drafter, p), K)


def test_mtp_pre_norm_feed_recovers_residual_stream(agreeing: LoadedModel) -> None:
    """The "pre_norm" switch: post-norm hidden / final-norm scale, normalised by the head's
    pre_fc_norm_hidden, equals the normalised pre-norm residual stream (up to the norms' eps
    relative to the stream's mean square, ~1e-4 for this tiny model's small activations)."""
    model = agreeing.model
    drafter = mtp_drafter(model, agreeing.path, feed="pre_norm")
    ids = torch.tensor([5, 9, 77, 3, 18, 250])
    last = len(HYBRID_CONFIGS["qwen3_5_moe"]["text_config"]["layer_types"]) - 1
    stream: list[torch.Tensor] = []  # the last layer's output: the pre-norm residual stream
    hook = model.get_submodule(f"model.layers.{last}").register_forward_hook(
        lambda module, args, output: stream.append(output)
    )
    try:
        out = model(ids, [model.new_cache(8)], [6], return_hidden=True)
    finally:
        hook.remove()
    assert out.hidden is not None and drafter.unnorm is not None
    norm = drafter.head.pre_fc_norm_hidden
    expected = norm(stream[0])
    assert (norm(out.hidden * drafter.unnorm) - expected).abs().max().item() < 1e-3
    state, tokens = primed_state(agreeing, drafter, ids.tolist())
    gen = torch.Generator()
    assert len(drafter.propose([DraftJob(state, tokens, K, SamplingParams(), gen)])[0].tokens) == K


@pytest.mark.parametrize("family", [*FAMILIES, "dense"])
def test_mtp_head_weight_names_round_trip(family: str, tmp_path: Path) -> None:
    if family == "dense":
        model: Any = CausalLM(ModelConfig.from_dict(DENSE_CONFIG), torch.float32)
        randomize(model, seed=4, offset=False)
    else:
        model = random_hybrid(family, seed=4)
    head = mtp_head_for(model, seed=5)
    config = DENSE_CONFIG if family == "dense" else None
    save_hybrid_dir(model, family, tmp_path, head, tokenizer=False, config=config)
    loaded = load_mtp_head(load_model(tmp_path, torch.float32), tmp_path)
    ours, theirs = dict(head.named_parameters()), dict(loaded.named_parameters())
    assert ours.keys() == theirs.keys() and ours
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name


@pytest.fixture(scope="module")
def headless_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hybrid_dir(
        random_hybrid("qwen3_5", seed=1), "qwen3_5", tmp_path_factory.mktemp("headless")
    )


def test_mtp_missing_head_fails_fast(
    headless_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lm = load(str(headless_dir), "fp32", progress=False)
    with pytest.raises(ValueError, match="no MTP head"):
        make_speculation(lm, SPEC)
    # imported here: the CLI brings the server (fastapi), which the GPU image lacks, and
    # tests/test_graphs.py imports this module's helpers on the GPU (bench/gpu_session.sh)
    from quickdraft.cli import main as cli_main

    argv = ["generate", "--model", str(headless_dir), "--dtype", "fp32", "--max-tokens", "4"]
    assert cli_main([*argv, "--speculative-method", "mtp", "hi"]) == 2
    assert "no MTP head (no mtp.* tensors)" in capsys.readouterr().err


def test_mtp_multi_layer_head_fails_fast(tmp_path: Path) -> None:
    model = random_hybrid("qwen3_5", seed=1)
    directory = save_hybrid_dir(model, "qwen3_5", tmp_path, mtp_head_for(model, 2))
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["mtp.layers.1.input_layernorm.weight"] = torch.zeros(64)
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="only single-layer heads"):
        make_speculation(load(str(directory), "fp32", progress=False), SPEC)
    config = json.loads((directory / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1


def test_mtp_disable_switch(headless_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculation off (env switch or method none) never touches the head: no error even on a
    checkpoint without one, and generation runs plainly."""
    lm = load(str(headless_dir), "fp32", progress=False)
    assert make_speculation(lm, SpeculativeConfig(method="none")) is None
    monkeypatch.setenv("QUICKDRAFT_DISABLE_SPECULATION", "1")
    assert make_speculation(lm, SPEC) is None
    req = generate(lm, "hi", make_speculation(lm, SPEC), tokens=8)
    assert len(req.output_ids) == 8 and req.spec.drafted == 0


@pytest.mark.skipif(not kernels_available(), reason="no CPU kernels: bf16 weights stay unpacked")
def test_packed_bf16_target_and_head_match_unpacked(tmp_path: Path) -> None:
    """`load` packs a bf16 CPU model's operands into panels; the packed target and its MTP head
    (sharing the target's packed lm_head, not a copy) compute what the unpacked ones do, up to
    summation order, and the nn.Linear-layout weights are released."""
    model = random_hybrid("qwen3_5_moe", seed=5, dtype=torch.bfloat16)
    directory = save_hybrid_dir(model, "qwen3_5_moe", tmp_path, mtp_head_for(model, 6))
    lm = load(str(directory), "bf16")
    packed, ref = lm.model, load_model(directory, torch.bfloat16)
    assert isinstance(getattr(packed, "head", None), PanelWeight)
    assert packed.get_parameter("lm_head.weight").numel() == 0  # released
    ids = torch.randint(0, 320, (13,), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(len(ids))
    outs = []
    for net in (packed, ref):
        cache = net.new_cache(32)
        prefill = net(ids[:9], [cache], [9], logit_rows=rows[:9], return_hidden=True)
        cache.commit(9)
        verify = net(ids[9:], [cache], [4], logit_rows=rows[:4]).logits  # a 4-row verify
        outs.append((prefill.logits, verify, prefill.hidden))
    for got, want in zip(outs[0], outs[1], strict=True):
        assert got is not None and want is not None
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2e-2
    assert (outs[0][1].argmax(-1) == outs[1][1].argmax(-1)).float().mean() >= 0.75
    head, ref_head = mtp_drafter(packed, lm.path).head, load_mtp_head(ref, directory)
    assert head.lm_head_weight is getattr(packed, "head", None)  # shared, not a second copy
    assert isinstance(head.fc_weight, PanelWeight)
    hidden = outs[1][2]
    assert hidden is not None
    got_h, want_h = (
        h(ids[1:9], hidden[:8], [h.new_cache(16)], [8], torch.arange(8))[0]
        for h in (head, ref_head)
    )
    assert ((got_h - want_h).abs().max() / want_h.abs().max()) < 2e-2


def test_mtp_adaptive_prices_the_head_from_the_target_table(agreeing: LoadedModel) -> None:
    """With the adaptive policy the head's cost table is the target's step-cost table scaled
    by one timed head step over the target's 1-row step; output stays plain greedy's."""
    spec = make_speculation(agreeing, SpeculativeConfig(method="mtp", num_draft_tokens=K))
    assert spec is not None and spec.draft_cost is not None
    target, head = model_cost(agreeing.model), spec.draft_cost.table
    assert head.rows == target.rows and head.seconds[0] > 0
    ratio = head.seconds[0] / target.seconds[0]
    assert head.seconds == pytest.approx(tuple(s * ratio for s in target.seconds))
    assert generate(agreeing, PROMPTS[0], spec, 24).output_ids == (
        generate(agreeing, PROMPTS[0], None, 24).output_ids
    )
