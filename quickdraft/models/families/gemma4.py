"""Gemma 4 text decoder (Hugging Face `gemma4_text` / the language model of `gemma4`,
Gemma4ForCausalLM; GGUF `gemma4`): the dense 31B, the 26B-A4B MoE and the small E2B / E4B.

Stage: the target model, with the contract of models/base.py (one packed forward over the new
tokens of several sequences, KV written past `cache.length`, the commit left to the caller).
What differs from Gemma 3 (models/families/gemma3.py):
- local ("sliding_attention") and global layers differ in shape: a global layer's heads are
  `global_head_dim` wide (512) and, where `attention_k_eq_v`, it has fewer KV heads and its
  values are its keys' projection (normed apart); the cache keeps one KVCache per shape
  (models/caches/kv_cache.py `GroupedKVCache`);
- q and k are RMS-normed per head with a weight, v without one; attention is not scaled
  (scale 1); local RoPE is the default one, global RoPE "proportional": the first
  `partial_rotary_factor` of the frequencies (computed over the whole head), the rest 0, so
  those dimensions pass unrotated;
- RMSNorm is y = w * x / rms(x) (not Gemma 3's 1 + w), after attention and the MLP as well as
  before them, and every layer's output is scaled by its `layer_scalar`;
- KV sharing (E2B / E4B): the last `num_kv_shared_layers` layers compute no keys or values
  and attend to those of the last earlier layer of their type (`kv_source`); their MLP may be
  twice as wide (`use_double_wide_mlp`);
- per-layer embeddings (PLE, E2B / E4B): a second table gives every token a small vector per
  layer, mixed with a projection of its embedding; a gated projection of it is added to each
  layer's output;
- MoE layers (26B-A4B): a dense GeGLU MLP and `num_experts` routed GeGLU experts run side by
  side on the same residual and are summed; the router normalises x without a weight, scales
  it by a learned vector / sqrt(hidden), takes a softmax's top k renormalised, times a learned
  per-expert scale;
- the final logits are soft-capped: cap * tanh(logits / cap);
- images (models/families/vision_gemma4.py encodes them): an image row's embedding is the
  tower's, its per-layer input the pad token's; where `two_way_images` (26B-A4B, 31B) the local
  layers let an image's rows see each other both ways (`ImageRows.ends`: a row's keys run to its
  image's end; images.py keeps an image in one forward), the global layers stay causal.
Parameter names are Hugging Face's (`model.language_model.` of the multimodal checkpoints is
mapped onto `model.`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from quickdraft.kernels.attention import attend
from quickdraft.kernels.gemm import Weight, project, to_panels
from quickdraft.kernels.gemma4_layer import gemma4_layer
from quickdraft.kernels.linear_int import Q4_GROUP
from quickdraft.kernels.pointwise import gelu_mul, gelu_tanh_rows, rms_norm
from quickdraft.kernels.pointwise import rope as apply_rope
from quickdraft.models.base import ForwardOutput, ImageRows, packed_positions
from quickdraft.models.caches.kv_cache import GroupedKVCache, kv_slots
from quickdraft.models.families.gemma4_config import FULL, SLIDING, Gemma4Config
from quickdraft.models.families.hybrid_config import NameMap
from quickdraft.models.families.llama import _QUANTIZERS, Embedding, operand_converter
from quickdraft.models.families.moe import Experts
from quickdraft.models.layers import (
    GGUFEmbedding,
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


class Attention(OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("qkv", "o")
    FUSED: ClassVar[tuple[str, ...]] = ("qkv_weight",)

    def __init__(self, cfg: Gemma4Config, idx: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer_idx = idx
        self.source = cfg.kv_source[idx]  # the layer whose KV this one reads
        self.own = self.source == idx and not cfg.kv_sources  # it computes its KV
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.kv_heads[idx]
        self.head_dim = d = cfg.head_dims[idx]
        local = cfg.layer_types[idx] == SLIDING
        self.shares_v = cfg.attention_k_eq_v and not local
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        outs = {"q_proj": q_size}
        if self.own:
            outs["k_proj"] = kv_size
            if not self.shares_v:
                outs["v_proj"] = kv_size
        self.qkv_weight, _ = fused_projections(self, cfg.hidden_size, outs, False, dtype, device)
        self.o_proj = LinearView(
            torch.empty(cfg.hidden_size, q_size, dtype=dtype, device=device), None
        )
        self.qkv: Weight = self.qkv_weight  # GEMM operands (see llama.Attention)
        self.o: Weight = self.o_proj.weight.detach()
        eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(d, eps, dtype, device)
        if self.own:
            self.k_norm = RMSNorm(d, eps, dtype, device)
        self.unit = torch.ones(d, dtype=dtype, device=device)  # v's norm has no weight
        self.eps = eps
        self.window = cfg.sliding_window if local else 0

    def forward(
        self,
        x: Tensor,  # [N, hidden]
        rope: tuple[Tensor, Tensor],  # cos, sin [N, 1, head_dim] of this layer's type
        caches: Sequence[GroupedKVCache],
        num_new: Sequence[int],
        ends: Tensor | None = None,  # [N] key ends of image rows seen both ways (local layers)
    ) -> Tensor:
        n, d, h, hkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = project(x, self.qkv)  # [N, (H [+ Hkv [+ Hkv]]) * d]
        cos, sin = rope[0][:, 0], rope[1][:, 0]
        q = apply_rope(self.q_norm(qkv[:, : h * d].view(n, h, d)), cos, sin)
        own = self.own
        if own:
            k_raw = qkv[:, h * d : (h + hkv) * d].view(n, hkv, d)
            v_raw = k_raw if self.shares_v else qkv[:, (h + hkv) * d :].view(n, hkv, d)
            k = apply_rope(self.k_norm(k_raw), cos, sin)
            v = rms_norm(v_raw, self.unit, self.eps)
        outs, start = [], 0
        for cache, count in zip(caches, num_new, strict=True):
            seg = slice(start, start + count)
            if own:
                keys, values = cache.write(
                    self.layer_idx, k[seg].transpose(0, 1), v[seg].transpose(0, 1)
                )
            else:  # the source layer wrote these rows earlier in this forward
                keys, values = cache.read(self.source, cache.length + count)
            two_way = None if ends is None or not self.window else ends[seg]
            outs.append(attend(q[seg], keys, values, cache.length, 1.0, self.window, ends=two_way))
            start += count
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, H * d]
        return project(out, self.o)


class MLP(OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("gate_up", "down")
    FUSED: ClassVar[tuple[str, ...]] = ("gate_up_weight",)

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.gate_up_weight, _ = fused_projections(
            self, hidden, {"gate_proj": inter, "up_proj": inter}, False, dtype, device
        )
        self.down_proj = LinearView(torch.empty(hidden, inter, dtype=dtype, device=device), None)
        self.gate_up: Weight = self.gate_up_weight
        self.down: Weight = self.down_proj.weight.detach()

    def forward(self, x: Tensor) -> Tensor:
        return project(gelu_mul(project(x, self.gate_up)), self.down)


class Matrix(LinearView, OperandModule):
    """A bias-free projection `[out, in]` under HF's `<name>.weight`, its GEMM operand `op`
    (packed, quantized or a GGUF file's own like every other)."""

    OPERANDS: ClassVar[tuple[str, ...]] = ("op",)

    def __init__(self, out: int, inp: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(torch.empty(out, inp, dtype=dtype, device=device), None)
        self.op: Weight = self.weight.detach()

    def forward(self, x: Tensor) -> Tensor:
        return project(x, self.op)


class Router(nn.Module):
    """HF's Gemma4TextRouter: its parameters and the routing (top-k weights and ids)."""

    def __init__(self, cfg: Gemma4Config, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, num = cfg.hidden_size, cfg.num_experts
        self.top_k, self.eps = cfg.num_experts_per_tok, cfg.rms_norm_eps
        self.proj = Matrix(num, hidden, dtype, device)
        self.scale = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.per_expert_scale = nn.Parameter(torch.ones(num, dtype=dtype, device=device))
        self.unit = torch.ones(hidden, dtype=dtype, device=device)
        self.root = hidden**-0.5

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, hidden] -> (top_weight [N, k] fp32, top_idx [N, k])."""
        xs = rms_norm(x, self.unit, self.eps) * self.scale * self.root
        probs = torch.softmax(self.proj(xs).float(), dim=-1)  # [N, E]
        top_weight, top_idx = torch.topk(probs, self.top_k, dim=-1)
        total = top_weight[:, 0]  # summed in slot order, as every row alone
        for j in range(1, self.top_k):
            total = total + top_weight[:, j]
        return top_weight / total[:, None] * self.per_expert_scale[top_idx].float(), top_idx


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, idx: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps

        def norm(size: int = dim) -> RMSNorm:
            return RMSNorm(size, eps, dtype, device)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, idx, dtype, device)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        wide = cfg.use_double_wide_mlp and idx >= cfg.first_shared
        self.mlp = MLP(dim, cfg.intermediate_size * (2 if wide else 1), dtype, device)
        self.post_feedforward_layernorm = norm()
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype, device=device))
        self.sliding = cfg.layer_types[idx] == SLIDING
        self.moe = cfg.moe
        if cfg.moe:
            self.router = Router(cfg, dtype, device)
            self.experts = Experts(
                cfg.num_experts, dim, cfg.moe_intermediate_size, dtype, device, gelu_mul
            )
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
            self.pre_feedforward_layernorm_2 = norm()
        self.ple = cfg.ple_size > 0
        if self.ple:
            self.per_layer_input_gate = Matrix(cfg.ple_size, dim, dtype, device)
            self.per_layer_projection = Matrix(dim, cfg.ple_size, dtype, device)
            self.post_per_layer_input_norm = norm()

    def forward(
        self,
        h: Tensor,  # [N, hidden] the residual stream
        ple: Tensor | None,  # [N, ple_size] this layer's per-layer input
        rope: tuple[Tensor, Tensor],
        caches: Sequence[GroupedKVCache],
        num_new: Sequence[int],
        ends: Tensor | None = None,
    ) -> Tensor:
        attn = self.self_attn(self.input_layernorm(h), rope, caches, num_new, ends)
        residual, x = self.pre_feedforward_layernorm.add_forward(
            h, self.post_attention_layernorm(attn)
        )
        out = self.mlp(x)
        if self.moe:
            top_weight, top_idx = self.router(residual)
            routed = self.experts(
                self.pre_feedforward_layernorm_2(residual), top_idx, top_weight.to(x.dtype)
            )
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        h = residual + self.post_feedforward_layernorm(out)
        if ple is not None:
            gate = gelu_tanh_rows(self.per_layer_input_gate(h)) * ple
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar


def fused_layer(layer: DecoderLayer, slot: int, dtype: torch.dtype) -> Any:
    """`layer` as the extension's C++ Gemma4Layer (kernels/gemma4_layer.py), or None where it
    cannot run; `slot`: its KV source's slot in that layer's KV group."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = {
        "input": layer.input_layernorm.weight,
        "q": attn.q_norm.weight,
        "unit": attn.unit,
        "post_attention": layer.post_attention_layernorm.weight,
        "pre_feedforward": layer.pre_feedforward_layernorm.weight,
        "post_feedforward": layer.post_feedforward_layernorm.weight,
        "layer_scalar": layer.layer_scalar,
    }
    if attn.own:
        norms["k"] = attn.k_norm.weight
    operands: dict[str, Weight] = {
        "qkv": attn.qkv,
        "o": attn.o,
        "gate_up": mlp.gate_up,
        "down": mlp.down,
    }
    experts, top_k, root = None, 0, 0.0
    if layer.moe:
        router = layer.router
        norms |= {
            "post_feedforward_1": layer.post_feedforward_layernorm_1.weight,
            "post_feedforward_2": layer.post_feedforward_layernorm_2.weight,
            "pre_feedforward_2": layer.pre_feedforward_layernorm_2.weight,
            "router_unit": router.unit,
            "router_scale": router.scale,
            "per_expert_scale": router.per_expert_scale,
        }
        operands["router"] = router.proj.op
        experts, top_k, root = layer.experts.grouped_kernel(), router.top_k, router.root
    if layer.ple:
        norms["post_per_layer_input"] = layer.post_per_layer_input_norm.weight
        operands["ple_gate"] = layer.per_layer_input_gate.op
        operands["ple_projection"] = layer.per_layer_projection.op
    return gemma4_layer(
        slot=slot,
        own=attn.own,
        shares_v=attn.shares_v,
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        window=attn.window,
        eps=attn.eps,
        norms=norms,
        operands=operands,
        experts=experts,
        top_k=top_k,
        router_root=root,
        dtype=dtype,
    )


class DecoderModel(nn.Module):
    """HF's `model.` submodule: embeddings (and per-layer ones), layers, final norm."""

    def __init__(self, cfg: Gemma4Config, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        size, n = cfg.hidden_size, cfg.num_hidden_layers
        # lookups (a GGUF model's stay in the file's blocks: GGUFEmbedding), scaled by
        # sqrt(width) rounded to the model dtype (HF's Gemma4TextScaledWordEmbedding)
        self.embed_tokens: Embedding | GGUFEmbedding = Embedding(
            cfg.vocab_size, size, dtype, device
        )
        self.embed_scale = torch.tensor(size**0.5, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(n))
        self.norm = RMSNorm(size, cfg.rms_norm_eps, dtype, device)
        if cfg.ple_size:
            p = cfg.ple_size
            self.embed_tokens_per_layer: Embedding | GGUFEmbedding = Embedding(
                cfg.ple_vocab, n * p, dtype, device
            )
            self.ple_scale = torch.tensor(p**0.5, dtype=dtype, device=device)
            self.per_layer_model_projection = Matrix(n * p, size, dtype, device)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps, dtype, device)

    def per_layer_inputs(self, ids: Tensor, embeds: Tensor) -> Tensor:
        """[N] ids, [N, hidden] their (scaled) embeddings -> [N, layers, ple_size]: the
        normed projection of the embedding plus the ids' per-layer rows, times 1/sqrt(2)."""
        n, layers = ids.shape[0], len(self.layers)
        proj = self.per_layer_model_projection(embeds) * embeds.shape[1] ** -0.5
        proj = self.per_layer_projection_norm(proj.view(n, layers, -1))
        table = (self.embed_tokens_per_layer(ids) * self.ple_scale).view(n, layers, -1)
        return (proj + table) * 2.0**-0.5


def quantizer(fmt: str) -> Callable[[Weight], Weight] | None:
    """`operand_converter(fmt)` that leaves an operand narrower than an int4 group as it is
    (the per-layer-embedding projections are 256 wide in E2B: tiny, and none in the released
    assistants); None for "none"."""
    convert = operand_converter(fmt)
    if convert is None:
        return None
    full = convert

    def each(w: Weight) -> Weight:
        return w if fmt == "int4" and w.shape[1] % Q4_GROUP else full(w)

    return each


def ropes(cfg: Gemma4Config, device: torch.device) -> dict[bool, Rope]:
    """The RoPE tables by layer kind (True: local): the local layers' default RoPE, the global
    ones' "proportional" RoPE (the frequencies past the rotated share are 0)."""
    global_dim = next(
        (d for d, t in zip(cfg.head_dims, cfg.layer_types, strict=True) if t == FULL),
        cfg.head_dim,
    )
    glob = Rope(global_dim, cfg.rope_theta, device)
    glob.inv_freq[int(cfg.rope_partial * global_dim // 2) :] = 0.0
    return {True: Rope(cfg.head_dim, cfg.rope_local_theta, device), False: glob}


class Gemma4LM(HeadLogits, OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("head",)

    def __init__(self, cfg: Gemma4Config, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = cfg, dtype, device
        self.model = DecoderModel(cfg, dtype, device)
        self.decoder_layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        embed = self.model.embed_tokens
        head: Tensor = (
            embed.weight
            if cfg.tie_word_embeddings and isinstance(embed, Embedding)
            else torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.lm_head = LinearView(head, None)
        self.head: Weight = self.lm_head.weight.detach()
        self.ropes = ropes(cfg, device)
        self.vocab: VocabSubset | None = None  # as a draft model, a restricted vocabulary
        self.requires_grad_(False)
        # every layer's KV slot (group, layer in the group) in its caches, and the group of
        # the KV each layer reads (its own or its source's)
        _, self.kv_slots = kv_slots(self.kv_shapes())
        self.kv_groups = [self.kv_slots[src][0] for src in cfg.kv_source]
        # the layers as C++ Gemma4Layers once built (`_fused_layers`); False: they cannot be
        self._fused: list[Any] | bool | None = None

    def quantize_(self, fmt: str) -> None:
        """GEMM operands -> "int8" / "int4" (see llama.CausalLM.quantize_ and `quantizer`)."""
        if fmt not in _QUANTIZERS:
            raise ValueError(f"unknown weight format {fmt!r}; supported: {', '.join(_QUANTIZERS)}")
        convert = quantizer(fmt)
        assert convert is not None
        convert_operands_(self, convert)
        self._fused = None

    def pack_(self) -> None:
        """bf16 projection operands -> PanelWeight (see llama.CausalLM.pack_)."""
        convert_operands_(self, to_panels)
        self._fused = None

    def _fused_layers(self) -> list[Any] | None:
        """Every layer as a C++ Gemma4Layer (kernels/gemma4_layer.py), or None when the
        kernels are off or some layer cannot run there (operands not yet in a kernel format,
        MoE experts without the grouped kernel). Built on first use after loading, `pack_`
        or `quantize_`."""
        if self._fused is None:
            slots = [self.kv_slots[src] for src in self.config.kv_source]
            layers = [
                fused_layer(layer, slot, self.dtype) if self.device.type == "cpu" else None
                for layer, (_, slot) in zip(self.decoder_layers, slots, strict=True)
            ]
            self._fused = False if any(f is None for f in layers) else layers
        return self._fused if isinstance(self._fused, list) else None

    def kv_shapes(self) -> list[tuple[int, int] | None]:
        """(kv heads, head_dim) of every layer; None for a layer that reads another's KV."""
        cfg = self.config
        return [
            (cfg.kv_heads[i], cfg.head_dims[i]) if src == i else None
            for i, src in enumerate(cfg.kv_source)
        ]

    def new_cache(self, capacity: int) -> GroupedKVCache:
        return GroupedKVCache(self.kv_shapes(), capacity, self.dtype, self.device)

    def embed(self, ids: Tensor) -> Tensor:
        """[N] ids -> [N, hidden] the scaled embeddings (what the assistant drafter reads)."""
        return self.model.embed_tokens(ids) * self.model.embed_scale

    def _logits(self, x: Tensor) -> Tensor:
        logits = HeadLogits._logits(self, x)
        cap = self.config.final_logit_softcapping
        if not cap:
            return logits
        capped = torch.stack([torch.tanh(row / cap) * cap for row in logits.unbind(0)])
        if self.vocab is None:
            return capped
        return capped.masked_fill_(logits == float("-inf"), float("-inf"))  # ids not scored

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,  # [N] new tokens of all sequences, packed in `caches` order
        caches: Sequence[GroupedKVCache],
        num_new: Sequence[int],  # new tokens per sequence; sums to N
        logit_rows: Tensor | None = None,  # rows of N to score; default: last row of each seq
        return_hidden: bool = False,
        hidden_layers: Sequence[int] = (),  # layers whose outputs to return (ForwardOutput)
        images: ImageRows | None = None,
    ) -> ForwardOutput:
        assert input_ids.dim() == 1 and sum(num_new) == input_ids.shape[0]
        cfg = self.config
        positions = packed_positions(caches, num_new, cfg.max_position_embeddings, self.device)
        ropes = {local: r.tables(positions, self.dtype) for local, r in self.ropes.items()}
        h = self.embed(input_ids)  # [N, hidden]
        ple_ids, ends = input_ids, None
        if images is not None and images.rows.numel():  # the tower's rows; per-layer inputs
            h = h.index_copy(0, images.rows, images.embeds.to(h.dtype))  # of the pad token
            ple_ids = input_ids.index_fill(0, images.rows, cfg.pad_token_id)
        if images is not None and cfg.two_way_images:
            ends = images.ends
        ple = self.model.per_layer_inputs(ple_ids, h) if cfg.ple_size else None
        wanted = set(hidden_layers)
        taps: dict[int, Tensor] = {}  # layer -> its output [N, hidden]
        fused = self._fused_layers()
        if fused is not None:  # the C++ layers: each cache's rows from token 0 (imports copy)
            assert not any(g.base for c in caches for g in c.groups)
            counts, starts = list(num_new), [c.length for c in caches]
            tables = {local: (cos[:, 0], sin[:, 0]) for local, (cos, sin) in ropes.items()}
            kv = [
                ([c.groups[g].k for c in caches], [c.groups[g].v for c in caches])
                for g in range(len(caches[0].groups))
            ]
        for i, layer in enumerate(self.decoder_layers):
            p = None if ple is None else ple[:, i]
            if fused is None:
                h = layer(h, p, ropes[layer.sliding], caches, num_new, ends)
            else:
                ks, vs = kv[self.kv_groups[i]]
                cos, sin = tables[layer.sliding]
                h = fused[i].forward(h, p, cos, sin, ks, vs, starts, counts, ends)
            if i in wanted:
                taps[i] = h
        layers = tapped_layers(taps, hidden_layers, len(self.decoder_layers), self.model.norm)
        return self.head_outputs(h, self.model.norm, num_new, logit_rows, return_hidden, layers)


def gemma4_name_map(cfg: Any) -> NameMap:
    """The multimodal checkpoints' `model.language_model.` is our `model.`; their vision and
    audio towers (`model.vision_tower.`, `model.embed_vision.`, ...) are not the decoder's."""
    towers = tuple(f"model.{part}." for part in ("vision_tower", "embed_vision", "audio_tower"))
    towers += ("model.embed_audio.",)

    def target(name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        if name.startswith(towers):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        return name, ()

    return target
