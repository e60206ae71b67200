"""DFlash block drafter (models/heads/dflash.py, drafters/dflash.py) on tiny random checkpoints
written in the public layout (no trained DFlash weights exist offline), beside tiny random dense
(Qwen3) and hybrid (Qwen3.5) targets. Over 400 lines: the checkpoint writers, the rig and the naive
reference the other tests compare against live here with them.

Structure: the config and tensor names round trip, refusals, the forward against a naive
re-implementation of the public description (context K/V from the taps, non-causal block,
real RoPE positions), the attention mask pattern, the tapped layers (HF's hidden_states[i + 1];
the fused C++ dense path; that only the tapped layers reach the drafts), rollback == recompute.
End to end: greedy output identical to speculation off with a random drafter (rejections) and
with a rigged drafter whose drafts are the target's guess after the last token (every accept
count 0..k), batched == alone (propose, and 4 requests through the engine with chunked
prompts), the sampled output's distribution (chi-square), block size caps, the CLI flags.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_hf_model, write_tiny_tokenizer
from hybrid_models import (
    HYBRID_CONFIGS,
    one_thread,  # noqa: F401 (autouse fixture)
    random_hybrid,
    randomize,
    save_hybrid_dir,
)
from safetensors.torch import save_file
from second_token import assert_second_token_follows, plain_distribution, second_token_marginal
from test_mtp import DENSE_CONFIG as DENSE  # a tiny Qwen3 with an untied lm_head
from torch import Tensor

from quickdraft.config import ModelConfig, SpeculativeConfig, parse_speculative_config
from quickdraft.engine import Engine, ServedModel, stream
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.engine.spec_cycle import StepOutput
from quickdraft.kernels import kernels_available
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.llama import CausalLM
from quickdraft.models.families.qwen3_next import HybridLM
from quickdraft.models.heads.dflash import DFlashConfig, block_attention, default_target_layers
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.drafters.dflash import DFlashDrafter, dflash_drafter, load_dflash
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.sampling import TokenRng
from quickdraft.speculation.state import Speculation

MASK = 300  # the mask token id the drafters here use (inside the 320-token vocabulary)
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(",
    "the cat sat on the mat. the cat sat on the",
    '{"name": "x", "id": 1}, {"name": ',
    "abcabcabcabc",
]


# ---------------------------------------------------------------- checkpoints in the public layout


def dflash_config(num_target: int, taps: list[int], block: int = 4, **extra: Any) -> dict[str, Any]:
    """config.json as z-lab's DFlashDraftModel checkpoints lay it out (Qwen3 layer shapes)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 512,
        "vocab_size": 320,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block,
        "num_target_layers": num_target,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": taps},
        **extra,
    }


