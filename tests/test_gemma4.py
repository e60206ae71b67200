"""Gemma 4 (models/families/gemma4.py): tiny random Gemma4ForCausalLM models from transformers saved
as Hugging Face directories, in two shapes: "e2b-moe" carries every feature of the family at once
(local layers of 32-wide heads and a 6-key window, global layers of 64-wide heads with one KV head
whose values are its keys' projection, per-layer embeddings, the last two layers reading the KV of
earlier ones with double-wide MLPs, routed experts beside every MLP, soft-capped logits); "dense" is
the 31B's layout (no PLE, no sharing, no experts). Checked: fp32 logits equal transformers' over a
context past the window, greedy decoding equals transformers' generate, a verify's rows equal decode
steps bit for bit in bf16, the grouped KV cache's blocks round-trip through the prefix cache, and
speculation (n-gram, a draft model) equals plain decoding through the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import write_tiny_tokenizer
from kernel_checks import needs_kernel
from parity import verify_rows_and_steps

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.engine.core import EngineCore
from quickdraft.engine.prefix_cache import PrefixCacheConfig
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.loading import LoadedModel, load
from quickdraft.models.caches.kv_cache import GroupedKVCache
from quickdraft.models.families.gemma4 import Gemma4LM
from quickdraft.models.families.gemma4_config import Gemma4Config
from quickdraft.models.formats.loader import load_model
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation

WINDOW, VOCAB = 6, 320
LOCAL, GLOBAL = "sliding_attention", "full_attention"
SHAPES: dict[str, dict[str, Any]] = {
    # E2B's layout where KV sharing starts: the last layers with KV of their own are a local
    # then a global one (llama.cpp's reuse rule assumes it)
    "e2b-moe": dict(
        layer_types=[LOCAL, GLOBAL] * 3,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    "dense": dict(
        layer_types=[LOCAL, LOCAL, GLOBAL] * 2,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
    ),
}


def text_config(shape: str) -> dict[str, Any]:
    """Gemma4TextConfig's arguments for the tiny `shape`."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=WINDOW,
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        eos_token_id=2,
        **SHAPES[shape],
    )


def hf_model(shape: str, seed: int = 0, calm: bool = False) -> Any:
    """`calm`: q and k norm weights 0.3 (soft attention: with Gemma 4's unit-norm q, k and
    no scaling, random norms near 1 make every softmax nearly one-hot) and a decisive router
    (std 3): rounding differences between engines then move logits a little, not which key
    or expert wins."""
    import transformers

    cfg = transformers.Gemma4TextConfig(**text_config(shape))
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():  # away from the tiny init: norms and scales near 1, layer scalars 0.9
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.uniform_(0.7, 1.3)
            else:
                p.normal_(0, 0.08)
        for layer in model.model.layers:
            layer.layer_scalar.fill_(0.9)
        if calm:
            for name, p in model.named_parameters():
                if "q_norm" in name or "k_norm" in name:
                    p.fill_(0.3)
                elif "router.proj" in name:
                    p.normal_(0, 3.0)
    return model


@pytest.fixture(scope="module", params=sorted(SHAPES))
def hf_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Path]:
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    hf.save_pretrained(path)
    write_tiny_tokenizer(path)
    return hf, path


@pytest.fixture(scope="module")
def pair(hf_dir: tuple[Any, Path]) -> tuple[Any, Gemma4LM]:
    ours = load_model(hf_dir[1], torch.float32)
    assert isinstance(ours, Gemma4LM)
    return hf_dir[0], ours


def test_config_reads_the_per_layer_shapes(pair: tuple[Any, Gemma4LM]) -> None:
    cfg = pair[1].config
    assert isinstance(cfg, Gemma4Config)
    local = [t == LOCAL for t in cfg.layer_types]
    assert cfg.head_dims == tuple(32 if x else 64 for x in local)
    assert cfg.kv_heads == tuple(2 if x else 1 for x in local)
    shared = cfg.num_kv_shared_layers == 2
    assert cfg.kv_source == ((0, 1, 2, 3, 2, 3) if shared else tuple(range(6)))
    windows = [layer.self_attn.window for layer in pair[1].decoder_layers]
    assert windows == [WINDOW if x else 0 for x in local]


def test_logits_equal_transformers(pair: tuple[Any, Gemma4LM]) -> None:
    """Prefill of 20 tokens (past the 6-key window): every row's logits."""
    hf, ours = pair
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    mine = ours(ids, [ours.new_cache(64)], [20], logit_rows=torch.arange(20)).logits
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_greedy_decoding_equals_transformers_generate(pair: tuple[Any, Gemma4LM]) -> None:
    hf, ours = pair
    ids = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(ids[None], max_new_tokens=24, do_sample=False)[0, 5:].tolist()
    cache = ours.new_cache(8)  # grows past its first room
    logits = ours(ids, [cache], [5]).logits
    cache.commit(5)
    got = []
    for _ in range(24):
        got.append(int(logits[-1].argmax()))
        logits = ours(torch.tensor(got[-1:]), [cache], [1]).logits
        cache.commit(cache.length + 1)
    assert got == want


