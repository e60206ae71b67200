"""The engine on an NVIDIA GPU (`--device cuda`): a replayed CUDA graph gives the eager step's
logits; fp32 greedy output with speculation equals speculation off for every drafter (a dense
target behind GraphModel, a random hybrid target with its MTP head eagerly); bf16 and GGUF
targets, every GEMM batch-invariant, equal it exactly too (on cuBLAS, bf16 differs only at
near-ties: the top-2 gaps are printed); the rejection sampler keeps the target's
distribution. Skipped, with the reason, where torch sees no GPU (CI has none)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hybrid_models import copying_head, random_hybrid, randomize, save_hybrid_dir
from parity import PROMPTS as ALL_PROMPTS
from parity import forced_draft, generate, greedy_parity
from second_token import assert_second_token_follows, plain_distribution, second_token_marginal

from quickdraft.config import SpeculativeConfig
from quickdraft.kernels import pointwise, triton_linear
from quickdraft.loading import LoadedModel, load
from quickdraft.models.graphs import GraphModel, graph_key
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda)"),
]

PROMPTS = ALL_PROMPTS[:6]


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> LoadedModel:
    lm = load(str(tiny_model_dir), "fp32", device="cuda", progress=False)
    assert isinstance(lm.model, GraphModel) and lm.model.graphs
    return lm


def test_replayed_graph_gives_the_eager_logits(target: LoadedModel) -> None:
    model = target.model
    assert isinstance(model, GraphModel)
    gen = torch.Generator().manual_seed(0)
    caches = [model.new_cache(64) for _ in range(3)]
    prompt = torch.randint(0, 300, (30,), generator=gen)
    model(prompt, caches, [10, 10, 10])
    for c in caches:
        c.commit(10)
    for num_new in ([1], [1, 1, 1], [5, 2, 1], [6]):
        ids = torch.randint(0, 300, (sum(num_new),), generator=gen).cuda()
        rows = torch.arange(sum(num_new), device="cuda")
        used = caches[: len(num_new)]
        need = max(c.length + n for c, n in zip(used, num_new, strict=True))
        assert graph_key(num_new, need, model.pool.capacity) is not None
        before = model.replays
        graphed = model(ids, used, num_new, logit_rows=rows).logits
        assert model.replays == before + 1
        model.graphs = False
        eager = model(ids, used, num_new, logit_rows=rows).logits
        model.graphs = True
        # the same math on padded vs exact shapes: equal up to fp32 summation order
        torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
        again = model(ids, used, num_new, logit_rows=rows).logits
        assert torch.equal(again, graphed)  # a replay is deterministic


def forced(method: str, draft: Path | None) -> SpeculativeConfig:
    """`method` ("ngram", "suffix", "draft-...") drafting 4 tokens every cycle."""
    return SpeculativeConfig(
        method=method.split("-")[0],
        num_draft_tokens=4,
        draft_model=str(draft) if draft else None,
        draft_quantization="none",
        ngram_min=1,
        ngram_max=3,
        adaptive=False,
    )


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft-near", "draft-self"])
def test_fp32_greedy_equals_plain_on_the_gpu(
    target: LoadedModel, near_draft_dir: Path, tiny_model_dir: Path, method: str
) -> None:
    draft_dir = {"draft-near": near_draft_dir, "draft-self": tiny_model_dir}.get(method)
    cfg = forced(method, draft_dir)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    drafted, accepted = greedy_parity(target, PROMPTS, params, cfg)
    assert drafted > 0 and accepted > 0
    if method == "draft-self":
        assert accepted / drafted >= 0.98


def test_hybrid_target_with_mtp_greedy_equals_plain_on_the_gpu(tmp_path: Path) -> None:
    model = random_hybrid("qwen3_next", seed=1)
    randomize(model, seed=1, out_scale=0.03)
    directory = save_hybrid_dir(model, "qwen3_next", tmp_path, copying_head(model))
    lm = load(str(directory), "fp32", device="cuda", progress=False)
    assert lm.model.device.type == "cuda"
    cfg = SpeculativeConfig(method="mtp", num_draft_tokens=3, adaptive=False)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert greedy_parity(lm, PROMPTS[:4], params, cfg)[1] > 0


def test_bf16_speculation_is_exact_on_invariant_gemms(bf16_pair: tuple[Path, Path]) -> None:
    """With the GEMMs on triton_linear (the default on a GPU) every op of the bf16 forward is
    batch-invariant: greedy output with a draft model equals speculation off exactly."""
    target_dir, draft_dir = bf16_pair
    lm = load(str(target_dir), "bf16", device="cuda", progress=False)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    assert greedy_parity(lm, PROMPTS, params, forced_draft(draft_dir, 4))[1] > 0


def test_bf16_on_cublas_diverges_only_at_near_ties(
    bf16_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On cuBLAS (QUICKDRAFT_CUBLAS=1), which picks its kernel by the row count, a bf16 row can
    round differently in a verify than in a decode step: the outputs may part, but only where
    the plain run's top two logits were nearly tied. Prints each divergence's gap."""
    monkeypatch.setattr(triton_linear, "ENABLED", False)
    target_dir, draft_dir = bf16_pair
    lm = load(str(target_dir), "bf16", device="cuda", progress=False)
    cfg = forced_draft(draft_dir, 4)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    model = lm.model
    gaps = []
    for prompt in PROMPTS:
        plain = generate(lm, prompt, params, SpeculativeConfig())
        spec = generate(lm, prompt, params, cfg)
        if spec.output_ids == plain.output_ids:
            continue
        at = next(
            i
            for i, (a, b) in enumerate(zip(plain.output_ids, spec.output_ids, strict=True))
            if a != b
        )
        ids = [*plain.prompt_ids, *plain.output_ids[:at]]
        cache = model.new_cache(len(ids) + 1)
        logits = model(torch.tensor(ids), [cache], [len(ids)]).logits[0].float()
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
    print(f"bf16 divergences: {len(gaps)} of {len(PROMPTS)} prompts, top-2 gaps {gaps}")
    assert all(g < 0.25 for g in gaps), gaps


