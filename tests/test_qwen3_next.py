"""Hybrid models (models/families/qwen3_next.py) against transformers 5.x in fp32 on tiny
random-weight configs of each family: prefill, 32 decode steps, and a multi-token verify that
continues the cached state; packing; config parsing; checkpoint-name mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_models import (
    HYBRID_CONFIGS,
    one_thread,  # noqa: F401 (autouse fixture)
    random_hybrid,
    randomize,
    save_hybrid_dir,
)

from quickdraft.kernels import kernels_available
from quickdraft.models.families.hybrid_config import HybridConfig
from quickdraft.models.families.qwen3_next import HybridLM
from quickdraft.models.formats.loader import load_model

FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


def hf_config(family: str) -> Any:
    """The transformers text config of `family` (the ForCausalLM classes take it)."""
    import transformers

    raw = dict(HYBRID_CONFIGS[family].get("text_config", HYBRID_CONFIGS[family]))
    raw.pop("mtp_num_hidden_layers", None)
    model_type = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(family, family)
    raw["model_type"] = model_type
    return transformers.AutoConfig.for_model(**raw)


@pytest.fixture(scope="module", params=FAMILIES)
def hf_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, HybridLM]:
    """(family, transformers model, ours loaded from the transformers checkpoint)."""
    import transformers

    family = request.param
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32)
    randomize(hf, seed=1)
    hf.eval()
    directory = tmp_path_factory.mktemp(f"hf-{family}")
    hf.save_pretrained(directory)
    ours = load_model(directory, torch.float32)
    assert isinstance(ours, HybridLM)
    return family, hf, ours


def test_hybrid_prefill_matches_transformers(hf_pair: tuple[str, Any, HybridLM]) -> None:
    _, hf, ours = hf_pair
    ids = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(1))
    out = ours(ids, [ours.new_cache(40)], [37], logit_rows=torch.arange(37))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert (out.logits - expected).abs().max().item() < 1e-4


def test_hybrid_decode_steps_match_transformers(hf_pair: tuple[str, Any, HybridLM]) -> None:
    """Prefill, then 32 greedy one-token steps, each against transformers' cached decode."""
    _, hf, ours = hf_pair
    ids = torch.tensor([5, 17, 42, 99, 3, 250, 11])
    cache = ours.new_cache(8)  # small on purpose: the KV grows on demand
    ours(ids, [cache], [len(ids)])
    cache.commit(len(ids))
    with torch.no_grad():
        ref = hf(ids[None], use_cache=True)
        past = ref.past_key_values
        for _ in range(32):
            tok = int(ref.logits[0, -1].argmax())
            ref = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = ref.past_key_values
            out = ours(torch.tensor([tok]), [cache], [1])
            cache.commit(cache.length + 1)
            assert (out.logits[0] - ref.logits[0, -1]).abs().max().item() < 1e-4


def test_hybrid_verify_continues_cached_state(hf_pair: tuple[str, Any, HybridLM]) -> None:
    """A 5-token forward after a cached prefix (a verify) scores every row as transformers'
    full forward does (transformers itself would restart a multi-token call from zero)."""
    _, hf, ours = hf_pair
    ids = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(4))
    cache = ours.new_cache(32)
    ours(ids[:25], [cache], [25])
    cache.commit(25)
    out = ours(ids[25:], [cache], [5], logit_rows=torch.arange(5))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0, 25:]
    assert (out.logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_packed_sequences_equal_separate(family: str) -> None:
    """Two sequences at different lengths, packed in one forward, each as if alone."""
    model = random_hybrid(family, seed=2)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 320, (9,), generator=gen), torch.randint(0, 320, (14,), generator=gen)
    alone = []
    for seq in (a, b):
        cache = model.new_cache(16)
        model(seq[:-3], [cache], [len(seq) - 3])
        cache.commit(len(seq) - 3)
        alone.append(model(seq[-3:], [cache], [3], logit_rows=torch.arange(3)).logits)
    ca, cb = model.new_cache(16), model.new_cache(16)
    model(torch.cat([a[:-3], b[:-3]]), [ca, cb], [6, 11])
    ca.commit(6)
    cb.commit(11)
    packed = model(torch.cat([a[-3:], b[-3:]]), [ca, cb], [3, 3], logit_rows=torch.arange(6))
    assert (packed.logits - torch.cat(alone)).abs().max().item() < 1e-4


def test_hybrid_config_reads_composite_and_defaults() -> None:
    composite = HybridConfig.from_dict(HYBRID_CONFIGS["qwen3_5_moe"])
    assert composite.model_type == "qwen3_5_moe" and composite.hidden_size == 64
    assert composite.moe_layers == (True,) * 4 and not composite.interleaved_qkvz
    assert composite.rotary_dim == 8 and composite.mtp_num_hidden_layers == 1
    tied = HybridConfig.from_dict(HYBRID_CONFIGS["qwen3_5"] | {"tie_word_embeddings": True})
    assert tied.tie_word_embeddings  # the top-level (ForConditionalGeneration) flag wins
    # Qwen3-Next style: no layer_types (interval), top-level rope_theta / partial factor
    raw = {k: v for k, v in HYBRID_CONFIGS["qwen3_next"].items() if k != "layer_types"}
    raw.pop("rope_parameters")
    raw.update(
        num_hidden_layers=8, full_attention_interval=4, rope_theta=5e6, decoder_sparse_step=2
    )
    cfg = HybridConfig.from_dict(raw | {"mlp_only_layers": [3]})
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)
    assert cfg.rope_theta == 5e6 and cfg.rotary_dim == 8 and cfg.interleaved_qkvz
    assert cfg.moe_layers == (False, True, False, False, False, True, False, True)
    with pytest.raises(ValueError, match="rope type"):
        HybridConfig.from_dict(raw | {"rope_parameters": {"rope_type": "yarn"}})


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_checkpoint_names_round_trip(family: str, tmp_path: Path) -> None:
    """Our weights saved under the checkpoint's names (per-expert tensors for Qwen3-Next, the
    composite `model.language_model.` prefix for Qwen3.5, a vision tensor, an `mtp.*` head)
    load back into an identical model; the `mtp.*` and vision tensors are not the target's."""
    from hybrid_models import mtp_head_for
    from safetensors.torch import load_file, save_file

    model = random_hybrid(family, seed=5)
    directory = save_hybrid_dir(model, family, tmp_path, mtp_head_for(model, 6), tokenizer=False)
    if family != "qwen3_next":
        tensors = load_file(str(directory / "model.safetensors"))
        tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
        save_file(tensors, str(directory / "model.safetensors"))
    loaded = load_model(directory, torch.float32)
    assert isinstance(loaded, HybridLM)
    ours, theirs = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name


