"""Gemma 4 GGUF files (llama.cpp's `gemma4` architecture) as Hugging Face's `gemma4_text`: the
config.json fields beyond the dense ones, and every HF tensor from the GGUF tensors llama.cpp's
converter wrote (conversion/gemma.py there, `Gemma4Model`):
- per-layer shapes: `attention.sliding_window_pattern` marks the local layers;
  `attention.key_length` is the global layers' head size, `key_length_swa` the local ones';
  `attention.head_count_kv` is a per-layer array where global layers have other KV heads;
  `feed_forward_length` a per-layer array where the KV-sharing layers' MLPs are twice as wide;
  a global layer without `attn_v` takes its values from its keys' projection (k = v);
- the global layers' proportional RoPE is `rope_freqs` (1 for a rotated frequency, 1e30 for
  one left unrotated: the rotated share is read from it); the local base is `rope.freq_base_swa`;
- norms are stored as HF's (no 1 + w, unlike Gemma 3); the router's scale vector is
  `ffn_gate_inp.scale`, the per-expert scale `ffn_down_exps.scale`, the experts' gate and up
  `ffn_gate_up_exps` (or split `ffn_gate_exps` / `ffn_up_exps`); `layer_output_scale` is each
  layer's scalar; the per-layer embeddings are `per_layer_token_embd`, `per_layer_model_proj`,
  `per_layer_proj_norm` and, per layer, `inp_gate`, `proj`, `post_norm`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quickdraft.hub.errors import HubError
from quickdraft.hub.gguf_qwen import Planned, Planner

ARCH = "gemma4"
# llama.cpp's `gemma4-assistant`: the assistant drafter (conversion/gemma.py there,
# `Gemma4AssistantModel`): gemma4's metadata and layer tensors (queries only: every layer reads
# the target's KV), `embedding_length_out` the target's width, `nextn.pre_projection` /
# `nextn.post_projection` its projections in and out; the centroid mask of the E2B / E4B
# assistants is left out by that converter (`masked_embd_*` when another wrote it): llama.cpp
# scores the whole vocabulary with the tied embedding, and so do we from such a file
ASSISTANT_ARCH = "gemma4-assistant"
_PRE, _POST = "nextn.pre_projection.weight", "nextn.post_projection.weight"
SLIDING, FULL = "sliding_attention", "full_attention"


def per_layer(value: Any, n: int) -> list[int]:
    """A metadata value that is one number or a per-layer array, as n numbers (n 1: the
    first of an array)."""
    if isinstance(value, list | tuple | np.ndarray):
        if n == 1:
            return [int(value[0])]
        if len(value) != n:
            raise HubError(f"{ARCH}: a per-layer array of {len(value)} values for {n} layers")
        return [int(v) for v in value]
    return [int(value)] * n


def gemma4_config(
    meta: Callable[..., Any], cfg: dict[str, Any], names: set[str], rope_freqs: Any
) -> dict[str, Any]:
    """config.json fields of a gemma4 file beyond the dense ones in `cfg` (`meta(key, default,
    required=...)` reads `gemma4.key`; `names`: the file's tensor names; `rope_freqs`: the
    values of its `rope_freqs.weight`, or None)."""
    n = cfg["num_hidden_layers"]
    pattern = meta("attention.sliding_window_pattern", required=True)
    types = [SLIDING if bool(s) else FULL for s in pattern]
    if len(types) != n or FULL not in types:
        raise HubError(f"{ARCH}: sliding_window_pattern {list(pattern)} for {n} layers")
    local = [i for i, t in enumerate(types) if t == SLIDING]
    glob = types.index(FULL)
    kv = per_layer(meta("attention.head_count_kv", required=True), n)
    ff = per_layer(meta("feed_forward_length", required=True), n)
    shared = int(meta("attention.shared_kv_layers", 0))
    full_dim = int(meta("attention.key_length", required=True))
    rotated = full_dim // 2
    if rope_freqs is not None:  # 1 for a rotated frequency, 1e30 for an unrotated one
        rotated = int((np.asarray(rope_freqs, dtype=np.float64) < 1e10).sum())
    experts = int(meta("expert_count", 0))
    ple = int(meta("embedding_length_per_layer_input", 0))
    cap = meta("final_logit_softcapping")
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "head_dim": int(meta("attention.key_length_swa", required=True)),
        "global_head_dim": full_dim,
        "num_key_value_heads": kv[local[0]] if local else kv[glob],
        "num_global_key_value_heads": kv[glob],
        "attention_k_eq_v": f"blk.{glob}.attn_v.weight" not in names,
        "intermediate_size": ff[0],
        "use_double_wide_mlp": shared > 0 and ff[-1] == 2 * ff[0],
        "layer_types": types,
        "sliding_window": int(meta("attention.sliding_window", required=True)),
        "final_logit_softcapping": None if cap is None else float(cap),
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": ple,
        "vocab_size_per_layer_input": cfg["vocab_size"] if ple else 0,
        "enable_moe_block": experts > 0,
        "rope_parameters": {
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": 2 * rotated / full_dim,
                "rope_theta": cfg["rope_theta"],
            },
            SLIDING: {
                "rope_type": "default",
                "rope_theta": float(meta("rope.freq_base_swa", 10000.0)),
            },
        },
        # an image's rows see each other both ways in the local layers of the checkpoints
        # without per-layer embeddings (26B-A4B, 31B; their configs say "vision"), not in
        # E2B / E4B: the file keeps no key for it (llama.cpp's mtmd goes by the width)
        "use_bidirectional_attention": None if ple else "vision",
    }
    if experts:
        out |= {
            "num_experts": experts,
            "top_k_experts": int(meta("expert_used_count", required=True)),
            "moe_intermediate_size": int(meta("expert_feed_forward_length", required=True)),
        }
    return out


def _ones(ts: list[Tensor]) -> Tensor:
    return torch.ones(1)


def _joined(ts: list[Tensor]) -> Tensor:
    return torch.cat(ts, 1)  # [E, I, H] gate, up -> [E, 2I, H]


def gemma4_plan(shapes: dict[str, tuple[int, ...]], cfg: dict[str, Any]) -> list[Planned]:
    """Every HF tensor of a Gemma 4 model (config.json `cfg`) from the GGUF tensors `shapes`
    (name -> torch-order shape); a HubError names a missing, misshapen or unexpected tensor."""
    p = Planner(shapes, ARCH)
    hidden, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, types, ple = (
        cfg["num_attention_heads"],
        cfg["layer_types"],
        cfg["hidden_size_per_layer_input"],
    )
    k_eq_v, moe = cfg["attention_k_eq_v"], cfg["enable_moe_block"]
    first_shared = n - cfg["num_kv_shared_layers"]

    def vec(hf: str, gguf: str, size: int) -> None:
        p.add(hf, (size,), [(gguf, (size,))])

    def mat(hf: str, gguf: str, rows: int, cols: int) -> None:
        p.add(hf, (rows, cols), [(gguf, (rows, cols))])

    mat("model.embed_tokens.weight", "token_embd.weight", vocab, hidden)
    if "output.weight" in shapes:
        mat("lm_head.weight", "output.weight", vocab, hidden)
    vec("model.norm.weight", "output_norm.weight", hidden)
    if "rope_freqs.weight" in shapes:  # read into the config (its rotated share)
        p.used.add("rope_freqs.weight")
    if ple:
        size = n * ple
        mat("model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight", vocab, size)
        mat("model.per_layer_model_projection.weight", "per_layer_model_proj.weight", size, hidden)
        vec("model.per_layer_projection_norm.weight", "per_layer_proj_norm.weight", ple)
    for i in range(n):
        blk, hf = f"blk.{i}.", f"model.layers.{i}."
        full = types[i] == FULL
        d = cfg["global_head_dim"] if full else cfg["head_dim"]
        kv = cfg["num_global_key_value_heads" if full and k_eq_v else "num_key_value_heads"]
        norms = {
            "input_layernorm": "attn_norm",
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
        if moe:
            norms |= {
                "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
                "post_feedforward_layernorm_1": "post_ffw_norm_1",
                "post_feedforward_layernorm_2": "post_ffw_norm_2",
            }
        if ple:
            norms["post_per_layer_input_norm"] = "post_norm"
        for ours, theirs in norms.items():
            vec(f"{hf}{ours}.weight", f"{blk}{theirs}.weight", hidden)
        at = hf + "self_attn."
        mat(at + "q_proj.weight", blk + "attn_q.weight", heads * d, hidden)
        vec(at + "q_norm.weight", blk + "attn_q_norm.weight", d)
        if i < first_shared:  # a layer with KV of its own
            mat(at + "k_proj.weight", blk + "attn_k.weight", kv * d, hidden)
            vec(at + "k_norm.weight", blk + "attn_k_norm.weight", d)
            if not (k_eq_v and full):
                mat(at + "v_proj.weight", blk + "attn_v.weight", kv * d, hidden)
        mat(at + "o_proj.weight", blk + "attn_output.weight", hidden, heads * d)
        wide = cfg["use_double_wide_mlp"] and i >= first_shared
        inter = cfg["intermediate_size"] * (2 if wide else 1)
        for part, rows, cols in (("gate", inter, hidden), ("up", inter, hidden)):
            mat(f"{hf}mlp.{part}_proj.weight", f"{blk}ffn_{part}.weight", rows, cols)
        mat(hf + "mlp.down_proj.weight", blk + "ffn_down.weight", hidden, inter)
        if blk + "layer_output_scale.weight" in shapes:
            vec(hf + "layer_scalar", blk + "layer_output_scale.weight", 1)
        else:  # llama.cpp does not require it: HF's default
            p.add(hf + "layer_scalar", (1,), [], _ones)
        if ple:
            mat(hf + "per_layer_input_gate.weight", blk + "inp_gate.weight", ple, hidden)
            mat(hf + "per_layer_projection.weight", blk + "proj.weight", hidden, ple)
        if moe:
            e, inner = cfg["num_experts"], cfg["moe_intermediate_size"]
            mat(hf + "router.proj.weight", blk + "ffn_gate_inp.weight", e, hidden)
            vec(hf + "router.scale", blk + "ffn_gate_inp.scale", hidden)
            vec(hf + "router.per_expert_scale", blk + "ffn_down_exps.scale", e)
            ex = hf + "experts."
            if blk + "ffn_gate_up_exps.weight" in shapes:
                both = (e, 2 * inner, hidden)
                p.add(ex + "gate_up_proj", both, [(blk + "ffn_gate_up_exps.weight", both)])
            else:
                one: tuple[int, ...] = (e, inner, hidden)
                parts = [(blk + "ffn_gate_exps.weight", one), (blk + "ffn_up_exps.weight", one)]
                p.add(ex + "gate_up_proj", (e, 2 * inner, hidden), parts, _joined)
            down = (e, hidden, inner)
            p.add(ex + "down_proj", down, [(blk + "ffn_down_exps.weight", down)])
    extra = sorted(set(shapes) - p.used)
    if extra:
        raise HubError(f"{ARCH} GGUF tensors with no place in the model: {extra[:8]}")
    return p.plan


def assistant_plan(
    shapes: dict[str, tuple[int, ...]], cfg: dict[str, Any], backbone: int
) -> list[Planned]:
    """Every HF tensor of a Gemma 4 assistant (its text config `cfg`; `backbone`: the
    target's hidden size) from a gemma4-assistant file's tensors `shapes`."""
    hidden = cfg["hidden_size"]
    ours = {n: s for n, s in shapes.items() if n not in (_PRE, _POST)}
    ours = {n: s for n, s in ours.items() if not n.startswith("masked_embd_")}
    # query-only layers: no k / v of their own, whatever the file says it shares
    plan = gemma4_plan(ours, {**cfg, "num_kv_shared_layers": cfg["num_hidden_layers"]})
    p = Planner(shapes, ASSISTANT_ARCH)
    p.add("pre_projection.weight", (hidden, 2 * backbone), [(_PRE, (hidden, 2 * backbone))])
    p.add("post_projection.weight", (backbone, hidden), [(_POST, (backbone, hidden))])
    return plan + p.plan


def assistant_tensors(state: dict[str, Tensor], cfg: dict[str, Any]) -> dict[str, Tensor]:
    """A transformers Gemma 4 assistant's state dict as llama.cpp's converter writes it (its
    text config `cfg`): gemma4's names, the projections as `nextn.*`, no centroid mask."""
    own = {"pre_projection.weight": _PRE, "post_projection.weight": _POST}
    rest = {
        n: t
        for n, t in state.items()
        if n not in own and not n.startswith("masked_embedding.") and n != "lm_head.weight"
    }
    out = gemma4_tensors(rest, {**cfg, "tie_word_embeddings": True})
    out.update({own[n]: state[n].detach().float().clone() for n in own})
    return out


# HF module path in a layer -> llama.cpp tensor kind (the writer's side of `gemma4_plan`)
_LAYER_KINDS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
    "post_per_layer_input_norm": "post_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "router.proj": "ffn_gate_inp",
}
_LAYER_TENSORS = {
    "layer_scalar": "layer_output_scale.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}


def global_shape(cfg: dict[str, Any]) -> tuple[int, int]:
    """(head size, KV heads) of a transformers config's global layers: its `global_head_dim`
    and `num_global_key_value_heads`, or transformers 5.x's `per_layer_config` entry of a
    global layer (as llama.cpp's converter reads them)."""
    dim, kv = cfg.get("global_head_dim"), cfg.get("num_global_key_value_heads")
    for i, t in enumerate(cfg["layer_types"]):
        over = (cfg.get("per_layer_config") or {}).get(str(i)) or {}
        if t == FULL and over:
            dim = dim or over.get("head_dim")
            kv = kv or over.get("num_key_value_heads")
            break
    return int(dim or 512), int(kv or cfg["num_key_value_heads"])


def gemma4_tensors(state: dict[str, Tensor], cfg: dict[str, Any]) -> dict[str, Tensor]:
    """A transformers Gemma 4 state dict as llama.cpp's converter writes it (fp32, torch
    order): its names, the head left out when tied, and `rope_freqs` for the global layers'
    proportional RoPE."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        t = t.detach().float().clone()
        if name in _GLOBAL_TENSORS:
            if name != "lm_head.weight" or not cfg.get("tie_word_embeddings", True):
                out[_GLOBAL_TENSORS[name]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(\.weight)?", name)
        if m is None:
            raise HubError(f"{ARCH}: no GGUF name for {name!r}")
        blk, module = f"blk.{m[1]}.", m[2]
        if m[3] is None and module in _LAYER_TENSORS:
            out[blk + _LAYER_TENSORS[module]] = t
        else:
            out[f"{blk}{_LAYER_KINDS[module]}.weight"] = t
    rope = (cfg.get("rope_parameters") or {}).get(FULL, {})
    half = global_shape(cfg)[0] // 2
    rotated = int(rope.get("partial_rotary_factor", 1.0) * half)
    out["rope_freqs.weight"] = torch.tensor([1.0] * rotated + [1e30] * (half - rotated))
    return out


def add_gemma4_metadata(w: Any, cfg: dict[str, Any]) -> None:
    """llama.cpp's gemma4 keys beyond the dense ones, from a transformers config dict (what
    its converter writes, `Gemma4Model.set_gguf_parameters`)."""
    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    (full, glob_kv), local = global_shape(cfg), cfg["head_dim"]
    shared = cfg.get("num_kv_shared_layers") or 0
    w.add_sliding_window_pattern([t == SLIDING for t in types])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_key_length(full)
    w.add_value_length(full)
    w.add_key_length_swa(local)
    w.add_value_length_swa(local)
    w.add_rope_dimension_count(full)
    w.add_rope_dimension_count_swa(local)
    w.add_sliding_window(cfg["sliding_window"])
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope[FULL]["rope_theta"])
    w.add_rope_freq_base_swa(rope[SLIDING]["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    kv = cfg["num_key_value_heads"]
    if cfg.get("attention_k_eq_v"):
        w.add_head_count_kv([kv if t == SLIDING else glob_kv for t in types])
    else:
        w.add_head_count_kv(kv)
    inter = cfg["intermediate_size"]
    if cfg.get("use_double_wide_mlp") and shared:
        w.add_feed_forward_length([inter if i < n - shared else 2 * inter for i in range(n)])
    else:
        w.add_feed_forward_length(inter)
    if cfg.get("enable_moe_block"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


# llama.cpp's multimodal projector file ("mmproj") of a Gemma 4: the vision tower, projector
# type `gemma4v` (conversion/gemma.py `Gemma4VisionAudioModel`)
GEMMA4V_PROJECTOR = "gemma4v"
GEMMA4V_TOKENS = ("<|image|>", "<|image>", "<image|>")  # image, begin, end (llama.cpp's mtmd)
GEMMA4_VIDEO_TOKEN = "<|video|>"  # a video frame's placeholder (transformers' Gemma4Processor)
_VISION_LINEARS = (
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_out"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
)
CLAMPS = ("input_min", "input_max", "output_min", "output_max")


def gemma4_mmproj_names(depth: int, clipped: bool, standardize: bool) -> dict[str, str]:
    """The Gemma 4 tower's parameter names (ours: the checkpoint's under `model.vision_tower.`,
    `embed_vision.` for `model.embed_vision.`) -> its mmproj tensor names; all but the patch
    embedding, which the file holds as a Conv2d `[E, 3, p, p]` (`v.patch_embd.weight`), and
    each clipped projection's bounds, 1-element tensors beside its weight
    (`v.blk.N.attn_q.input_min`, ...)."""
    names = {
        "patch_embedder.position_embedding_table": "v.position_embd.weight",
        "embed_vision.embedding_projection.weight": "mm.input_projection.weight",
    }
    if standardize:
        names |= {"std_bias": "v.std_bias", "std_scale": "v.std_scale"}
    for i in range(depth):
        ours, theirs = f"encoder.layers.{i}.", f"v.blk.{i}."
        for norm, name in (
            ("input_layernorm", "ln1"),
            ("post_attention_layernorm", "attn_post_norm"),
            ("pre_feedforward_layernorm", "ln2"),
            ("post_feedforward_layernorm", "ffn_post_norm"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
        ):
            names[f"{ours}{norm}.weight"] = f"{theirs}{name}.weight"
        for linear, name in _VISION_LINEARS:
            names[f"{ours}{linear}.linear.weight"] = f"{theirs}{name}.weight"
            for bound in CLAMPS if clipped else ():
                names[f"{ours}{linear}.{bound}"] = f"{theirs}{name}.{bound}"
    return names
