"""GGUF layouts of the Qwen3-MoE and hybrid Qwen3-Next / Qwen3.5 / Qwen3.5-MoE families: the
config they imply and, per Hugging Face tensor, which GGUF tensors it is rebuilt from.

Stage: part of the GGUF converter (hub/convert.py). Contract: `qwen_config(meta, arch, cfg)`
returns the config.json fields beyond the dense ones; `qwen_plan(shapes, arch, cfg)` returns one
`Planned` per HF tensor (its name, shape, the GGUF tensors it reads and how), having checked
that every GGUF tensor the architecture needs is there with the shape the config implies and
that no tensor is left over. Every transform llama.cpp's converter (convert_hf_to_gguf.py,
conversion/qwen.py) applied is undone here, one named step each:
- norm weights w of the hybrids stored as 1 + w (all but the GDN output norm `ssm_norm`),
- `A_log` stored as `ssm_a` = -exp(A_log),
- the conv1d weight [C, 1, K] squeezed to [C, K],
- Qwen3-Next's `in_proj_qkvz` (rows grouped per key head: q, k, v, z) split into `attn_qkv`
  ([all q | all k | all v]) and `attn_gate` (all z); `in_proj_ba` kept as `ssm_ba`,
- Qwen3.5's value heads reordered from grouped-by-key-head to tiled order (rows of the v part
  of qkv, z, b, a, conv; A, dt; the columns of out_proj) when key heads != value heads,
- per-expert / fused `gate_up_proj` experts stored as `ffn_gate_exps` + `ffn_up_exps`,
- the MTP head `mtp.*` stored as an extra block `blk.{n_layers}` with `nextn.eh_proj` (fc),
  `nextn.enorm` / `nextn.hnorm` (pre_fc_norm_embedding / hidden), `nextn.shared_head_norm`
  (norm) beside the usual decoder-layer tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from quickdraft.hub.errors import HubError

# GGUF architecture -> (HF class, HF model_type)
QWEN_ARCHS: dict[str, tuple[str, str]] = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
MOE_ARCHS = ("qwen3moe", "qwen3next", "qwen35moe")


@dataclass(frozen=True, slots=True)
class Planned:
    """One HF tensor: `build` gets the `sources` (GGUF names) dequantized to fp32 in torch
    order (ggml's dimensions reversed) and returns the tensor of `shape`."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    build: Callable[[list[Tensor]], Tensor]


def _same(ts: list[Tensor]) -> Tensor:
    return ts[0]


def _unshift(ts: list[Tensor]) -> Tensor:
    return ts[0] - 1.0  # llama.cpp stored the zero-centred norm weight w as 1 + w


def qwen_config(meta: Callable[..., Any], arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json fields of `arch` beyond the dense ones in `cfg` (`meta(key, default,
    required=...)` reads `{arch}.key`). The MTP block is counted in `block_count`."""
    nextn = int(meta("nextn_predict_layers", 0))
    blocks = int(meta("block_count", required=True))
    layers = blocks - nextn
    out: dict[str, Any] = {"num_hidden_layers": layers}
    if arch in MOE_ARCHS:
        out.update(
            num_experts=int(meta("expert_count", required=True)),
            num_experts_per_tok=int(meta("expert_used_count", required=True)),
            moe_intermediate_size=int(meta("expert_feed_forward_length", required=True)),
            # llama.cpp always renormalizes the top-k weights for these archs (build_moe_ffn
            # with norm_w = true); the GGUF has no key for it
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if arch == "qwen3moe":
        return out
    head_dim, theta = cfg["head_dim"], cfg["rope_theta"]
    v_heads = int(meta("ssm.time_step_rank", required=True))
    recurrent = meta("attention.recurrent_layers")
    interval = int(meta("full_attention_interval", 4))
    if recurrent is not None:
        kinds = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
    else:
        kinds = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    rope_dim = int(meta("rope.dimension_count", required=True))
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": theta,
        "partial_rotary_factor": rope_dim / head_dim,
    }
    if arch != "qwen3next":  # interleaved multimodal RoPE: plain RoPE for text positions
        sections = meta("rope.dimension_sections")
        if sections is not None:
            rope["mrope_section"] = [int(s) for s in list(sections)[:3]]
        rope["mrope_interleaved"] = True
    out.update(
        layer_types=kinds,
        full_attention_interval=interval,
        linear_conv_kernel_dim=int(meta("ssm.conv_kernel", required=True)),
        linear_key_head_dim=int(meta("ssm.state_size", required=True)),
        linear_num_key_heads=int(meta("ssm.group_count", required=True)),
        linear_num_value_heads=v_heads,
        linear_value_head_dim=int(meta("ssm.inner_size", required=True)) // v_heads,
        partial_rotary_factor=rope_dim / head_dim,
        rope_parameters=rope,
    )
    if arch in MOE_ARCHS:
        out["shared_expert_intermediate_size"] = int(
            meta("expert_shared_feed_forward_length", required=True)
        )
    # Qwen3-Next's config names the MTP depth num_nextn_predict_layers, Qwen3.5's
    out["num_nextn_predict_layers" if arch == "qwen3next" else "mtp_num_hidden_layers"] = nextn
    return out


class Planner:
    """Collects `Planned` entries, checking each GGUF source's presence and shape."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], arch: str) -> None:
        self.shapes, self.arch = shapes, arch
        self.used: set[str] = set()
        self.plan: list[Planned] = []

    def need(self, name: str, shape: tuple[int, ...]) -> str:
        got = self.shapes.get(name)
        if got is None:
            raise HubError(f"{self.arch} GGUF lacks tensor {name!r}")
        if tuple(got) != shape:
            raise HubError(
                f"{self.arch} GGUF tensor {name!r} has shape {tuple(got)} (torch order), the "
                f"config implies {shape}"
            )
        self.used.add(name)
        return name

    def add(
        self,
        hf: str,
        shape: tuple[int, ...],
        sources: list[tuple[str, tuple[int, ...]]],
        build: Callable[[list[Tensor]], Tensor] = _same,
    ) -> None:
        names = tuple(self.need(n, s) for n, s in sources)
        self.plan.append(Planned(hf, shape, names, build))


def _untile_v(t: Tensor, dim: int, k_heads: int, per_v: int, head: int) -> Tensor:
    """Undo llama.cpp's Qwen3.5 value-head reorder along `dim`: it stored heads tiled
    [v0 of every key head, v1 of every key head, ...]; HF groups them per key head."""
    shape = list(t.shape)
    tiled = t.reshape(*shape[:dim], per_v, k_heads, head, *shape[dim + 1 :])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def qwen_plan(shapes: dict[str, tuple[int, ...]], arch: str, cfg: dict[str, Any]) -> list[Planned]:
    """Every HF tensor of `arch` (config.json `cfg`) from the GGUF tensors `shapes` (name ->
    torch-order shape); a HubError names a missing, misshapen or unexpected tensor."""
    p = Planner(shapes, arch)
    hidden, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hybrid = arch in HYBRID_ARCHS
    norm = _unshift if hybrid else _same
    p.add("model.embed_tokens.weight", (vocab, hidden), [("token_embd.weight", (vocab, hidden))])
    if "output.weight" in shapes:
        p.add("lm_head.weight", (vocab, hidden), [("output.weight", (vocab, hidden))])
    p.add("model.norm.weight", (hidden,), [("output_norm.weight", (hidden,))], norm)
    kinds = cfg.get("layer_types") or ["full_attention"] * layers
    for i in range(layers):
        _layer(p, cfg, f"blk.{i}.", f"model.layers.{i}.", kinds[i])
    for j in range(int(cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0)))):
        _mtp_block(p, cfg, layers + j, j)
    extra = sorted(set(shapes) - p.used)
    if extra:
        raise HubError(f"{arch} GGUF tensors with no place in the model: {extra[:8]}")
    return p.plan


