"""Hybrid Gated-DeltaNet models: Qwen3-Next (`qwen3_next`), Qwen3.5 (`qwen3_5`, dense) and
Qwen3.5-MoE (`qwen3_5_moe`), as in transformers 5.x (its modeling files are the reference).

Stage: the target model. Layers follow `layer_types` (by default 3 `linear_attention` : 1
`full_attention`): a linear-attention layer is a Gated DeltaNet (fused in-projections, causal
conv1d, gated delta rule, gated RMSNorm, out-projection; math in kernels/gdn.py), a full-attention
layer is attention with a sigmoid output gate, q/k RMSNorm and RoPE on the first
`partial_rotary_factor` of each head. Every RMSNorm except the GDN output norm scales by
(1 + w) (zero-centred weights). The MLP is dense or a sparse MoE with a gated shared expert
(models/families/moe.py). Qwen3.5's multimodal RoPE (M-RoPE) reduces to plain RoPE for text, all
three position streams being the token index; with images the caller passes every row's (t, h, w)
positions and the image rows' embeddings (`ImageRows`; models/families/vision.py encodes them).

Contract: as every `LanguageModel` (models/base.py): one forward over the packed new tokens of
several sequences, attention per sequence against its KV, conv + delta rule per sequence from
that sequence's committed state in its `HybridCache` (state_cache.py), which keeps every
token's state update of a decode step or verify so that `commit` can keep any prefix in O(1).
Parameter names are Hugging Face's; models/families/hybrid_config.py has the config record and maps
the checkpoint variants (composite `model.language_model.` prefix, per-expert tensors) onto them.
`mtp.*` (the MTP head) is loaded by drafters/mtp.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from quickdraft.kernels.attention import attend
from quickdraft.kernels.gdn import (
    causal_conv1d,
    conv_window,
    gates,
    long_forward,
    recurrent_updates,
)
from quickdraft.kernels.gemm import Weight, project, to_panels
from quickdraft.kernels.hybrid_layer import attention_layer, gdn_layer
from quickdraft.kernels.pointwise import add_rms_norm, gated_rms_norm, rms_norm, sigmoid
from quickdraft.kernels.pointwise import rope as apply_rope
from quickdraft.models.base import ForwardOutput, ImageRows, packed_positions
from quickdraft.models.caches.state_cache import GDNStateShape, HybridCache
from quickdraft.models.families.hybrid_config import HybridConfig
from quickdraft.models.families.llama import Embedding, many_args
from quickdraft.models.families.moe import GatedMLP, SparseMoE
from quickdraft.models.layers import (
    HeadLogits,
    LinearView,
    OperandModule,
    RMSNorm,
    Rope,
    VocabSubset,
    convert_operands_,
    fused_projections,
    tapped_layers,
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


class GatedAttention(OperandModule):
    """Full attention with q/k (1 + w) RMSNorm, partial RoPE and a sigmoid output gate."""

    OPERANDS: ClassVar[tuple[str, ...]] = ("qkv", "o")
    FUSED: ClassVar[tuple[str, ...]] = ("qkv_weight",)

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
        # the GEMM operands the forward reads (views of the HF-named parameters until packed)
        self.qkv: Weight = self.qkv_weight
        self.o: Weight = self.o_proj.weight.detach()

    def forward(
        self,
        x: Tensor,  # [N, hidden]
        rope: tuple[Tensor, Tensor],  # cos, sin [N, 1, rotary_dim]
        caches: Sequence[Any],  # HybridCache or KVCache: `.length` and `.write(layer, k, v)`
        num_new: Sequence[int],
    ) -> Tensor:
        n, h, hk, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = project(x, self.qkv, self.qkv_bias)  # [N, (2H + 2Hkv) d]
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
        return project(out * sigmoid(gate), self.o)


class GatedDeltaNet(OperandModule):
    """Linear attention: in-projections -> causal conv1d -> gated delta rule -> gated RMSNorm
    -> out_proj. Conv and delta rule run per sequence from its committed state."""

    OPERANDS: ClassVar[tuple[str, ...]] = ("inp", "out")
    FUSED: ClassVar[tuple[str, ...]] = ("in_weight",)

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
        self.inp: Weight = self.in_weight  # GEMM operands, as in GatedAttention
        self.out: Weight = self.out_proj.weight.detach()
        # value-head order `out`'s columns expect, when not HF's (a Qwen3.5 GGUF's quantized
        # out_proj keeps llama.cpp's tiled head order: models/gguf_qwen.py); None: HF's
        self.out_heads: Tensor | None = None

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
        mixed, z, b, a = self._split(project(x, self.inp))
        g, beta = gates(a, b, self.A_log, self.dt_bias)  # [N, Hv] fp32: log decay, beta
        conv_w = self.conv1d.weight[:, 0]  # [C, K]
        core = torch.empty(x.shape[0], self.v_heads, self.dv, dtype=torch.float32, device=x.device)
        start = 0
        for cache, n in zip(caches, num_new, strict=True):
            seg = slice(start, start + n)
            if cache.keeps_checkpoints:  # a decode step or a verify: every token committable
                # the last forward's kept updates are applied in the same pass over the state
                window, state, pending = cache.gdn_state_deferred(self.gdn_index)
                y = causal_conv1d(mixed[seg], window, conv_w)  # [n, C] fp32
                core[seg], updates = recurrent_updates(
                    y, g[seg], beta[seg], state, self.k_heads, pending
                )
                cache.keep_checkpoints(self.gdn_index, mixed[seg], updates)
            else:  # a prompt chunk: only its final state
                window, state = cache.gdn_state(self.gdn_index)  # committed; read only
                y = causal_conv1d(mixed[seg], window, conv_w)  # [n, C] fp32
                final_conv, final_state = cache.final_state(self.gdn_index)
                core[seg] = long_forward(y, g[seg], beta[seg], state, final_state, self.k_heads)
                final_conv.copy_(conv_window(window, mixed[seg]))
            start += n
        # gated RMSNorm (plain w here, not 1 + w): norm(core) * w * silu(z), fp32 math, fused
        out = gated_rms_norm(core, self.norm.weight, z, self.eps)  # [N, Hv, dv]
        if self.out_heads is not None:
            out = out.index_select(1, self.out_heads)  # a copy, as `out[:, heads]`, 3x cheaper
        return project(out.reshape(x.shape[0], -1), self.out)


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


def _mlp_parts(mlp: nn.Module) -> tuple[dict[str, Weight], Any] | None:
    """A hybrid layer's MLP as the C++ layers take it: (gate_up / down operands of a gated
    MLP, None) or ({}, the MoE block's one call); None where it is not one call."""
    if isinstance(mlp, GatedMLP):
        return {"gate_up": mlp.gate_up, "down": mlp.down}, None
    block = mlp.block() if isinstance(mlp, SparseMoE) else None
    return None if block is None else ({}, block)


def fused_layer(layer: HybridDecoderLayer, dtype: torch.dtype) -> Any:
    """`layer` as the extension's C++ GDNLayer or HybridAttentionLayer
    (kernels/hybrid_layer.py), or None where it cannot run (Qwen3-Next's interleaved
    in-projection, an MLP that is not one call, ...)."""
    mlp = _mlp_parts(layer.mlp)
    if mlp is None:
        return None
    tail, moe = mlp
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if layer.layer_type != "linear_attention":
        attn = layer.self_attn
        return attention_layer(
            layer=attn.kv_index,
            heads=attn.heads,
            kv_heads=attn.kv_heads,
            head_dim=attn.head_dim,
            eps=layer.input_layernorm.eps,
            scale=attn.scale,
            norms=(*norms, attn.q_norm.weight, attn.k_norm.weight),
            operands={"qkv": attn.qkv, "o": attn.o, **tail},
            qkv_bias=attn.qkv_bias,
            moe=moe,
            dtype=dtype,
        )
    gdn = layer.linear_attn
    if gdn.interleaved:
        return None
    return gdn_layer(
        slot=gdn.gdn_index,
        k_heads=gdn.k_heads,
        v_heads=gdn.v_heads,
        key_dim=gdn.dk,
        value_dim=gdn.dv,
        eps=gdn.eps,
        norms=norms,
        conv_weight=gdn.conv1d.weight[:, 0],
        a_log=gdn.A_log,
        dt_bias=gdn.dt_bias,
        norm=gdn.norm.weight,
        out_heads=gdn.out_heads,
        operands={"inp": gdn.inp, "out": gdn.out, **tail},
        moe=moe,
        dtype=dtype,
    )


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


# the HybridCache tensors a C++ GDN layer reads and writes, in GDNLayer.forward's order
_STATE = ("conv", "ssm", "cp_inputs", "cp_k", "cp_d", "cp_g")


class HybridLM(HeadLogits, OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("head",)

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
        self.head: Weight = self.lm_head.weight.detach()  # GEMM operand, as in GatedAttention
        self.vocab: VocabSubset | None = None  # as a draft model, a restricted vocabulary
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
        # every layer as a C++ GDNLayer / HybridAttentionLayer once built (`_fused_layers`);
        # False: they cannot be
        self._fused: list[Any] | bool | None = None

    def pack_(self) -> None:
        """bf16 projection operands -> PanelWeight (see CausalLM.pack_); routed MoE experts
        stay as they are (their kernel indexes stacked expert weights)."""
        convert_operands_(self, to_panels)
        self._fused = None

    def _fused_layers(self) -> list[Any] | None:
        """Every layer as a C++ GDNLayer or HybridAttentionLayer (kernels/hybrid_layer.py),
        or None when the kernels are off or some layer cannot run there. Built on first use
        after loading or `pack_`."""
        if self._fused is None:
            typed: list[HybridDecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
            layers = [
                fused_layer(layer, self.dtype) if self.device.type == "cpu" else None
                for layer in typed
            ]
            self._fused = False if any(f is None for f in layers) else layers
        return self._fused if isinstance(self._fused, list) else None

    def quantize_(self, fmt: str) -> None:
        """Integer operands are for dense draft models (CausalLM.quantize_)."""
        raise ValueError(f"{fmt} weights are supported for dense models only, not HybridLM")

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
        hidden_layers: Sequence[int] = (),  # layers whose outputs to return (ForwardOutput)
        images: ImageRows | None = None,  # image rows and M-RoPE positions (Qwen3.5 only)
    ) -> ForwardOutput:
        assert input_ids.dim() == 1 and sum(num_new) == input_ids.shape[0]
        cfg = self.config
        positions = packed_positions(caches, num_new, cfg.max_position_embeddings, self.device)
        x, rope = self.rope.with_images(  # [N, hidden], the rope tables
            self.model.embed_tokens(input_ids), positions, images, cfg.mrope_section, self.dtype
        )
        wanted = set(hidden_layers)
        taps: dict[int, Tensor] = {}  # layer -> its output [N, hidden]
        # a decode step or a verify (every token's checkpoint kept): the layers' C++ calls
        steps = all(isinstance(c, HybridCache) and c.keeps_checkpoints for c in caches)
        fused = self._fused_layers() if steps else None
        if fused is not None:
            counts, slots = list(num_new), [c.committed for c in caches]
            state = [[getattr(c, name) for c in caches] for name in _STATE]
            kv = many_args([c.kv for c in caches], num_new)
            cos, sin = rope[0][:, 0], rope[1][:, 0]
        for i, layer in enumerate(self.model.layers):
            if fused is None:
                x = layer(x, rope, caches, num_new)
            elif layer.layer_type != "linear_attention":
                x = fused[i].forward(x, cos, sin, *kv)
            else:
                gdn = fused[i].slot  # its HybridCache slot
                pending = [c.pending[gdn] for c in caches]
                x = fused[i].forward(x, counts, state[0], state[1], slots, pending, *state[2:])
                for c in caches:
                    c.pending[gdn] = 0  # applied (HybridCache.gdn_state_deferred)
            if i in wanted:
                taps[i] = x
        layers = tapped_layers(taps, hidden_layers, len(self.model.layers), self.model.norm)
        return self.head_outputs(x, self.model.norm, num_new, logit_rows, return_hidden, layers)
