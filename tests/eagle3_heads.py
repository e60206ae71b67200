"""Tiny EAGLE-3 heads saved in the layouts users bring (tests/test_eagle3.py, the prefix-cache
parity tests): random heads, and a "copying" head built to agree with a target whose layers only
nudge the residual stream. Plus the reference forward, written from the formulas (no cache, the
whole sequence recomputed for every draft)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor


@dataclass
class HeadSpec:
    target_hidden: int = 64
    vocab: int = 320
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    inter: int = 96
    layers: int = 1
    taps: list[int] | None = None  # explicit eagle_aux_hidden_state_layer_ids (None: default)
    num_taps: int = 3
    draft_ids: list[int] | None = None  # the draft vocabulary (None: the whole, no d2t)
    own_lm_head: bool = True
    own_embed: bool = False
    rope_theta: float = 10000.0
    flags: dict[str, Any] = field(default_factory=dict)  # norm_before_residual etc.


def random_head(spec: HeadSpec, seed: int) -> dict[str, Tensor]:
    """Tensors named as the `speculators` layout names them (`layers.0.*`)."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim

    def mat(n: int, k: int) -> Tensor:
        return torch.randn(n, k, generator=gen) * 0.08

    def norm(n: int) -> Tensor:
        return torch.rand(n, generator=gen) * 0.4 + 0.8

    width = (len(spec.taps) if spec.taps else spec.num_taps) * spec.target_hidden
    t: dict[str, Tensor] = {"fc.weight": mat(h, width), "norm.weight": norm(h)}
    if spec.flags.get("norm_before_fc"):
        t["input_norm.weight"] = norm(width)
    for i in range(spec.layers):
        p = f"layers.{i}."
        qkv_in = 2 * h if i == 0 else h
        t[p + "input_layernorm.weight"] = norm(h)
        if i == 0:
            t[p + "hidden_norm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = mat(q, qkv_in)
        t[p + "self_attn.k_proj.weight"] = mat(kv, qkv_in)
        t[p + "self_attn.v_proj.weight"] = mat(kv, qkv_in)
        t[p + "self_attn.o_proj.weight"] = mat(h, q)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "mlp.gate_proj.weight"] = mat(spec.inter, h)
        t[p + "mlp.up_proj.weight"] = mat(spec.inter, h)
        t[p + "mlp.down_proj.weight"] = mat(h, spec.inter)
    rows = spec.vocab if spec.draft_ids is None else len(spec.draft_ids)
    if spec.own_lm_head:
        t["lm_head.weight"] = mat(rows, h) * 4
    if spec.own_embed:
        t["embed_tokens.weight"] = mat(spec.vocab, h) * 4
    if spec.draft_ids is not None:
        ids = torch.tensor(spec.draft_ids)
        t["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(spec.vocab, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
    return t


def copying_head(spec: HeadSpec, final_norm: Tensor) -> dict[str, Tensor]:
    """A one-head layer whose output is its token's normalised embedding: fc and the fed-back
    state are silenced (fc = 0, hidden_norm = 0 with norm_before_residual), attention peaks on
    the row itself (q = 4 k = 4 x the normalised embedding, v = it, o = I) and the MLP adds
    nothing; `final_norm` is the target's (in the Llama convention), the head the target's
    (no lm_head tensor). So it drafts what the target guesses from the token alone."""
    assert spec.heads == spec.kv_heads == 1 and spec.head_dim == spec.hidden
    assert spec.flags.get("norm_before_residual") and not spec.own_lm_head
    t = random_head(spec, seed=0)
    h = spec.hidden
    eye = torch.eye(h)
    zero = torch.zeros(h, h)
    t["fc.weight"].zero_()
    t["layers.0.hidden_norm.weight"].zero_()
    t["layers.0.input_layernorm.weight"].fill_(1.0)
    t["layers.0.self_attn.q_proj.weight"] = torch.cat([4 * eye, zero], 1)
    t["layers.0.self_attn.k_proj.weight"] = torch.cat([eye, zero], 1)
    t["layers.0.self_attn.v_proj.weight"] = torch.cat([eye, zero], 1)
    t["layers.0.self_attn.o_proj.weight"] = eye.clone()
    t["layers.0.mlp.down_proj.weight"].zero_()
    t["norm.weight"] = final_norm.detach().clone().float()
    return t


def save_head(directory: Path, spec: HeadSpec, tensors: dict[str, Tensor], layout: str) -> Path:
    """`layout`: "eagle" (flat Llama config, `midlayer.*`, safetensors), "speculators" (nested
    config, `layers.0.*`), "bin" (the flat layout as a weights-only pytorch_model.bin)."""
    directory.mkdir(parents=True, exist_ok=True)
    layer = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.inter,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    extra: dict[str, Any] = dict(spec.flags)
    if spec.draft_ids is not None:
        extra["draft_vocab_size"] = len(spec.draft_ids)
    if spec.target_hidden != spec.hidden:
        extra["target_hidden_size"] = spec.target_hidden
    if spec.taps is not None:
        extra["eagle_aux_hidden_state_layer_ids"] = spec.taps
    if layout == "speculators":
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {"model_type": "llama", **layer},
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": None}},
            **extra,
        }
        named = tensors
    else:
        config = {"architectures": ["LlamaForCausalLMEagle3"], **layer, **extra}
        if "draft_vocab_size" not in config:
            config["draft_vocab_size"] = None  # a null draft vocabulary: the target's
        named = {
            ("midlayer." + n.removeprefix("layers.0.") if n.startswith("layers.0.") else n): v
            for n, v in tensors.items()
        }
    (directory / "config.json").write_text(json.dumps(config))
    named = {n: v.contiguous() for n, v in named.items()}
    if layout == "bin":
        torch.save(named, directory / "pytorch_model.bin")
    else:
        save_file(named, str(directory / "model.safetensors"))
    return directory