def _layer(p: Planner, cfg: dict[str, Any], blk: str, hf: str, kind: str) -> None:
    """One decoder layer's tensors: its norms, mixer (attention or Gated DeltaNet) and MLP."""
    hidden, hybrid = cfg["hidden_size"], p.arch in HYBRID_ARCHS
    norm = _unshift if hybrid else _same
    p.add(hf + "input_layernorm.weight", (hidden,), [(blk + "attn_norm.weight", (hidden,))], norm)
    post = "post_attention_norm" if hybrid else "ffn_norm"
    p.add(
        hf + "post_attention_layernorm.weight",
        (hidden,),
        [(f"{blk}{post}.weight", (hidden,))],
        norm,
    )
    if kind == "full_attention":
        _attention(p, cfg, blk, hf + "self_attn.", hybrid)
    else:
        _gated_delta_net(p, cfg, blk, hf + "linear_attn.")
    if p.arch in MOE_ARCHS:
        _moe(p, cfg, blk, hf + "mlp.")
    else:
        ffn = cfg["intermediate_size"]
        for part, shape in (
            ("gate", (ffn, hidden)),
            ("up", (ffn, hidden)),
            ("down", (hidden, ffn)),
        ):
            p.add(f"{hf}mlp.{part}_proj.weight", shape, [(f"{blk}ffn_{part}.weight", shape)])