def public_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the public layout (written from it, not from our module)."""
    h, hd, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    taps = len(cfg["dflash_config"]["target_layer_ids"])
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, taps * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def random_tensors(cfg: dict[str, Any], seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in public_shapes(cfg).items():
        if "norm" in name:
            out[name] = torch.rand(shape, generator=gen) * 0.4 + 0.8
        else:
            out[name] = torch.randn(shape, generator=gen) * 0.15
    return out


def rigged_tensors(cfg: dict[str, Any], final_norm: Tensor) -> dict[str, Tensor]:
    """A drafter whose every block row outputs the direction of the block's first row (the last
    committed token's embedding): zero queries attend uniformly, the zero MASK embedding and
    the zero context (fc = 0) add nothing, v and o copy, the MLPs add nothing, and the final
    norm is the target's. Against the rigged target (`_rig_target`) every draft is the
    target's guess after the last token: d_1 is accepted often, and whole blocks in a run of a
    token that maps to itself."""
    t = {name: torch.zeros(shape) for name, shape in public_shapes(cfg).items()}
    hd = cfg["head_dim"]
    for name in t:
        if name.endswith(
            ("layernorm.weight", "q_norm.weight", "k_norm.weight", "hidden_norm.weight")
        ):
            t[name].fill_(1.0)
        elif name.endswith("v_proj.weight"):
            t[name].copy_(torch.eye(cfg["hidden_size"]))
        elif name.endswith("o_proj.weight"):  # q heads 0 and 2 read kv heads 0 and 1
            t[name][:hd, :hd] = torch.eye(hd)
            t[name][hd:, 2 * hd : 3 * hd] = torch.eye(hd)
    t["norm.weight"] = final_norm.clone()
    return t


def write_dflash(directory: Path, cfg: dict[str, Any], tensors: dict[str, Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def _rig_target(model: Any) -> None:
    """Layers that mostly nudge the residual stream, and an lm_head near the embedding: the
    target's next token is often a function of the current one, about a third of the tokens
    map to themselves (runs of a repeated token: whole blocks accepted), the rest elsewhere."""
    randomize(model, seed=1, out_scale=0.1, offset=isinstance(model, HybridLM))
    embed, head = (model.get_parameter(n) for n in ("model.embed_tokens.weight", "lm_head.weight"))
    with torch.no_grad():
        head.copy_(
            embed + 0.25 * torch.randn(embed.shape, generator=torch.Generator().manual_seed(9))
        )


def dense_target(directory: Path, rigged: bool = False) -> LoadedModel:
    model = CausalLM(ModelConfig.from_dict(DENSE), torch.float32)
    randomize(model, seed=1, offset=False)
    if rigged:
        _rig_target(model)
    with torch.no_grad():
        model.get_parameter("model.embed_tokens.weight")[MASK] = 0.0
    return load(str(save_hybrid_dir(model, "dense", directory, config=DENSE)), "fp32")


def hybrid_target(directory: Path, rigged: bool = False) -> LoadedModel:
    model = random_hybrid("qwen3_5", seed=1)
    if rigged:
        _rig_target(model)
    with torch.no_grad():
        model.get_parameter("model.embed_tokens.weight")[MASK] = 0.0
    return load(str(save_hybrid_dir(model, "qwen3_5", directory)), "fp32")


TARGETS = {"dense": (dense_target, 3, [0, 1]), "hybrid": (hybrid_target, 4, [0, 2])}


def target_and_drafter(
    kind: str, tmp: Path, rigged: bool = False, block: int = 4, sharpen: float = 1.0
) -> tuple[LoadedModel, Path]:
    """A target of `kind` and a DFlash checkpoint for it: random, or rigged to agree with a
    rigged target often (`rigged_tensors`), its logits `sharpen` times the target's guess."""
    make, layers, taps = TARGETS[kind]
    lm = make(tmp / "target", rigged)
    cfg = dflash_config(layers, taps, block)
    if rigged:
        norm = lm.model.get_parameter("model.norm.weight").detach()  # type: ignore[attr-defined]
        tensors = rigged_tensors(cfg, (norm + 1.0 if kind == "hybrid" else norm) * sharpen)
    else:
        tensors = random_tensors(cfg, seed=7)
    return lm, write_dflash(tmp / "dflash", cfg, tensors)


def generate(lm: LoadedModel, prompt: str, spec: Speculation | None, **params: Any) -> Request:
    params.setdefault("max_tokens", 40)
    req = lm.new_request(lm.tokenizer.encode(prompt), SamplingParams(ignore_eos=True, **params))
    for _ in stream(lm, req, spec):
        pass
    return req


def primed(lm: LoadedModel, drafter: DFlashDrafter, ids: list[int]) -> tuple[Any, list[int]]:
    """A drafter state after a prefill of `ids` (its tap rows committed), with the target's
    next token appended."""
    model = lm.model
    out = model(
        torch.tensor(ids), [model.new_cache(64)], [len(ids)], hidden_layers=drafter.hidden_layers
    )
    assert out.layers is not None
    tokens = [*ids, int(out.logits[-1].argmax())]
    state = drafter.new_state(ids)
    drafter.commit(state, tokens, out.layers.flatten(1))
    return state, tokens


# ---------------------------------------------------------------- the naive reference