def test_hybrid_bf16_close_to_fp32() -> None:
    """The bf16 path (the benchmark's) runs and stays near fp32 (not a parity test)."""
    fp32 = random_hybrid("qwen3_5_moe", seed=3)
    bf16 = random_hybrid("qwen3_5_moe", seed=3, dtype=torch.bfloat16)
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(0))
    a = fp32(ids, [fp32.new_cache(24)], [20], logit_rows=torch.arange(20)).logits
    b = bf16(ids, [bf16.new_cache(24)], [20], logit_rows=torch.arange(20)).logits
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


@pytest.mark.skipif(not kernels_available(), reason="needs the C++ kernels (AVX2/FMA/F16C)")
@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_bf16_verify_rows_equal_decode_steps(family: str) -> None:
    """bf16 with packed panels (how `load` runs a bf16 hybrid): k + 1 rows in one forward (a
    verify) give each row the bits of k + 1 one-row forwards (decode steps, each committing its
    token), and a verify packed with another sequence's rows gives them again: the Gated
    DeltaNet recurrence, gated attention and (qwen3_5_moe) the routed experts are
    batch-invariant, so greedy speculation equals plain decoding on a hybrid target."""
    model = random_hybrid(family, seed=4, dtype=torch.bfloat16)
    model.pack_()
    ids = torch.randint(0, 320, (60,), generator=torch.Generator().manual_seed(5))
    other = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(6))
    for k in (1, 4, 8):
        decode = model.new_cache(64)
        model(ids[:30], [decode], [30])
        decode.commit(30)
        steps = []
        for j in range(k + 1):
            steps.append(model(ids[30 + j : 31 + j], [decode], [1], return_hidden=True))
            decode.commit(31 + j)
        verify = model.new_cache(64)
        model(ids[:30], [verify], [30])
        verify.commit(30)
        rows = torch.arange(k + 1)
        out = model(ids[30 : 31 + k], [verify], [k + 1], logit_rows=rows, return_hidden=True)
        mate, batched = model.new_cache(64), model.new_cache(64)
        model(other[:17], [mate], [17])
        mate.commit(17)
        model(ids[:30], [batched], [30])
        batched.commit(30)
        both = model(
            torch.cat([other[17:], ids[30 : 31 + k]]),
            [mate, batched],
            [3, k + 1],
            logit_rows=torch.arange(3, 4 + k),
        )
        for j, step in enumerate(steps):
            assert step.hidden is not None and out.hidden is not None
            assert torch.equal(out.logits[j], step.logits[-1]), f"k={k}: row {j} logits differ"
            assert torch.equal(out.hidden[j], step.hidden[-1]), f"k={k}: row {j} hidden differs"
            assert torch.equal(both.logits[j], step.logits[-1]), f"k={k}: batched row {j}"
        # the fp32 recurrent state after committing the verify's rows: bf16 activations round
        # small differences away, the state keeps them
        verify.commit(31 + k)
        for layer in range(verify.shape.num_layers):
            assert torch.equal(verify.gdn_state(layer)[1], decode.gdn_state(layer)[1]), layer


@pytest.mark.skipif(not kernels_available(), reason="needs the C++ kernels (AVX2/FMA/F16C)")
@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_bf16_prompt_whole_equals_prompt_in_chunks(family: str) -> None:
    """A 100-token prompt prefilled in one forward (a long forward: chunks of the delta rule
    kept only at their end), in pieces of 40 + 7 + 53, or in pieces short enough to keep every
    token's update (30 + 33 + 37), then 3 decode steps: the same logits and the same fp32
    recurrent states, bit for bit. The scheduler chunks a prompt around other requests' rows,
    so a request in a batch equals it alone only if this holds."""
    model = random_hybrid(family, seed=7, dtype=torch.bfloat16)
    model.pack_()
    ids = torch.randint(0, 320, (103,), generator=torch.Generator().manual_seed(8))
    results = []
    for pieces in ([100], [40, 7, 53], [30, 33, 37]):
        cache, start = model.new_cache(128), 0
        for n in pieces:
            out = model(ids[start : start + n], [cache], [n])
            start += n
            cache.commit(start)
        for j in range(3):  # decode steps after the prompt
            out = model(ids[100 + j : 101 + j], [cache], [1])
            cache.commit(101 + j)
        states = [cache.gdn_state(layer)[1].clone() for layer in range(cache.shape.num_layers)]
        results.append((out.logits, states))
    for logits, states in results[1:]:
        assert torch.equal(logits, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(states, results[0][1], strict=True))