def _attention(p: Planner, cfg: dict[str, Any], blk: str, hf: str, gated: bool) -> None:
    hidden, d = cfg["hidden_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    # the hybrids' q_proj emits [query | gate] per head; llama.cpp keeps those rows as they are
    q_rows = (2 if gated else 1) * heads * d
    norm = _unshift if gated else _same
    for part, shape in (
        ("q", (q_rows, hidden)),
        ("k", (kv * d, hidden)),
        ("v", (kv * d, hidden)),
    ):
        p.add(f"{hf}{part}_proj.weight", shape, [(f"{blk}attn_{part}.weight", shape)])
    p.add(
        hf + "o_proj.weight",
        (hidden, heads * d),
        [(blk + "attn_output.weight", (hidden, heads * d))],
    )
    for part in ("q", "k"):
        p.add(f"{hf}{part}_norm.weight", (d,), [(f"{blk}attn_{part}_norm.weight", (d,))], norm)


def _gated_delta_net(p: Planner, cfg: dict[str, Any], blk: str, hf: str) -> None:
    hidden = cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    key_dim, value_dim, per_v = nk * dk, nv * dv, nv // nk
    conv_dim, kernel = 2 * key_dim + value_dim, cfg["linear_conv_kernel_dim"]
    tiled = p.arch != "qwen3next"  # Qwen3.5: value heads stored tiled (see _untile_v)

    def heads(t: Tensor, dim: int = 0, head: int = dv) -> Tensor:
        return _untile_v(t, dim, nk, per_v, head) if tiled else t

    def qkv_rows(t: Tensor) -> Tensor:  # only the v part of q | k | v was reordered
        return torch.cat([t[: 2 * key_dim], heads(t[2 * key_dim :])])

    qkv = (blk + "attn_qkv.weight", (conv_dim, hidden))
    gate = (blk + "attn_gate.weight", (value_dim, hidden))
    if p.arch == "qwen3next":
        if blk + "ssm_in.weight" in p.shapes:  # older files: in_proj_qkvz as HF stores it
            rows = conv_dim + value_dim
            p.add(
                hf + "in_proj_qkvz.weight",
                (rows, hidden),
                [(blk + "ssm_in.weight", (rows, hidden))],
            )
        else:

            def qkvz(ts: list[Tensor]) -> Tensor:
                # llama.cpp split HF's per-key-head groups [q_h k_h v_h z_h] into
                # attn_qkv = [all q | all k | all v] and attn_gate = [all z]: regroup
                w, z = ts
                q, k = w[:key_dim].view(nk, dk, -1), w[key_dim : 2 * key_dim].view(nk, dk, -1)
                v, z = w[2 * key_dim :].view(nk, per_v * dv, -1), z.view(nk, per_v * dv, -1)
                return torch.cat([q, k, v, z], dim=1).reshape(conv_dim + value_dim, -1)

            p.add(hf + "in_proj_qkvz.weight", (conv_dim + value_dim, hidden), [qkv, gate], qkvz)
        ba = (2 * nv, hidden)  # [b, a] per key head, stored as HF has it
        p.add(hf + "in_proj_ba.weight", ba, [(blk + "ssm_ba.weight", ba)])
    else:
        p.add(hf + "in_proj_qkv.weight", qkv[1], [qkv], lambda ts: qkv_rows(ts[0]))
        p.add(hf + "in_proj_z.weight", gate[1], [gate], lambda ts: heads(ts[0]))
        for hf_part, gguf_part in (("b", "ssm_beta"), ("a", "ssm_alpha")):
            p.add(
                f"{hf}in_proj_{hf_part}.weight",
                (nv, hidden),
                [(f"{blk}{gguf_part}.weight", (nv, hidden))],
                lambda ts: heads(ts[0], head=1),
            )
    # llama.cpp squeezed conv1d's [C, 1, K] to [C, K]
    p.add(
        hf + "conv1d.weight",
        (conv_dim, 1, kernel),
        [(blk + "ssm_conv1d.weight", (conv_dim, kernel))],
        lambda ts: qkv_rows(ts[0])[:, None, :],
    )
    p.add(hf + "dt_bias", (nv,), [(blk + "ssm_dt.bias", (nv,))], lambda ts: heads(ts[0], head=1))
    # llama.cpp stored ssm_a = -exp(A_log)
    p.add(
        hf + "A_log", (nv,), [(blk + "ssm_a", (nv,))], lambda ts: heads(torch.log(-ts[0]), head=1)
    )
    p.add(hf + "norm.weight", (dv,), [(blk + "ssm_norm.weight", (dv,))])  # plain w: no 1 + w
    p.add(
        hf + "out_proj.weight",
        (hidden, value_dim),
        [(blk + "ssm_out.weight", (hidden, value_dim))],
        lambda ts: heads(ts[0], dim=1),
    )


def _moe(p: Planner, cfg: dict[str, Any], blk: str, hf: str) -> None:
    hidden, experts, inter = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    p.add(hf + "gate.weight", (experts, hidden), [(blk + "ffn_gate_inp.weight", (experts, hidden))])
    # llama.cpp split HF's fused gate_up_proj [E, 2I, H] into ffn_gate_exps and ffn_up_exps
    p.add(
        hf + "experts.gate_up_proj",
        (experts, 2 * inter, hidden),
        [
            (blk + "ffn_gate_exps.weight", (experts, inter, hidden)),
            (blk + "ffn_up_exps.weight", (experts, inter, hidden)),
        ],
        lambda ts: torch.cat(ts, dim=1),
    )
    down = (experts, hidden, inter)
    p.add(hf + "experts.down_proj", down, [(blk + "ffn_down_exps.weight", down)])
    if p.arch == "qwen3moe":
        return
    shared = cfg["shared_expert_intermediate_size"]
    for part, shape in (
        ("gate", (shared, hidden)),
        ("up", (shared, hidden)),
        ("down", (hidden, shared)),
    ):
        p.add(
            f"{hf}shared_expert.{part}_proj.weight",
            shape,
            [(f"{blk}ffn_{part}_shexp.weight", shape)],
        )
    # shared_expert_gate [1, H]: llama.cpp reads it as a vector; files hold [H] or [1, H]
    gate = blk + "ffn_gate_inp_shexp.weight"
    stored = (1, hidden) if p.shapes.get(gate) == (1, hidden) else (hidden,)
    p.add(hf + "shared_expert_gate.weight", (1, hidden), [(gate, stored)], _row)


def _row(ts: list[Tensor]) -> Tensor:
    return ts[0].reshape(1, -1)


def _mtp_block(p: Planner, cfg: dict[str, Any], block: int, j: int) -> None:
    """llama.cpp's `blk.{n_layers + j}` (a full-attention decoder layer plus the nextn.*
    tensors) -> HF's `mtp.layers.{j}.*`, `mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`."""
    hidden, blk = cfg["hidden_size"], f"blk.{block}."
    for own in ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight"):
        if blk + own in p.shapes:  # Qwen's head shares the target's table and head
            raise HubError(
                f"{p.arch} GGUF tensor {blk + own!r}: an MTP head with its own "
                "embedding or output head is not supported"
            )
    _layer(p, cfg, blk, f"mtp.layers.{j}.", "full_attention")
    p.add(
        "mtp.fc.weight",
        (hidden, 2 * hidden),
        [(blk + "nextn.eh_proj.weight", (hidden, 2 * hidden))],
    )
    p.add(
        "mtp.pre_fc_norm_embedding.weight",
        (hidden,),
        [(blk + "nextn.enorm.weight", (hidden,))],
        _unshift,
    )
    p.add(
        "mtp.pre_fc_norm_hidden.weight",
        (hidden,),
        [(blk + "nextn.hnorm.weight", (hidden,))],
        _unshift,
    )
    # without shared_head_norm llama.cpp's head uses the target's output_norm
    head_norm = blk + "nextn.shared_head_norm.weight"
    source = head_norm if head_norm in p.shapes else "output_norm.weight"
    p.add("mtp.norm.weight", (hidden,), [(source, (hidden,))], _unshift)


# llama.cpp's multimodal projector files ("mmproj"): the Qwen3.5 / Qwen3-VL vision tower and
# Qwen2.5-VL's
QWEN3VL_PROJECTOR = "qwen3vl_merger"
QWEN25VL_PROJECTOR = "qwen2.5vl_merger"


def mmproj_names(depth: int) -> dict[str, str]:
    """Vision-tower parameter name (transformers', under `model.visual.`) -> its tensor name in
    an mmproj file, as llama.cpp's converter writes them; all but the patch embedding's Conv3d
    weight, which the file holds as two temporal slices, `v.patch_embd.weight` and
    `v.patch_embd.weight.1`."""
    names = {
        "patch_embed.proj.bias": "v.patch_embd.bias",
        "pos_embed.weight": "v.position_embd.weight",
        "merger.norm.weight": "v.post_ln.weight",
        "merger.norm.bias": "v.post_ln.bias",
    }
    for p in ("weight", "bias"):
        names[f"merger.linear_fc1.{p}"] = f"mm.0.{p}"
        names[f"merger.linear_fc2.{p}"] = f"mm.2.{p}"
        for i in range(depth):
            for ours, theirs in (
                ("norm1", "ln1"),
                ("norm2", "ln2"),
                ("attn.qkv", "attn_qkv"),
                ("attn.proj", "attn_out"),
                ("mlp.linear_fc1", "ffn_up"),
                ("mlp.linear_fc2", "ffn_down"),
            ):
                names[f"blocks.{i}.{ours}.{p}"] = f"v.blk.{i}.{theirs}.{p}"
    return names


def qwen25_mmproj_names(depth: int) -> dict[str, str]:
    """Qwen2.5-VL's tower parameter names (ours, under `model.visual.`) -> its mmproj tensor
    names; the fused `attn.qkv` the file holds as `attn_q`, `attn_k`, `attn_v` (listed here as
    the first of the three), the Conv3d as two temporal slices (not listed)."""
    names = {"merger.ln_q.weight": "v.post_ln.weight"}
    for p in ("weight", "bias"):
        names[f"merger.mlp.0.{p}"] = f"mm.0.{p}"
        names[f"merger.mlp.2.{p}"] = f"mm.2.{p}"
        for i in range(depth):
            for ours, theirs in (
                ("attn.proj", "attn_out"),
                ("mlp.gate_proj", "ffn_gate"),
                ("mlp.up_proj", "ffn_up"),
                ("mlp.down_proj", "ffn_down"),
            ):
                names[f"blocks.{i}.{ours}.{p}"] = f"v.blk.{i}.{theirs}.{p}"
    for i in range(depth):
        names[f"blocks.{i}.norm1.weight"] = f"v.blk.{i}.ln1.weight"
        names[f"blocks.{i}.norm2.weight"] = f"v.blk.{i}.ln2.weight"
    return names