COPYING = HeadSpec(
    heads=1, kv_heads=1, head_dim=64, own_lm_head=False, flags=dict(norm_before_residual=True)
)


def agreeing_head(directory: Path, final_norm: Tensor, taps: list[int] | None = None) -> Path:
    """The copying head for a 64-wide, 320-token target with final norm `final_norm`, saved
    in the speculators layout (explicit `taps` for a target too shallow for the default)."""
    spec = replace(COPYING, taps=taps)
    return save_head(directory, spec, copying_head(spec, final_norm), "speculators")


# ------------------------------------------------------------------ the reference forward


def _rms(x: Tensor, w: Tensor, eps: float = 1e-6) -> Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: Tensor, theta: float) -> Tensor:
    """x [T, heads, d] at positions 0 .. T-1 (rotate-half, as Llama)."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
    ang = torch.outer(torch.arange(t).double(), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(x: Tensor, w: dict[str, Tensor], p: str, spec: HeadSpec) -> Tensor:
    t, d = x.shape[0], spec.head_dim
    q = (x @ w[p + "q_proj.weight"].double().T).view(t, spec.heads, d)
    k = (x @ w[p + "k_proj.weight"].double().T).view(t, spec.kv_heads, d)
    v = (x @ w[p + "v_proj.weight"].double().T).view(t, spec.kv_heads, d)
    q, k = _rope(q, spec.rope_theta), _rope(k, spec.rope_theta)
    rep = spec.heads // spec.kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    return out @ w[p + "o_proj.weight"].double().T


def _mlp(x: Tensor, w: dict[str, Tensor], p: str) -> Tensor:
    gate, up = x @ w[p + "gate_proj.weight"].double().T, x @ w[p + "up_proj.weight"].double().T
    return (torch.nn.functional.silu(gate) * up) @ w[p + "down_proj.weight"].double().T


def reference_outputs(
    w: dict[str, Tensor], spec: HeadSpec, emb: Tensor, g: Tensor
) -> tuple[Tensor, Tensor]:
    """All rows at once (causal, positions 0 .. T-1): emb, g [T, H] -> (pre-norm, post-norm)."""
    w = {n: v.double() for n, v in w.items()}
    nbr = bool(spec.flags.get("norm_before_residual"))
    gn = _rms(g, w["layers.0.hidden_norm.weight"])
    x = torch.cat([_rms(emb, w["layers.0.input_layernorm.weight"]), gn], -1)
    h = (gn if nbr else g) + _attention(x, w, "layers.0.self_attn.", spec)
    h = h + _mlp(_rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.mlp.")
    for i in range(1, spec.layers):
        p = f"layers.{i}."
        h = h + _attention(_rms(h, w[p + "input_layernorm.weight"]), w, p + "self_attn.", spec)
        h = h + _mlp(_rms(h, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
    return h, _rms(h, w["norm.weight"])


def reference_drafts(
    w: dict[str, Tensor],
    spec: HeadSpec,
    taps: Tensor,  # [T, num_taps * H_t] the target's tapped rows of positions 0 .. T-1
    next_ids: Tensor,  # [T] t_{i+1} of each row
    embed: Tensor,  # [vocab, H] the table the head reads
    lm_head: Tensor,  # [V_d, H] (the target's rows where the head has none)
    k: int,
) -> tuple[list[int], Tensor]:
    """k greedy drafts (target ids), each from a full recompute over every row so far, and
    the first draft's logits over the draft vocabulary [V_d]."""
    x = taps.double()
    if spec.flags.get("norm_before_fc"):
        x = _rms(x, w["input_norm.weight"].double())
    gs = list(x @ w["fc.weight"].double().T)
    ids = next_ids.tolist()
    drafts: list[int] = []
    first = torch.empty(0)
    for _ in range(k):
        pre, post = reference_outputs(w, spec, embed[ids].double(), torch.stack(gs))
        logits = post[-1] @ lm_head.double().T
        if not drafts:
            first = logits
        col = int(logits.argmax())
        token = col if spec.draft_ids is None else spec.draft_ids[col]
        drafts.append(token)
        ids.append(token)
        gs.append(post[-1] if spec.flags.get("norm_output") else pre[-1])
    return drafts, first