def _rms(x: Tensor, w: Tensor, eps: float = 1e-6) -> Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:  # x [n, heads, d], HF rotate-half
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([pos[:, None].float() * inv] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * ang.cos() + rot * ang.sin()


def naive_logits(
    w: dict[str, Tensor],
    cfg: dict[str, Any],
    taps: Tensor,  # [C, T * H] target rows at positions ctx_pos
    ctx_pos: Tensor,
    block: Tensor,  # [B, H] embedded block at positions block_pos
    block_pos: Tensor,
    lm_head: Tensor,
) -> Tensor:
    """The public DFlash forward, written out plainly: logits of block rows 1 .. B-1."""
    nh, nkv, hd, theta = (
        cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta")
    )
    ctx = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = block
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        both = torch.cat([ctx, h])
        q = _rms(
            (h @ w[p + "self_attn.q_proj.weight"].T).view(-1, nh, hd),
            w[p + "self_attn.q_norm.weight"],
        )
        k = _rms(
            (both @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd),
            w[p + "self_attn.k_norm.weight"],
        )
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, k = _rope(q, block_pos, theta), _rope(k, torch.cat([ctx_pos, block_pos]), theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5  # no mask: every key, every row
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(len(block), -1)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x[1:], w["norm.weight"]) @ lm_head.T


# ---------------------------------------------------------------- layout and loading


def test_dflash_config_reads_the_public_layout() -> None:
    cfg = DFlashConfig.from_dict(dflash_config(36, [1, 9, 17, 25, 33], block=16))
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.block_size == 16
    assert cfg.mask_token_id == MASK and cfg.windows == (0, 0) and not cfg.causal
    assert cfg.layers.qk_norm and cfg.layers.hidden_size == 64
    # block size inside dflash_config, taps from num_target_layers (the public default rule)
    raw = dflash_config(36, [0])
    raw["dflash_config"] = {"mask_token_id": 5, "block_size": 8}
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.block_size == 8 and cfg.target_layer_ids == default_target_layers(36, 2) == (1, 33)
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)
    sliding = DFlashConfig.from_dict(
        dflash_config(
            36, [1], layer_types=["full_attention", "sliding_attention"], sliding_window=8
        )
    )
    assert sliding.windows == (0, 8)
    for bad, match in [
        (dict(architectures=["DFlash2DraftModel"]), "DFlash2"),
        (dict(dflash_config={"target_layer_ids": [1]}), "mask_token_id"),
        (dict(block_size=1), "block_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            DFlashConfig.from_dict({**dflash_config(36, [1]), **bad})


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_dflash_checkpoint_round_trip(kind: str, tmp_path: Path) -> None:
    """Every tensor of the public layout lands in the parameter of that name; a `model.`
    prefix and a copy of the target's embedding are accepted."""
    lm, directory = target_and_drafter(kind, tmp_path)
    written = random_tensors(json.loads((directory / "config.json").read_text()), seed=7)
    for variant in ("plain", "prefixed"):
        if variant == "prefixed":
            tensors = {"model." + k: v for k, v in written.items()}
            tensors["model.embed_tokens.weight"] = torch.zeros(320, 64)
            save_file(tensors, str(directory / "model.safetensors"))
        params = dict(load_dflash(lm.model, directory).named_parameters())
        assert params.keys() == written.keys()
        for name, tensor in written.items():
            assert torch.equal(params[name], tensor), name


def test_dflash_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    lm, directory = target_and_drafter("dense", tmp_path)
    good = json.loads((directory / "config.json").read_text())
    cases = [
        (dict(num_target_layers=28), "28-layer target"),
        (dict(dflash_config={"mask_token_id": MASK, "target_layer_ids": [0, 3]}), "outside"),
        (dict(dflash_config={"mask_token_id": 320, "target_layer_ids": [0, 1]}), "vocabulary"),
        (dict(hidden_size=32), "hidden size"),
        (dict(architectures=["DFlash2DraftModel"]), "DFlash2"),
    ]
    for change, match in cases:
        (directory / "config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ValueError, match=match):
            load_dflash(lm.model, directory)
    (directory / "config.json").write_text(json.dumps(good))
    tensors = random_tensors(good, seed=7)
    tensors["layers.0.attention_conv.base_kernel"] = torch.zeros(2, 2, 64)  # DFlash2's
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_dflash(lm.model, directory)
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeConfig(method="dflash")


# ---------------------------------------------------------------- the forward and its masks


@pytest.mark.parametrize("window", [0, 5])
def test_dflash_forward_matches_naive_reference(window: int, tmp_path: Path) -> None:
    """Context rows committed in two batches, then a block of 4: the drafts' logits equal the
    plain re-implementation of the public forward over the last `window` context rows."""
    lm, directory = target_and_drafter("dense", tmp_path)
    cfg = json.loads((directory / "config.json").read_text())
    drafter = dflash_drafter(lm.model, directory, window=window)
    gen = torch.Generator().manual_seed(0)
    taps = torch.randn(11, 2 * 64, generator=gen)
    tokens = list(range(40, 52))  # 12 committed tokens: rows for positions 0..10
    state = drafter.new_state(tokens[:7])
    drafter.commit(state, tokens[:7], taps[:6])
    drafter.propose([DraftJob(state, tokens[:7], 3, SamplingParams(), gen)])  # writes a block
    drafter.commit(state, tokens, taps[6:])
    model = drafter.model
    ids = torch.tensor([tokens[-1], MASK, MASK, MASK])
    embed = lm.model.get_parameter("model.embed_tokens.weight")  # type: ignore[attr-defined]
    drafter.sync_context([state])  # what propose does first: the queued rows become context
    logits = model(F.embedding(ids, embed), [state.cache], [4], torch.arange(1, 4), window)
    lo = 11 - window if window else 0
    want = naive_logits(
        random_tensors(cfg, seed=7),
        cfg,
        taps[lo:],
        torch.arange(lo, 11),
        F.embedding(ids, embed),
        torch.arange(11, 15),
        lm.model.get_parameter("lm_head.weight"),  # type: ignore[attr-defined]
    )
    assert logits.shape == (3, 320)
    assert (logits - want).abs().max().item() < 1e-4
    assert state.cache.end == 11  # one entry per committed token, none for the block's rows
    assert state.cache.start == (1 if window else 0)  # a window seeds from the prompt's tail


def test_dflash_block_attention_pattern() -> None:
    """Non-causal inside the block, every context key visible; `causal` / `window` mask by
    position exactly as an explicit loop over (query, key) pairs does."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen) for s in [(4, 4, 8), (2, 10, 8), (2, 10, 8)])

    def explicit(visible: Any) -> Tensor:
        out = torch.empty(4, 4, 8)
        for i in range(4):
            for h in range(4):
                keys = [j for j in range(10) if visible(20 + i, 14 + j)]  # positions
                s = (k[h // 2, keys] @ q[i, h]) * 8**-0.5
                out[i, h] = s.softmax(0) @ v[h // 2, keys]
        return out.reshape(4, 32)

    full = block_attention(q, k, v, first=20, key_start=14, scale=8**-0.5)
    assert torch.allclose(full, explicit(lambda qp, kp: True), atol=1e-5)
    causal = block_attention(q, k, v, 20, 14, 8**-0.5, causal=True)
    assert torch.allclose(causal, explicit(lambda qp, kp: kp <= qp), atol=1e-5)
    window = block_attention(q, k, v, 20, 14, 8**-0.5, window=4)
    assert torch.allclose(window, explicit(lambda qp, kp: abs(qp - kp) < 4), atol=1e-5)
    # the first block row sees the last one (non-causal), and the oldest context entry
    for j in (9, 0):
        k2 = k.clone()
        k2[:, j] += 1.0
        assert not torch.allclose(block_attention(q, k2, v, 20, 14, 8**-0.5)[0], full[0])


# ---------------------------------------------------------------- the tapped layers


def test_dflash_taps_are_hf_hidden_states(tmp_path: Path) -> None:
    """Dense: `hidden_layers` returns transformers' output_hidden_states[i + 1] (the last
    layer's after the final norm); the logits do not change. Hybrid: each listed layer's output
    (a hook on the layer), the last one's post-norm hidden."""
    ref = make_tiny_hf_model("qwen3", tmp_path)
    write_tiny_tokenizer(tmp_path)
    model = load(str(tmp_path), "fp32", progress=False).model
    ids = torch.tensor([5, 9, 77, 3, 18, 250, 7])
    out = model(ids, [model.new_cache(8)], [7], hidden_layers=(2, 0))  # 2: the last layer
    plain = model(ids, [model.new_cache(8)], [7])
    with torch.no_grad():
        hf = ref(ids[None], output_hidden_states=True).hidden_states
    assert out.layers is not None and out.layers.shape == (7, 2, 64)
    assert (out.layers[:, 0] - hf[3][0]).abs().max().item() < 1e-4
    assert (out.layers[:, 1] - hf[1][0]).abs().max().item() < 1e-4
    assert torch.equal(out.logits, plain.logits) and plain.layers is None
    hybrid = random_hybrid("qwen3_5_moe", seed=2)
    n = len(HYBRID_CONFIGS["qwen3_5_moe"]["text_config"]["layer_types"])
    seen: dict[int, Tensor] = {}
    for i in (1, 2):
        hybrid.get_submodule(f"model.layers.{i}").register_forward_hook(
            lambda mod, args, output, i=i: seen.__setitem__(i, output)
        )
    out = hybrid(ids, [hybrid.new_cache(8)], [7], return_hidden=True, hidden_layers=(2, 1, n - 1))
    assert out.layers is not None and out.hidden is not None
    assert torch.equal(out.layers[:, 0], seen[2]) and torch.equal(out.layers[:, 1], seen[1])
    assert torch.equal(out.layers[:, 2], out.hidden)  # the last layer's: after the final norm
    with pytest.raises(AssertionError, match="past the model's layers"):
        hybrid(ids, [hybrid.new_cache(8)], [7], hidden_layers=(n,))


@pytest.mark.skipif(not kernels_available(), reason="needs the C++ kernels (fused dense layers)")
def test_dflash_taps_on_the_fused_dense_path(tmp_path: Path) -> None:
    """bf16 packed: one sequence runs the fused C++ layers, two sequences the Python layers;
    the taps (and logits) of a sequence are the same bits either way."""
    make_tiny_hf_model("qwen3", tmp_path)
    write_tiny_tokenizer(tmp_path)
    model: Any = load(str(tmp_path), "bf16", progress=False).model
    assert model._fused_layers() is not None, "the fused path must run here"
    a, b = torch.tensor([5, 9, 77, 3, 18]), torch.tensor([250, 7, 1])
    alone = model(a, [model.new_cache(8)], [5], torch.arange(5), hidden_layers=(0, 2))
    both = model(
        torch.cat([a, b]),
        [model.new_cache(8), model.new_cache(8)],
        [5, 3],
        torch.arange(5),
        hidden_layers=(0, 2),
    )
    assert torch.equal(alone.layers, both.layers[:5]) and torch.equal(alone.logits, both.logits)
    unpacked: Any = load(str(tmp_path), "fp32", progress=False).model
    ref = unpacked(a, [unpacked.new_cache(8)], [5], hidden_layers=(0, 2)).layers
    assert ((alone.layers.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_step_output_gives_each_drafter_its_layers() -> None:
    """A step taps the union of its drafters' layers; each drafter gets its own, in its order."""

    class Reader:
        needs_hidden = True

        def __init__(self, layers: tuple[int, ...]) -> None:
            self.hidden_layers = layers

    layers = torch.arange(5 * 3 * 2).float().view(5, 3, 2)  # rows x (layers 0, 2, 5) x hidden
    hidden = torch.randn(5, 2)
    out = StepOutput(torch.empty(0), hidden, [0], [0], layers, (0, 2, 5))
    rows = out.hidden_rows(Reader((5, 0)), 1, 3)  # type: ignore[arg-type]
    assert torch.equal(rows, torch.cat([layers[1:4, 2], layers[1:4, 0]], -1))
    assert torch.equal(out.hidden_rows(Reader(()), 1, 3), hidden[1:4])  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_dflash_reads_exactly_the_tapped_layers(kind: str, tmp_path: Path) -> None:
    """Perturbing the last target layer (not tapped) leaves the drafts and the context K/V
    unchanged; perturbing a tapped layer changes them."""
    lm, directory = target_and_drafter(kind, tmp_path)
    drafter = dflash_drafter(lm.model, directory)
    ids = [5, 9, 77, 3, 18, 250, 7, 44]
    last, tapped = TARGETS[kind][1] - 1, drafter.hidden_layers[-1]

    def run() -> tuple[list[int], Tensor]:
        state, tokens = primed(lm, drafter, ids)
        tokens[-1] = 11  # fixed: the target's own next token moves with its weights
        job = DraftJob(state, tokens, 3, SamplingParams(), torch.Generator())
        draft = drafter.propose([job])[0]
        return draft.tokens, state.cache.k[:, :, : state.cache.length].clone()

    base_tokens, base_kv = run()
    for layer, same in [(last, True), (tapped, False)]:
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        weight = lm.model.get_parameter(name)  # type: ignore[attr-defined]
        saved = weight.detach().clone()
        with torch.no_grad():
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)))
        tokens, kv = run()
        with torch.no_grad():
            weight.copy_(saved)
        assert torch.equal(kv, base_kv) == same, layer
        if same:
            assert tokens == base_tokens
    assert run()[0] == base_tokens


def test_dflash_rollback_equals_recompute(tmp_path: Path) -> None:
    """Cycles of propose (its block K/V written past the context, never committed) and commits
    of 1-3 rows leave the state a fresh state fed every row at once has: same context K/V,
    same drafts."""
    lm, directory = target_and_drafter("hybrid", tmp_path)
    drafter = dflash_drafter(lm.model, directory)
    gen = torch.Generator().manual_seed(1)
    taps = torch.randn(20, 2 * 64, generator=gen)
    tokens = list(range(60, 81))
    state = drafter.new_state(tokens[:8])
    drafter.commit(state, tokens[:8], taps[:7])
    pos = 7
    for step in (3, 1, 2, 3, 1, 3):  # accepted + 1 rows per verify
        job = DraftJob(state, tokens[: pos + 1], 3, SamplingParams(), gen)
        assert len(drafter.propose([job])[0].tokens) == 3
        assert state.cache.length == pos  # the block's rows were not kept
        drafter.commit(state, tokens[: pos + step + 1], taps[pos : pos + step])
        pos += step
    fresh = drafter.new_state(tokens[: pos + 1])
    drafter.commit(fresh, tokens[: pos + 1], taps[:pos])
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=4)
    drafts = [
        drafter.propose(
            [DraftJob(s, tokens[: pos + 1], 3, params, torch.Generator().manual_seed(2))]
        )[0]
        for s in (state, fresh)
    ]
    n = state.cache.length
    assert n == fresh.cache.length == pos
    assert torch.allclose(state.cache.k[:, :, :n], fresh.cache.k[:, :, :n], atol=1e-6)
    assert torch.allclose(state.cache.v[:, :, :n], fresh.cache.v[:, :, :n], atol=1e-6)
    assert drafts[0].tokens == drafts[1].tokens
    assert drafts[0].p_draft is not None and drafts[1].p_draft is not None
    assert (drafts[0].p_draft - drafts[1].p_draft).abs().max().item() < 1e-5


# ---------------------------------------------------------------- end to end


def accept_counts(reqs: list[Request], k: int) -> list[int]:
    """Cycles per number of accepted drafts 0..k."""
    hist = [0] * (k + 1)
    for req in reqs:
        at_least = [*req.spec.accepted_per_position, 0]  # [i]: cycles accepting > i drafts
        hist[0] += req.spec.cycles - at_least[0]
        for a in range(1, k + 1):
            hist[a] += at_least[a - 1] - (at_least[a] if a < len(at_least) else 0)
    return hist


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("rigged", [False, True], ids=["random", "rigged"])
def test_dflash_greedy_equals_plain(kind: str, rigged: bool, tmp_path: Path) -> None:
    """Speculation with DFlash (k = 3, block 4) emits exactly what speculation off emits. The
    random drafter is rejected ~always (the rollback of whole blocks); with the rigged pair
    every accept count 0..3 occurs (every rollback length, and whole blocks with the bonus)."""
    lm, directory = target_and_drafter(kind, tmp_path, rigged)
    cfg = SpeculativeConfig(
        method="dflash", draft_model=str(directory), num_draft_tokens=3, adaptive=False
    )
    spec = make_speculation(lm, cfg)
    assert spec is not None and isinstance(spec.drafter, DFlashDrafter)
    reqs = []
    for prompt in PROMPTS:
        plain = generate(lm, prompt, None)
        fast = generate(lm, prompt, spec)
        assert fast.output_ids == plain.output_ids, prompt
        reqs.append(fast)
    if rigged:
        hist = accept_counts(reqs, 3)
        assert all(n > 0 for n in hist), hist
    else:
        assert sum(r.spec.drafted for r in reqs) >= 4 * 3 * 30


def test_dflash_draft_vocab_cuts_a_whole_vocabulary_checkpoint(tmp_path: Path) -> None:
    """`--draft-vocab 160` on a checkpoint without a draft vocabulary: the drafter scores ids
    0..159 and the end-of-generation ids only; speculation still equals plain decoding, with
    drafts accepted."""
    lm, directory = target_and_drafter("dense", tmp_path, True)
    cfg = SpeculativeConfig(
        method="dflash",
        draft_model=str(directory),
        num_draft_tokens=3,
        adaptive=False,
        draft_vocab=160,
    )
    spec = make_speculation(lm, cfg)
    assert spec is not None and isinstance(spec.drafter, DFlashDrafter)
    vocab = spec.drafter.model.vocab
    assert vocab is not None and vocab.ids.tolist() == sorted({*range(160), *lm.eos_ids})
    accepted = 0
    for prompt in PROMPTS[:3]:
        plain, fast = generate(lm, prompt, None), generate(lm, prompt, spec)
        assert fast.output_ids == plain.output_ids, prompt
        accepted += fast.spec.accepted
    assert accepted > 0


def test_dflash_engine_batch_equals_alone(tmp_path: Path) -> None:
    """4 requests through the engine at once, their prompts in chunks of at most 16 rows
    beside other requests' verify rows (tap rows gathered chunk by chunk): each gets the
    tokens it gets alone with speculation off."""
    lm, directory = target_and_drafter("hybrid", tmp_path, rigged=True)
    cfg = SpeculativeConfig(
        method="dflash", draft_model=str(directory), num_draft_tokens=3, adaptive=False
    )
    alone = [generate(lm, p, None, max_tokens=24).output_ids for p in PROMPTS]
    scheduler = SchedulerConfig(max_running=4, max_step_tokens=16, max_prefill_with_decodes=8)
    engine = Engine({"m": ServedModel(lm, cfg)}, scheduler=scheduler)
    engine.start()
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        handles = [engine.submit("m", lm.tokenizer.encode(p), params) for p in PROMPTS]
        outs = [list(h) for h in handles]
    finally:
        engine.stop()
    assert [[t for o in out for t in o.token_ids] for out in outs] == alone
    assert engine.step_stats["m"].max_batch >= 3  # they ran together (a short one ends first)
    assert sum(out[-1].spec.accepted for out in outs) > 0


def test_dflash_batched_propose_equals_alone(tmp_path: Path) -> None:
    lm, directory = target_and_drafter("dense", tmp_path)
    drafter = dflash_drafter(lm.model, directory)
    prompts = [[5, 9, 77, 3], list(range(40, 61)), [200, 100]]
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams()]
    ks = [3, 2, 1]

    def jobs() -> list[DraftJob]:
        out = []
        for ids, p, k in zip(prompts, params, ks, strict=True):
            state, tokens = primed(lm, drafter, ids)
            out.append(DraftJob(state, tokens, k, p, TokenRng.for_params(p).generator))
        return out

    alone = [drafter.propose([job])[0] for job in jobs()]
    packed = drafter.propose(jobs())
    assert [f.rows for f in drafter.forwards] == [4 + 21 + 2, 4 + 3 + 2]  # context, blocks
    for a, b, k in zip(alone, packed, ks, strict=True):
        assert a.tokens == b.tokens and len(a.tokens) == k
        if a.p_draft is not None and b.p_draft is not None:
            assert (a.p_draft - b.p_draft).abs().max().item() < 1e-5