def test_rejection_sampler_keeps_the_distribution_on_the_gpu(
    target: LoadedModel, near_draft_dir: Path
) -> None:
    spec = make_speculation(target, forced_draft(near_draft_dir, 2))
    prompt = target.tokenizer.encode("ab")
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=6, ignore_eos=True)
    marginal = second_token_marginal(plain_distribution(target, params), prompt)
    reqs = assert_second_token_follows(
        target, spec, prompt, lambda seed: replace(params, seed=seed), marginal, 2000
    )
    drafted, accepted = sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_pointwise_ops_are_the_references(dtype: torch.dtype) -> None:
    """The GPU's one-launch norms and four-op RoPE (kernels/pointwise.py) against the plain
    references, one output rounding apart."""
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(5, 1536, device="cuda", generator=g).to(dtype)
    delta = torch.randn(5, 1536, device="cuda", generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(1536, device="cuda", generator=g)).to(dtype)
    torch.testing.assert_close(
        pointwise.rms_norm(x, w, 1e-6), pointwise.reference_rms_norm(x, w, 1e-6), **tol
    )
    s, y = pointwise.add_rms_norm(x, delta, w, 1e-6)
    s_ref, y_ref = pointwise.reference_add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, **tol)
    qk = torch.randn(5, 14, 128, device="cuda", generator=g).to(dtype)
    angles = torch.rand(5, 64, device="cuda", generator=g) * 6
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    out = pointwise.rope_rows(qk, cos, pointwise.signed_sin(sin))
    torch.testing.assert_close(out, pointwise.reference_rope(qk, cos, sin), **tol)


@pytest.mark.parametrize("method", ["ngram", "draft-self"])
def test_gguf_target_keeps_its_formats_and_speculation_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """A GGUF model on the GPU keeps its block formats (the Triton GGUF kernels, its table in
    its format), and every op of its forward is batch-invariant: greedy output with
    speculation equals speculation off in bf16, bit for bit, not just at near-ties."""
    from test_gguf_loader import TYPES, write_tiny_gguf

    from quickdraft.kernels.triton_gguf import DeviceGGUFEmbedding, DeviceGGUFWeight

    monkeypatch.setenv("QUICKDRAFT_HOME", str(tmp_path / "home"))
    path = write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", TYPES["qwen2"])
    lm = load(str(path), "gguf", device="cuda", progress=False)
    model = lm.model
    assert isinstance(model, GraphModel) and model.graphs and model.fused
    assert isinstance(model.inner.model.embed_tokens, DeviceGGUFEmbedding)
    assert isinstance(model.inner.head, DeviceGGUFWeight)
    cfg = forced(method, path if method == "draft-self" else None)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    drafted, accepted = greedy_parity(lm, PROMPTS, params, cfg)
    assert drafted > 0 and accepted > 0