@needs_kernel
def test_verify_rows_equal_decode_steps(hf_dir: tuple[Any, Path]) -> None:
    """bf16 (the batch-invariant kernels), across the window's edge: a 5-row verify gives each
    row its decode step's bits, shared-KV layers and experts included."""
    ours = load_model(hf_dir[1], torch.bfloat16)
    assert isinstance(ours, Gemma4LM)
    ours.pack_()
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(3))
    rows, steps = verify_rows_and_steps(ours, ids, 9)
    for j in range(5):
        assert torch.equal(rows[j], steps[j]), f"row {j}"


def test_grouped_cache_blocks_round_trip(pair: tuple[Any, Gemma4LM]) -> None:
    """Blocks exported from one cache (both shapes' KV, token-major) and imported into a fresh
    one continue exactly as the cache they came from; a rollback is a commit."""
    ours = pair[1]
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(4))
    first = ours.new_cache(32)
    ours(ids[:12], [first], [12])
    first.commit(12)
    assert len(first.groups) == 2
    blocks = [first.export_kv(0, 4), first.export_kv(4, 8)]
    assert blocks[0].k.shape[:3] == (1, 1, 4)
    second = ours.new_cache(4)
    second.import_kv(blocks)
    assert second.length == 8
    a = ours(ids[8:16], [second], [8], logit_rows=torch.arange(8)).logits
    first.commit(8)  # rollback to the same point
    b = ours(ids[8:16], [first], [8], logit_rows=torch.arange(8)).logits
    assert torch.equal(a, b)
    assert isinstance(second, GroupedKVCache) and second.nbytes() > 0


def generate(lm: LoadedModel, ids: list[int], n: int, spec: Any = None) -> Any:
    req = lm.new_request(ids, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in stream(lm, req, spec):
        pass
    return req


@pytest.fixture(scope="module")
def served(hf_dir: tuple[Any, Path]) -> LoadedModel:
    return load(str(hf_dir[1]), "bf16", progress=False)


@needs_kernel
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "eagle3", "dflash"])
def test_speculation_equals_plain_decoding(
    served: LoadedModel, hf_dir: tuple[Any, Path], method: str, tmp_path: Path
) -> None:
    """bf16 through the engine: greedy speculation (n-gram, suffix; the model as its own draft,
    which agrees with every token; random EAGLE-3 and DFlash heads of its shape, whose drafts
    are mostly rejected and rolled back) gives the tokens of plain decoding."""
    from eagle3_heads import random_drafter_config

    layers = served.model.config.num_hidden_layers  # type: ignore[union-attr]
    fields = random_drafter_config(method, tmp_path / method, hf_dir[1], layers, VOCAB)
    spec = make_speculation(served, SpeculativeConfig(**fields))
    assert spec is not None
    accepted = drafted = 0
    for prompt in ("the cat sat on the mat. the cat sat on", "Hello world, this is a test."):
        ids = served.tokenizer.encode(prompt)
        fast = generate(served, ids, 32, spec)
        assert fast.output_ids == generate(served, ids, 32).output_ids
        accepted, drafted = accepted + fast.spec.accepted, drafted + fast.spec.drafted
    assert drafted > 0
    if method in ("ngram", "suffix", "draft"):
        assert accepted > 0


@needs_kernel
def test_prefix_cache_and_batching_equal_each_alone(served: LoadedModel) -> None:
    """Three requests sharing a prompt prefix stepped together with the prefix cache on (its
    blocks hold both KV shapes) give each the tokens it gets alone."""
    enc = served.tokenizer.encode
    system = "You are a careful assistant. Answer briefly.\n"
    prompts = [enc(system + q) for q in ("What is 2 + 2?", "Name a colour.", "Say hi.")]
    alone = [generate(served, p, 16).output_ids for p in prompts]
    core = EngineCore(
        served,
        SchedulerConfig(max_running=3, max_step_tokens=48, max_prefill_with_decodes=8),
        PrefixCacheConfig(block_size=8),
    )
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for rnd in range(2):  # the second round hits the first's blocks
        reqs = [served.new_request(p, params) for p in prompts]
        for req in reqs:
            core.add(req, None)
        while core.has_work:
            core.step()
        assert [r.output_ids for r in reqs] == alone, f"round {rnd}"
    assert core.prefix is not None and core.prefix.stats.hits > 0
