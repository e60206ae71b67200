"""Hybrid Gated-DeltaNet models: Qwen3-Next (`qwen3_next`), Qwen3.5 (`qwen3_5`, dense) and
Qwen3.5-MoE (`qwen3_5_moe`), as in transformers 5.x (its modeling files are the reference).

Stage: the target model. Layers follow `layer_types` (by default 3 `linear_attention` : 1
`full_attention`): a linear-attention layer is a Gated DeltaNet (fused in-projections, causal
conv1d, gated delta rule, gated RMSNorm, out-projection; math in models/gdn.py), a full-attention
layer is attention with a sigmoid output gate, q/k RMSNorm and RoPE on the first
`partial_rotary_factor` of each head. Every RMSNorm except the GDN output norm scales by
(1 + w) (zero-centred weights). The MLP is dense or a sparse MoE with a gated shared expert
(models/moe.py). Qwen3.5's multimodal RoPE (mrope) reduces to plain RoPE for text: all three
position streams are the token index.

Contract: as every `LanguageModel` (models/base.py): one forward over the packed new tokens of
several sequences, attention per sequence against its KV, conv + delta rule per sequence from
that sequence's committed state in its `HybridCache` (state_cache.py), which keeps every
token's state update of a decode step or verify so that `commit` can keep any prefix in O(1).
Parameter names are Hugging Face's; `checkpoint_name_map` maps the checkpoint variants
(composite `model.language_model.` prefix, per-expert tensors) onto them. `mtp.*` (the MTP
head) is loaded by drafters/mtp.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.kernels.cpu_ops import add_rms_norm, rms_norm
from quickdraft.kernels.cpu_ops import rope as apply_rope
from quickdraft.models.base import ForwardOutput
from quickdraft.models.gdn import (
    causal_conv1d,
    conv_window,
    delta_rule_updates,
    gated_delta_rule_chunked,
    prepare_qk,
)
from quickdraft.models.layers import LinearView, RMSNorm, Rope, attend, fused_projections, project
from quickdraft.models.llama import Embedding
from quickdraft.models.moe import GatedMLP, SparseMoE
from quickdraft.state_cache import GDNStateShape, HybridCache

HYBRID_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """What the hybrid model needs. Field names follow Hugging Face's text config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # int(head_dim * partial_rotary_factor)
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    interleaved_qkvz: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba (grouped per key head)
    intermediate_size: int  # dense MLP width (0 when every layer is MoE)
    moe_layers: tuple[bool, ...]  # per layer: sparse MoE block instead of the dense MLP
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    mtp_num_hidden_layers: int  # `mtp_num_hidden_layers` / `num_nextn_predict_layers`, else 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # the text config

    @classmethod
    def from_hf(cls, path: str | Path) -> HybridConfig:
        path = Path(path)
        raw: dict[str, Any] = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen: dict[str, Any] = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], gen: dict[str, Any] | None = None) -> HybridConfig:
        """`raw` is config.json; composite (vision-language) configs keep the language model's
        fields in `text_config`, top-level keys fill what the text config lacks."""
        gen = gen or {}
        model_type = raw.get("model_type", "")
        text = {**raw, **raw.get("text_config", {})}
        layers = int(text["num_hidden_layers"])
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported yet (model {model_type})")
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(layers)
            ]
        unknown = set(layer_types) - {"linear_attention", "full_attention"}
        if unknown or len(layer_types) != layers:
            raise ValueError(f"bad layer_types for {layers} layers: {layer_types}")
        experts = int(text.get("num_experts") or 0)
        sparse_step = int(text.get("decoder_sparse_step") or 1)
        mlp_only = set(text.get("mlp_only_layers") or ())
        eos = gen.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        mtp = text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0))
        return cls(
            model_type=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=layers,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            # the top-level model (ForConditionalGeneration) owns lm_head: its flag wins
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            attention_bias=bool(text.get("attention_bias", False)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            interleaved_qkvz=model_type == "qwen3_next",
            intermediate_size=int(text.get("intermediate_size") or 0),
            moe_layers=tuple(
                experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0
                for i in range(layers)
            ),
            num_experts=experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            mtp_num_hidden_layers=int(mtp or 0),
            eos_token_ids=eos_ids,
            bos_token_id=gen.get("bos_token_id", text.get("bos_token_id")),
            extra=text,
        )


class OffsetRMSNorm(RMSNorm):
    """y = (1 + w) * x / rms(x), in fp32: the zero-centred convention of this family (its
    checkpoints store w with 0 meaning identity; adding 1 twice halves acceptance, so only
    this class does it)."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, offset=1.0)  # fused; fp32 math


class WeightOnly(nn.Module):
    """A bare `weight` parameter under an HF module name (conv1d, the GDN output norm)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape, dtype=dtype, device=device))


