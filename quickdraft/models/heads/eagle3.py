"""EAGLE-3 heads as their users bring them: the config of every public layout, and the head.

Stage: the model half of the EAGLE-3 drafter (drafters/eagle3.py owns the per-request
bookkeeping, which is the MTP drafter's). A head reads the residual stream entering a few
target layers ("taps", low / mid / high), fuses them, and chains drafts with one decoder layer:
    g_i      = fc(input_norm?(cat(taps_i)))                 [N, 3 H_t] -> [N, H]
    x_i      = cat(input_layernorm(embed(t_{i+1})), hidden_norm(g_i))         [N, 2 H]
    h        = r + attn(x_i)       r = g_i, or hidden_norm(g_i) with norm_before_residual
    out_i    = h + mlp(post_attention_layernorm(h))   (then any extra plain Llama layers)
    logits   = lm_head(norm(out_i)), over the draft vocabulary (target id = i + d2t[i])
The next chained step takes out_i (pre-norm; `norm_output`: post-norm) as its g, no fc.
Row i pairs the taps of position i with token t_{i+1} at position i, like an MTP head.

Layouts read (`Eagle3Config.from_dir` / `from_gguf`):
  EAGLE repo / SpecForge / AngelSlim   flat Llama config.json with `draft_vocab_size`,
                                       tensors `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`
  vLLM `speculators`                   `speculators_model_type: eagle3`,
                                       `transformer_layer_config`, tensors `layers.0.*`
  llama.cpp `eagle3` GGUF              `eagle3.target_layers` etc., `blk.0.*` (q/k permuted)
Taps (`eagle_aux_hidden_state_layer_ids`, GGUF `target_layers`) name the target layer whose
INPUT is read (vLLM's and llama.cpp's convention); the default is (2, L // 2, L - 3).
Every flag that changes the math is honoured or refused by name (`FLAGS`, `_REFUSED`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from quickdraft.config import ModelConfig
from quickdraft.images import ImageRows
from quickdraft.kernels.gemm import Weight, project, to_panels
from quickdraft.models.caches.kv_cache import KVCache
from quickdraft.models.families.llama import MLP, Attention, DecoderLayer, operand_converter
from quickdraft.models.heads.draft_vocab import widen
from quickdraft.models.layers import LinearView, OperandModule, RMSNorm, Rope, convert_operands_

# architectures naming an EAGLE-3 head in a flat config.json (EAGLE, SpecForge, vLLM, NVIDIA)
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DraftModel")
# flags honoured (config key -> Eagle3Config field)
FLAGS = ("norm_before_residual", "norm_before_fc", "norm_output")
# flags whose math is not ours (yet): refused by name when set
_REFUSED = {
    "fc_norm": "a norm after fc",
    "parallel_drafting": "parallel drafting (mask_hidden rows)",
    "attention_bias": "biased attention projections",
    "mlp_bias": "biased MLP projections",
    "use_sliding_window": "sliding-window attention",
}
# config keys that look like architecture switches but are known not to change the head
_HARMLESS = {
    "use_cache",
    "rms_norm_eps",
    "tie_word_embeddings",
    "embed_requires_grad",
    "use_aux_hidden_state",
    "norm_topk_prob",
}
_FLAG_LIKE = re.compile(r"(^norm_|_norm$|^use_|residual|^fc_|parallel|_bias$)")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    layers: ModelConfig  # the head's decoder layers (Llama): its width, heads, RoPE, depth
    target_hidden_size: int
    draft_vocab_size: int | None  # None: the head scores the target's whole vocabulary
    aux_layer_ids: tuple[int, ...] | None  # target layers whose input is tapped; None: default
    source: str  # the file or directory errors name
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False

    @classmethod
    def from_dir(cls, path: Path, raw: dict[str, Any]) -> Eagle3Config:
        """The config.json `raw` of a head directory `path`, of either Hugging Face layout."""
        where = str(path / "config.json")
        speculators = raw.get("speculators_model_type") is not None
        if speculators:
            if raw["speculators_model_type"] != "eagle3":
                raise ValueError(
                    f"{where}: speculators_model_type {raw['speculators_model_type']!r}, "
                    "not an EAGLE-3 head"
                )
            layer = dict(raw.get("transformer_layer_config") or {})
            if not layer:
                raise ValueError(f"{where}: speculators config without transformer_layer_config")
        else:
            archs = raw.get("architectures") or []
            if not any(a in ARCHITECTURES for a in archs) and "draft_vocab_size" not in raw:
                raise ValueError(
                    f"{where}: not an EAGLE-3 head (architectures {archs}, no draft_vocab_size)"
                )
            layer = raw
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError(
                f"{where}: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2-style head "
                "that reads the last hidden state): only EAGLE-3 heads are supported"
            )
        for scope in (raw,) if layer is raw else (raw, layer):
            _check_flags(scope, where)
        act = layer.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r}: EAGLE-3 heads here use silu")
        key = "eagle_aux_hidden_state_layer_ids"
        ids = raw.get(key, eagle.get(key))
        layers = _layer_config({**layer, "model_type": "llama"}, where)
        draft_vocab = raw.get("draft_vocab_size", layer.get("draft_vocab_size"))

        def flag(name: str) -> bool:
            return bool(raw.get(name, layer.get(name, False)))

        return cls(
            layers=layers,
            target_hidden_size=int(raw.get("target_hidden_size") or layers.hidden_size),
            draft_vocab_size=None if draft_vocab is None else int(draft_vocab),
            aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
            source=where,
            norm_before_residual=flag("norm_before_residual"),
            norm_before_fc=flag("norm_before_fc"),
            norm_output=flag("norm_output"),
        )

    @classmethod
    def from_gguf(cls, file: Path, meta: Callable[[str], Any]) -> Eagle3Config:
        """llama.cpp's `eagle3` GGUF: `meta(key)` reads a metadata value (None if absent)."""

        def get(key: str, default: Any = None) -> Any:
            value = meta(f"eagle3.{key}")
            return default if value is None else value

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        layer = {
            "model_type": "llama",
            "vocab_size": int(get("vocab_size", 0)),
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": int(get("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 4096)),
        }
        ids = get("target_layers")
        if ids is None:
            raise ValueError(f"{file}: EAGLE-3 GGUF without eagle3.target_layers")
        return cls(
            layers=_layer_config(layer, str(file)),
            target_hidden_size=int(get("target_hidden_size", hidden)),
            draft_vocab_size=None,  # the d2t tensor's length, when it has one
            aux_layer_ids=tuple(int(i) for i in ids),
            source=str(file),
            norm_before_residual=bool(get("norm_before_residual", False)),
            norm_before_fc=bool(get("norm_before_fc", False)),
        )

    def taps(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose input the head reads, checked against the target's depth."""
        n = num_target_layers
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else (2, n // 2, n - 3)
        if not ids or not all(1 <= i < n for i in ids):
            raise ValueError(
                f"{self.source}: EAGLE-3 taps {list(ids)} (inputs of target layers) must lie "
                f"in 1 .. {n - 1} for this {n}-layer target"
            )
        return tuple(ids)


def _layer_config(raw: dict[str, Any], where: str) -> ModelConfig:
    """The head's layers as a Llama config; a scaled RoPE (Llama 3.1's) is refused by name."""
    try:
        return ModelConfig.from_dict(raw)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{where}: EAGLE-3 layer config: {e}") from None


def _check_flags(raw: dict[str, Any], where: str) -> None:
    """Refuse a set flag whose math is not ours, and any unknown flag-like key that is set."""
    for key, value in raw.items():
        if key in _REFUSED and value:
            raise ValueError(f"{where}: {key} = {value!r} ({_REFUSED[key]}) is not supported")
        unknown = key not in FLAGS and key not in _HARMLESS and key not in _REFUSED
        if unknown and _FLAG_LIKE.search(key) and value not in (False, None, 0):
            raise ValueError(f"{where}: unknown EAGLE-3 flag {key} = {value!r}")


class Eagle3Layer(nn.Module):
    """The head's first layer: attention over [input_layernorm(embedding), hidden_norm(g)]."""

    def __init__(
        self, cfg: ModelConfig, norm_before_residual: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype, device)
        self.hidden_norm = RMSNorm(h, eps, dtype, device)
        self.self_attn = Attention(cfg, 0, dtype, device, in_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)
        self.norm_before_residual = norm_before_residual

    def forward_residual(
        self,
        emb: Tensor,  # [N, H] token embeddings
        g: Tensor,  # [N, H] fused taps, or the previous chained step's output
        rope: tuple[Tensor, Tensor],
        caches: Sequence[KVCache],
        num_new: Sequence[int],
    ) -> tuple[Tensor, Tensor]:
        """-> (mlp output, residual), as DecoderLayer.forward_residual: the output is their sum."""
        g_norm = self.hidden_norm(g)
        residual = g_norm if self.norm_before_residual else g
        x = torch.cat([self.input_layernorm(emb), g_norm], -1)  # [N, 2H], embeddings first
        attn = self.self_attn(x, rope, caches, num_new)
        residual, x = self.post_attention_layernorm.add_forward(residual, attn)
        return self.mlp(x), residual


class Eagle3Head(OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("fc_weight", "lm_head_weight")

    def __init__(
        self,
        cfg: Eagle3Config,
        num_taps: int,
        # token ids [N] -> [N, H]: the target's embedding, or the head's own (`embed_tokens`)
        embed: Callable[[Tensor], Tensor] | None,
        lm_head: Weight | None,  # the target's head rows it scores; None: its own lm_head
        draft_ids: Tensor | None,  # [V_d] target ids of the logit columns; None: all, in order
        vocab_size: int,  # the target's
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        lc = cfg.layers
        h, width = lc.hidden_size, num_taps * cfg.target_hidden_size
        self.cfg, self.dtype, self.device, self.hidden_size = cfg, dtype, device, h
        self.input_norm = (
            RMSNorm(width, lc.rms_norm_eps, dtype, device) if cfg.norm_before_fc else None
        )
        self.fc = LinearView(torch.empty(h, width, dtype=dtype, device=device), None)
        self.fc_weight: Weight = self.fc.weight.detach()
        first = Eagle3Layer(lc, cfg.norm_before_residual, dtype, device)
        rest = [DecoderLayer(lc, i, dtype, device) for i in range(1, lc.num_hidden_layers)]
        self.layers = nn.ModuleList([first, *rest])
        # the same modules, typed; in lists, so that they are not registered a second time
        self.typed: tuple[list[Eagle3Layer], list[DecoderLayer]] = ([first], rest)
        self.norm = RMSNorm(h, lc.rms_norm_eps, dtype, device)
        self.rope = Rope(lc.head_dim, lc.rope_theta, device)
        self.num_kv_heads, self.head_dim = lc.num_key_value_heads, lc.head_dim
        self.embed_tokens: nn.Module | None = None
        if embed is None:  # the head's own table (a head whose width is not the target's)
            self.embed_tokens = nn.Embedding(vocab_size, h, dtype=dtype, device=device)
            self.embed: Callable[[Tensor], Tensor] = self.embed_tokens
        else:
            self.embed = lambda ids: embed(ids)  # shared with the target, not a submodule
        rows = vocab_size if draft_ids is None else len(draft_ids)
        self.lm_head: LinearView | None = None
        self.shared = lm_head  # the target's own operand: never converted here
        if lm_head is None:
            self.lm_head = LinearView(torch.empty(rows, h, dtype=dtype, device=device), None)
            self.lm_head_weight: Weight = self.lm_head.weight.detach()
        else:
            self.lm_head_weight = lm_head
        self.draft_ids = draft_ids
        self.vocab_size = vocab_size
        self.requires_grad_(False)

    def pack_(self) -> None:
        """bf16 operands -> PanelWeight, as the target's (a shared packed head stays as it is)."""
        convert_operands_(self, to_panels)

    def quantize_(self, fmt: str) -> None:
        """The head's own operands -> "int8" / "int4" (llama.operand_converter); a head shared
        with the target stays as the target holds it."""
        convert = operand_converter(fmt)
        if convert is not None:
            shared = self.shared
            convert_operands_(self, lambda w: w if w is shared else convert(w))

    def new_cache(self, capacity: int) -> KVCache:
        layers = self.cfg.layers.num_hidden_layers
        return KVCache(layers, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def fuse(self, taps: Tensor) -> Tensor:
        """taps [N, num_taps * H_t] (low, mid, high) -> g [N, H]."""
        x = taps.to(self.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return project(x, self.fc_weight)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Tensor,  # [N] t_{i+1} of each row
        g: Tensor,  # [N, H] fused taps (`fuse`) or a chained step's fed-back output
        caches: Sequence[KVCache],
        num_new: Sequence[int],
        logit_rows: Tensor,  # rows of N to score
        images: ImageRows | None = None,  # rows whose t_{i+1} is an image row: its embedding
    ) -> tuple[Tensor, Tensor, Tensor]:
        """-> logits [len(logit_rows), vocab] fp32 (-inf outside the draft vocabulary),
        output pre-norm [N, H], post-norm [N, H]. Positions are the plain ones (a head has
        no M-RoPE); an image row reads the target's embedding of it."""
        for cache, n in zip(caches, num_new, strict=True):
            cache.reserve(n)
        positions = torch.cat(
            [
                torch.arange(c.length, c.length + n, device=self.device)
                for c, n in zip(caches, num_new, strict=True)
            ]
        )
        emb = self.embed(token_ids).to(self.dtype)
        if images is not None:
            emb = emb.index_copy(0, images.rows, images.embeds.to(self.dtype))
        rope = self.rope.tables(positions, self.dtype)
        (first,), rest = self.typed
        h, residual = first.forward_residual(emb, g.to(self.dtype), rope, caches, num_new)
        for layer in rest:
            h, residual = layer.forward_residual(h, residual, rope, caches, num_new)
        pre, post = self.norm.add_forward(residual, h)  # [N, H] each
        logits = project(post[logit_rows], self.lm_head_weight).float()
        if self.draft_ids is not None:
            logits = widen(logits, self.draft_ids, self.vocab_size)
        return logits, pre, post