def test_dflash_block_size_caps_drafts(tmp_path: Path) -> None:
    """Drafts per cycle: min(k, block - 1), the block from the checkpoint or the setting."""
    lm, directory = target_and_drafter("dense", tmp_path, block=4)
    for k, block, want in [(5, 0, 3), (2, 0, 2), (5, 3, 2), (8, 8, 7)]:
        drafter = dflash_drafter(lm.model, directory, block_size=block)
        state, tokens = primed(lm, drafter, [5, 9, 77])
        draft = drafter.propose([DraftJob(state, tokens, k, SamplingParams(), torch.Generator())])[
            0
        ]
        assert len(draft.tokens) == want, (k, block)
    with pytest.raises(ValueError, match="block size"):
        dflash_drafter(lm.model, directory, block_size=1)


def test_dflash_sampled_matches_target_distribution(tmp_path: Path) -> None:
    """Second emitted token under DFlash speculation (k = 2, sampled drafts from the rigged
    drafter: accepted and rejected) against its exact marginal, by chi-square. The drafter's
    distribution is sharper than the target's, so a p_draft that is not the one the drafts
    were sampled from biases the output (a flattened one gave chi2 146 on 30 dof)."""
    lm, directory = target_and_drafter("dense", tmp_path, rigged=True, sharpen=3.0)
    cfg = SpeculativeConfig(
        method="dflash", draft_model=str(directory), num_draft_tokens=2, adaptive=False
    )
    spec = make_speculation(lm, cfg)
    prompt = lm.tokenizer.encode("ab")
    # 4 tokens: with 2 the last cycle has no room to draft; token 2 is what is tested
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=6, ignore_eos=True)
    marginal = second_token_marginal(plain_distribution(lm, params), prompt)
    reqs = assert_second_token_follows(
        lm, spec, prompt, lambda seed: replace(params, seed=seed), marginal, 3000
    )
    drafted, accepted = sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)
    assert 0 < accepted < drafted  # both branches of the rejection sampler ran


def test_dflash_cli_and_vllm_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # imported here: the CLI brings the server (fastapi), which the GPU image lacks, and
    # tests/test_graphs.py imports this module's helpers on the GPU (bench/gpu_session.sh)
    from quickdraft.cli import main as cli_main

    lm, directory = target_and_drafter("dense", tmp_path)
    assert parse_speculative_config(
        json.dumps({"method": "dflash", "model": str(directory), "num_speculative_tokens": 3})
    ) == {"method": "dflash", "draft_model": str(directory), "num_draft_tokens": 3}
    argv = ["generate", "--model", str(lm.path), "--dtype", "fp32", "--max-tokens", "6"]
    flags = ["--speculative-method", "dflash", "--draft-model", str(directory)]
    assert cli_main([*argv, *flags, "--dflash-block-size", "3", "--dflash-window", "8", "hi"]) == 0
    assert cli_main([*argv, "--speculative-method", "dflash", "hi"]) == 2
    assert "needs a draft model" in capsys.readouterr().err