def save_gguf_head(file: Path, spec: HeadSpec, tensors: dict[str, Tensor], taps: list[int]) -> Path:
    """The head as llama.cpp's converter writes an `eagle3` GGUF: its metadata keys, blk.0.*
    names, q/k rows permuted for its NORM RoPE, d2t as int64, the weights in F32 (F16 for
    the MLP: a second block format)."""
    import gguf
    import numpy as np

    def permute(w: Tensor, heads: int) -> Tensor:
        return (
            w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .transpose(1, 2)
            .reshape(w.shape)
        )

    w = gguf.GGUFWriter(str(file), "eagle3")
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.inter)
    w.add_block_count(spec.layers)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_context_length(2048)
    w.add_array("eagle3.target_layers", taps)
    w.add_uint32("eagle3.target_hidden_size", spec.target_hidden)
    w.add_bool("eagle3.norm_before_residual", bool(spec.flags.get("norm_before_residual")))
    w.add_bool("eagle3.norm_before_fc", bool(spec.flags.get("norm_before_fc")))
    names = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        "input_norm.weight": "enc.output_norm.weight",
        "fc.weight": "fc.weight",
    }
    layer = {
        "input_layernorm": "attn_norm",
        "hidden_norm": "attn_norm_2",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, t in tensors.items():
        if name == "t2d":
            continue
        if name == "d2t":
            w.add_tensor("d2t", t.numpy().astype(np.int64))
            continue
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            module = rest.removesuffix(".weight")
            if module == "self_attn.q_proj":
                t = permute(t, spec.heads)
            elif module == "self_attn.k_proj":
                t = permute(t, spec.kv_heads)
            gguf_name = f"blk.{i}.{layer[module]}.weight"
        else:
            gguf_name = names[name]
        values = t.float().numpy()
        mlp = gguf_name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
        w.add_tensor(gguf_name, values.astype(np.float16) if mlp else values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return file


def random_drafter_config(
    method: str, directory: Path, target: Path, layers: int, vocab: int
) -> dict[str, Any]:
    """SpeculativeConfig fields (forced k = 4) for `method` on a 64-wide target of `layers`
    layers and `vocab` tokens at `target` (a dir or GGUF): a random EAGLE-3 head or DFlash
    drafter of its shape saved under `directory`, the target as its own draft model, or a
    lookup drafter. Random heads draft badly: their greedy tokens are mostly rejected and
    rolled back, which is what losslessness tests want to exercise."""
    from test_dflash import dflash_config, random_tensors, write_dflash

    fields: dict[str, Any] = {"method": method, "num_draft_tokens": 4, "adaptive": False}
    taps = sorted({1, max(1, layers // 2), layers - 1})
    if method == "eagle3":
        spec = HeadSpec(vocab=vocab, taps=taps, num_taps=len(taps))
        fields["draft_model"] = str(save_head(directory, spec, random_head(spec, 3), "speculators"))
    elif method == "dflash":
        cfg = dflash_config(layers, [0, layers - 1], vocab_size=vocab)
        cfg["dflash_config"]["mask_token_id"] = vocab - 1  # a token of this vocabulary
        fields["draft_model"] = str(write_dflash(directory, cfg, random_tensors(cfg, 4)))
    elif method == "draft":
        fields["draft_model"] = str(target)
    return fields