class GatedAttention(nn.Module):
    """Full attention with q/k (1 + w) RMSNorm, partial RoPE and a sigmoid output gate."""

    def __init__(self, cfg: HybridConfig, kv_index: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.kv_index = kv_index  # this layer's slot in the cache's attention KV
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        d = self.head_dim
        # q_proj emits [query | gate] per head
        self.qkv_weight, self.qkv_bias = fused_projections(
            self,
            cfg.hidden_size,
            {
                "q_proj": 2 * self.heads * d,
                "k_proj": self.kv_heads * d,
                "v_proj": self.kv_heads * d,
            },
            cfg.attention_bias,
            dtype,
            device,
        )
        self.o_proj = LinearView(
            torch.empty(cfg.hidden_size, self.heads * d, dtype=dtype, device=device), None
        )
        self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.scale = d**-0.5

    def forward(
        self,
        x: Tensor,  # [N, hidden]
        rope: tuple[Tensor, Tensor],  # cos, sin [N, 1, rotary_dim]
        caches: Sequence[Any],  # HybridCache or KVCache: `.length` and `.write(layer, k, v)`
        num_new: Sequence[int],
    ) -> Tensor:
        n, h, hk, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = project(x, self.qkv_weight, self.qkv_bias)  # [N, (2H + 2Hkv) d]
        q_gate = qkv[:, : 2 * h * d].view(n, h, 2 * d)
        gate = q_gate[..., d:].reshape(n, h * d)
        q = self.q_norm(q_gate[..., :d])
        k = self.k_norm(qkv[:, 2 * h * d : (2 * h + hk) * d].view(n, hk, d))
        v = qkv[:, (2 * h + hk) * d :].view(n, hk, d)
        cos, sin = rope[0][:, 0], rope[1][:, 0]  # [N, rotary_dim]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # first rotary_dim dims only
        outs, start = [], 0
        for cache, count in zip(caches, num_new, strict=True):
            seg = slice(start, start + count)
            keys, values = cache.write(
                self.kv_index, k[seg].transpose(0, 1), v[seg].transpose(0, 1)
            )
            outs.append(attend(q[seg], keys, values, cache.length, self.scale))
            start += count
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, H d]
        return project(out * torch.sigmoid(gate), self.o_proj.weight)


