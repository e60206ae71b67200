"""Tiny random-weight hybrid models (Qwen3-Next family) for the hybrid tests, built with our own
classes and saved as Hugging Face checkpoints (config.json + safetensors with HF tensor names,
optionally an `mtp.*` head and the conftest byte-level tokenizer). No transformers needed; the
parity tests against transformers live in test_qwen3_next.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from quickdraft.models.families.hybrid_config import HybridConfig
from quickdraft.models.families.qwen3_next import HybridLM
from quickdraft.models.heads.mtp import MTPHead, hybrid_mtp_parts, llama_mtp_parts


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models are thousands of microsecond ops: a second intra-op thread only adds
    fork/join cost (and stalls badly when the machine is busy). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
    eos_token_id=2,
    mtp_num_hidden_layers=1,
)
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)

# config.json of each family, as the real checkpoints lay it out
HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(model_type="qwen3_next", intermediate_size=96, **_TEXT, **_MOE),
    # composite vision-language config: the language model in text_config
    "qwen3_5": dict(
        model_type="qwen3_5",
        tie_word_embeddings=False,
        text_config=dict(model_type="qwen3_5_text", intermediate_size=96, **_TEXT),
        vision_config=dict(depth=1),
    ),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe",
        tie_word_embeddings=False,
        text_config=dict(model_type="qwen3_5_moe_text", **_TEXT, **_MOE),
        vision_config=dict(depth=1),
    ),
}


def randomize(module: nn.Module, seed: int, out_scale: float = 1.0, offset: bool = True) -> None:
    """Weights wide enough that logits are not near-ties; stable decays. `out_scale` scales the
    projections that write into the residual stream (o_proj, out_proj, down projections);
    `offset`: RMSNorm weights are zero-centred (the hybrid family's (1 + w)) or around 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("A_log"):
                v = torch.rand(p.shape, generator=gen) * 2 - 1
            elif name.endswith("dt_bias"):
                v = torch.rand(p.shape, generator=gen)
            elif "norm" in name and "linear_attn.norm" not in name and offset:
                v = torch.rand(p.shape, generator=gen) * 0.4 - 0.2  # (1 + w) around 1
            elif "norm" in name:  # plain RMSNorm weights, and the GDN gated norm's
                v = torch.rand(p.shape, generator=gen) * 0.4 + 0.8
            else:
                v = torch.randn(p.shape, generator=gen) * 0.08
                if re.search(r"(o_proj|out_proj|down_proj)", name):
                    v = v * out_scale
            p.copy_(v.to(p.dtype))


def random_hybrid(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> HybridLM:
    model = HybridLM(HybridConfig.from_dict(HYBRID_CONFIGS[family]), dtype)
    randomize(model, seed)
    return model


def hf_names(state: dict[str, torch.Tensor], family: str, inter: int) -> dict[str, torch.Tensor]:
    """Our parameter names -> the checkpoint's: Qwen3-Next stores one tensor per expert,
    composite Qwen3.5 configs prefix the language model with `model.language_model.`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach().clone().contiguous()
        if family == "qwen3_next" and name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
            continue
        if family == "qwen3_next" and name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
            continue
        if family in ("qwen3_5", "qwen3_5_moe") and name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        out[name] = t
    return out


def mtp_head_for(model: nn.Module, seed: int, out_scale: float = 1.0) -> MTPHead:
    """A random MTP head of the target's family, sharing its embedding and lm_head."""
    cfg: Any = model.config
    dtype, device = model.get_parameter("lm_head.weight").dtype, torch.device("cpu")
    parts = (
        hybrid_mtp_parts(cfg, dtype, device)
        if isinstance(model, HybridLM)
        else llama_mtp_parts(cfg, dtype, device)
    )
    head = MTPHead(
        parts,
        cfg.hidden_size,
        model.get_submodule("model.embed_tokens"),
        model.get_parameter("lm_head.weight"),
        dtype,
        device,
    )
    randomize(head, seed, out_scale, offset=isinstance(model, HybridLM))
    return head


def save_hybrid_dir(
    model: nn.Module,
    family: str,
    directory: Path,
    head: MTPHead | None = None,
    tokenizer: bool = True,
    config: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (and `head` as `mtp.*`) as a Hugging Face checkpoint directory; `family`
    names a HYBRID_CONFIGS entry, or is "dense" with the config.json dict in `config`."""
    directory.mkdir(parents=True, exist_ok=True)
    inter = getattr(model.config, "moe_intermediate_size", 0)
    tensors = hf_names(dict(model.state_dict()), family, inter)
    if head is not None:
        for name, t in hf_names(dict(head.state_dict()), family, inter).items():
            tensors["mtp." + name] = t
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config or HYBRID_CONFIGS[family]))
    if tokenizer:
        from conftest import write_tiny_tokenizer

        write_tiny_tokenizer(directory)
    return directory


def copying_head(model: nn.Module) -> MTPHead:
    """An MTP head that predicts what the target would predict from the token embedding alone:
    fc passes norm_e(embed(t_{i+1})) through, its layer adds nothing, and its final norm is the
    target's. For a target whose layers only nudge the residual stream (`randomize` with a small
    `out_scale`), the target's next token is mostly that bigram guess, so drafts are accepted
    often but not always: every rollback count occurs."""
    head = mtp_head_for(model, seed=0, out_scale=0.0)
    size = head.fc.weight.shape[0]
    offset = isinstance(model, HybridLM)  # (1 + w) norms: identity scale at w = 0
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :size] = torch.eye(size)
        head.get_parameter("pre_fc_norm_embedding.weight").fill_(0.0 if offset else 1.0)
        head.get_parameter("norm.weight").copy_(model.get_parameter("model.norm.weight"))
    return head