class GatedDeltaNet(nn.Module):
    """Linear attention: in-projections -> causal conv1d -> gated delta rule -> gated RMSNorm
    -> out_proj. Conv and delta rule run per sequence from its committed state."""

    def __init__(self, cfg: HybridConfig, gdn_index: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.gdn_index = gdn_index  # this layer's slot in the cache's recurrent state
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.interleaved = cfg.interleaved_qkvz
        self.eps = cfg.rms_norm_eps
        outs = (
            {"in_proj_qkvz": self.conv_dim + self.value_dim, "in_proj_ba": 2 * self.v_heads}
            if self.interleaved
            else {
                "in_proj_qkv": self.conv_dim,
                "in_proj_z": self.value_dim,
                "in_proj_b": self.v_heads,
                "in_proj_a": self.v_heads,
            }
        )
        self.in_weight, _ = fused_projections(self, cfg.hidden_size, outs, False, dtype, device)
        self.conv1d = WeightOnly((self.conv_dim, 1, cfg.linear_conv_kernel_dim), dtype, device)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads, dtype=dtype, device=device))
        self.norm = WeightOnly((self.dv,), dtype, device)
        self.out_proj = LinearView(
            torch.empty(cfg.hidden_size, self.value_dim, dtype=dtype, device=device), None
        )

    def _split(self, proj: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """proj [N, total] -> conv input [N, q | k | v], z [N, Hv, dv], b [N, Hv], a [N, Hv]."""
        n, hv = proj.shape[0], self.v_heads
        if not self.interleaved:
            c, vd = self.conv_dim, self.value_dim
            z = proj[:, c : c + vd].reshape(n, hv, self.dv)
            return proj[:, :c], z, proj[:, c + vd : c + vd + hv], proj[:, c + vd + hv :]
        # Qwen3-Next groups [q, k, v, z] and [b, a] per key head; regroup to Qwen3.5's layout.
        per_v = hv // self.k_heads
        grouped = proj[:, : self.conv_dim + self.value_dim].view(n, self.k_heads, -1)
        sizes = [self.dk, self.dk, per_v * self.dv, per_v * self.dv]
        q, k, v, z = torch.split(grouped, sizes, dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        ba = proj[:, self.conv_dim + self.value_dim :].view(n, self.k_heads, 2 * per_v)
        b, a = ba[..., :per_v].reshape(n, hv), ba[..., per_v:].reshape(n, hv)
        return mixed, z.reshape(n, hv, self.dv), b, a

    def forward(self, x: Tensor, caches: Sequence[HybridCache], num_new: Sequence[int]) -> Tensor:
        mixed, z, b, a = self._split(project(x, self.in_weight))
        beta = torch.sigmoid(b.float())  # [N, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # log decay
        conv_w = self.conv1d.weight[:, 0]  # [C, K]
        core = torch.empty(x.shape[0], self.v_heads, self.dv, dtype=torch.float32, device=x.device)
        kd, start = self.key_dim, 0
        for cache, n in zip(caches, num_new, strict=True):
            seg = slice(start, start + n)
            window, state = cache.gdn_state(self.gdn_index)  # committed; read only
            y = causal_conv1d(mixed[seg], window, conv_w)  # [n, C] fp32
            q, k = prepare_qk(
                y[:, :kd].view(n, self.k_heads, self.dk),
                y[:, kd : 2 * kd].view(n, self.k_heads, self.dk),
                self.v_heads,
            )
            v = y[:, 2 * kd :].view(n, self.v_heads, self.dv)
            if cache.keeps_checkpoints:  # a decode step or a verify: every token committable
                core[seg], updates = delta_rule_updates(q, k, v, g[seg], beta[seg], state)
                cache.keep_checkpoints(self.gdn_index, mixed[seg], updates)
            else:  # a prompt chunk: only its final state
                final_conv, final_state = cache.final_state(self.gdn_index)
                dest: list[Tensor | None] = [None] * (n - 1) + [final_state]
                core[seg] = gated_delta_rule_chunked(q, k, v, g[seg], beta[seg], state, dest)
                final_conv.copy_(conv_window(window, mixed[seg]))
            start += n
        # gated RMSNorm (plain w here, not 1 + w): norm(core) * w * silu(z), in fp32
        out = rms_norm(core, self.norm.weight.float(), self.eps) * F.silu(z.float())  # [N, Hv, dv]
        return project(out.reshape(x.shape[0], -1).to(x.dtype), self.out_proj.weight)


class HybridDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: HybridConfig,
        layer_type: str,
        mixer_index: int,  # index among the model's layers of the same type (cache slot)
        moe: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.layer_type = layer_type
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = OffsetRMSNorm(hidden, eps, dtype, device)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, mixer_index, dtype, device)
        else:
            self.self_attn = GatedAttention(cfg, mixer_index, dtype, device)
        self.mlp: nn.Module = (
            SparseMoE(
                hidden,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.shared_expert_intermediate_size,
                cfg.norm_topk_prob,
                dtype,
                device,
            )
            if moe
            else GatedMLP(hidden, cfg.intermediate_size, dtype, device)
        )

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        caches: Sequence[Any],
        num_new: Sequence[int],
    ) -> Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            mixed = self.linear_attn(h, caches, num_new)
        else:
            mixed = self.self_attn(h, rope, caches, num_new)
        norm = self.post_attention_layernorm
        x, h = add_rms_norm(x, mixed, norm.weight, norm.eps, offset=1.0)  # residual, fused
        return x + self.mlp(h)


class HybridModel(nn.Module):
    """HF's `model.` submodule: embeddings, layers, final norm."""

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        counts = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            layers.append(
                HybridDecoderLayer(cfg, kind, counts[kind], cfg.moe_layers[i], dtype, device)
            )
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class HybridLM(nn.Module):
    def __init__(
        self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = cfg, dtype, device
        self.model = HybridModel(cfg, dtype, device)
        head: Tensor = (
            self.model.embed_tokens.weight
            if cfg.tie_word_embeddings
            else torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.lm_head = LinearView(head, None)
        self.rope = Rope(cfg.rotary_dim, cfg.rope_theta, device)
        self.num_attention_layers = cfg.layer_types.count("full_attention")
        self.gdn_shape = GDNStateShape(
            num_layers=cfg.layer_types.count("linear_attention"),
            conv_dim=2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
            conv_kernel=cfg.linear_conv_kernel_dim,
            num_heads=cfg.linear_num_value_heads,
            key_dim=cfg.linear_key_head_dim,
            value_dim=cfg.linear_value_head_dim,
        )
        self.requires_grad_(False)

    def new_cache(self, capacity: int) -> HybridCache:
        cfg = self.config
        return HybridCache(
            self.num_attention_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            capacity,
            self.gdn_shape,
            self.dtype,
            self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,  # [N] new tokens of all sequences, packed in `caches` order
        caches: Sequence[HybridCache],
        num_new: Sequence[int],  # new tokens per sequence; sums to N
        logit_rows: Tensor | None = None,  # rows of N to score; default: last row of each seq
        return_hidden: bool = False,
        hidden_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        assert input_ids.dim() == 1 and sum(num_new) == input_ids.shape[0]
        for cache, n in zip(caches, num_new, strict=True):
            if cache.length + n > self.config.max_position_embeddings:
                raise ValueError(
                    f"sequence of {cache.length + n} tokens exceeds the model context "
                    f"({self.config.max_position_embeddings})"
                )
            cache.reserve(n)
        positions = torch.cat(
            [
                torch.arange(c.length, c.length + n, device=self.device)
                for c, n in zip(caches, num_new, strict=True)
            ]
        )
        rope = self.rope.tables(positions, self.dtype)
        x = self.model.embed_tokens(input_ids)  # [N, hidden]
        layer_hidden: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, caches, num_new)
            if i in hidden_layers:
                layer_hidden[i] = x
        if logit_rows is None:
            logit_rows = torch.tensor(list(num_new), device=self.device).cumsum(0) - 1
        if return_hidden:
            hidden = self.model.norm(x)  # [N, hidden]
            logits = project(hidden[logit_rows], self.lm_head.weight).float()
            return ForwardOutput(logits, hidden, layer_hidden)
        logits = project(self.model.norm(x[logit_rows]), self.lm_head.weight).float()
        return ForwardOutput(logits, None, layer_hidden)


# -- checkpoints ---------------------------------------------------------------------------------

# A checkpoint tensor name -> (our parameter name, index into it), or None to skip the tensor.
NameMap = Callable[[str], tuple[str, tuple[int | slice, ...]] | None]

_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def checkpoint_name_map(cfg: HybridConfig) -> NameMap:
    """Composite Qwen3.5 checkpoints prefix the language model with `model.language_model.`
    and carry a vision tower (skipped: text only); Qwen3-Next (and transformers' save format)
    store one tensor per expert, which go into the fused `experts.gate_up_proj` / `down_proj`."""
    inter = cfg.moe_intermediate_size

    def target(name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        if name.startswith("model.visual."):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            return name, ()
        prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
        if kind == "down":
            return f"{prefix}.down_proj", (expert,)
        rows = slice(0, inter) if kind == "gate" else slice(inter, 2 * inter)
        return f"{prefix}.gate_up_proj", (expert, rows)

    return target
