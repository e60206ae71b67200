"""The multi-token-prediction head (`mtp.*` in Qwen3-Next / Qwen3.5 checkpoints): its module and
the per-family parts it is built from.

Stage: the model half of the MTP drafter (drafters/mtp.py owns the per-request bookkeeping).
Layout (names after the `mtp.` prefix, as the checkpoints store them):
    pre_fc_norm_embedding, pre_fc_norm_hidden   RMSNorms of the target family's convention
    fc                                          Linear(2H -> H, no bias)
    layers.0                                    one full-attention decoder layer of the target's
                                                type (MoE where the target is), own KV cache
    norm                                        final RMSNorm
Embedding and lm_head are the target's (shared, not parameters of the head).

A head trained apart from its target (`quickdraft train-drafter --kind mtp`, for a dense target
that ships none) is a directory of its own: model.safetensors holding the `mtp.*` tensors, and
a config.json whose `architectures` is [STANDALONE_ARCHITECTURE], with the target's
`model_type`, `hidden_size` and `vocab_size` and the head's `num_nextn_predict_layers`; with
`d2t` and `draft_vocab_size` it scores a reduced draft vocabulary (models/heads/draft_vocab.py); any
head can be cut to the vocabulary's first ids instead (`keep_first_`, `--draft-vocab`).

Contract: `forward(token_ids [N], hidden [N, H], caches, num_new, logit_rows)` runs the rows
x_i = fc([norm_e(embed(t_{i+1})) ; norm_h(h_i)]) of several requests packed, row i of a request
at its position cache.length + i (ids shifted by one, positions not), through the layer
against each request's own KVCache (written past `length`, committed by the caller, like every
model here), and returns the logits of `logit_rows` plus the layer output before and after
`norm` (the next chained step feeds one of them back as its hidden).
"""

from __future__ import annotations

import json
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
from quickdraft.models.families.hybrid_config import HybridConfig
from quickdraft.models.families.llama import DecoderLayer, many_args, operand_converter
from quickdraft.models.families.qwen3_next import HybridDecoderLayer, OffsetRMSNorm, fused_layer
from quickdraft.models.heads.draft_vocab import DraftVocab
from quickdraft.models.layers import (
    LinearView,
    OperandModule,
    RMSNorm,
    Rope,
    VocabSubset,
    convert_operands_,
    restrict_head,
)

STANDALONE_ARCHITECTURE = "MTPHead"


def standalone_head_config(path: str | Path) -> dict[str, Any] | None:
    """The config.json of a standalone head directory (module docstring); None for any other
    directory (a model's own checkpoint, whose head is described by the model's config)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    raw: dict[str, Any] = json.loads(file.read_text())
    return raw if raw.get("architectures") == [STANDALONE_ARCHITECTURE] else None


@dataclass(frozen=True, slots=True)
class MTPParts:
    """What differs between families: the decoder layer (`forward(x, rope, caches, num_new)`,
    writing its KV at layer index 0 of a one-layer KVCache), its RoPE and the norm class."""

    layer: nn.Module
    rope: Rope
    make_norm: Callable[[], nn.Module]
    num_kv_heads: int
    head_dim: int
    mrope_section: tuple[int, ...] = ()  # a vision-language target's M-RoPE (() = none)


def llama_mtp_parts(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> MTPParts:
    """Dense Llama / Qwen2 / Qwen3 targets: heads trained later for them plug in here."""
    return MTPParts(
        DecoderLayer(cfg, 0, dtype, device),
        Rope(cfg.head_dim, cfg.rope_theta, device),
        lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device),
        cfg.num_key_value_heads,
        cfg.head_dim,
    )


def hybrid_mtp_parts(cfg: HybridConfig, dtype: torch.dtype, device: torch.device) -> MTPParts:
    return MTPParts(
        HybridDecoderLayer(cfg, "full_attention", 0, cfg.num_experts > 0, dtype, device),
        Rope(cfg.rotary_dim, cfg.rope_theta, device),
        lambda: OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device),
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.mrope_section,
    )


class MTPHead(OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("fc_weight", "lm_head_weight")

    def __init__(
        self,
        parts: MTPParts,
        hidden_size: int,
        # the target's embedding lookup, ids [N] -> [N, H] (a GGUF target's dequantizes the
        # rows it reads): called, never a submodule of the head
        embed_tokens: Callable[[Tensor], Tensor],
        lm_head_weight: Weight,  # [vocab, H] the target's GEMM operand
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.dtype, self.device, self.hidden_size = dtype, device, hidden_size
        self.pre_fc_norm_embedding = parts.make_norm()
        self.pre_fc_norm_hidden = parts.make_norm()
        self.fc = LinearView(
            torch.empty(hidden_size, 2 * hidden_size, dtype=dtype, device=device), None
        )
        self.fc_weight: Weight = self.fc.weight.detach()  # GEMM operand (until packed)
        self.layers = nn.ModuleList([parts.layer])
        self.norm = parts.make_norm()
        self.rope = parts.rope
        self.mrope_section = parts.mrope_section
        self.num_kv_heads, self.head_dim = parts.num_kv_heads, parts.head_dim
        # Sharing the target's storage: not parameters of the head.
        self.embed = lambda ids: embed_tokens(ids)
        self.lm_head_weight = (
            lm_head_weight.detach() if isinstance(lm_head_weight, Tensor) else lm_head_weight
        )
        self.vocab_size = lm_head_weight.shape[0]
        # a reduced draft vocabulary (restrict_vocab_ / keep_first_)
        self.vocab: DraftVocab | VocabSubset | None = None
        self.quantized: str | None = None  # "int8" / "int4" after quantize_
        self.requires_grad_(False)
        # its layer as a C++ call (qwen3_next.fused_layer) once built; False: it cannot be
        self._fused: Any = None

    def restrict_vocab_(self, ids: Tensor) -> None:
        """Score only token ids `ids` (a trained head's `d2t`, models/heads/draft_vocab.py): the
        head becomes those rows of the target's, in the format of the head's own operands (after
        `quantize_`: int8 / int4); every other id's logit is -inf. Call after `pack_` or
        `quantize_`."""
        self.vocab = DraftVocab(self.lm_head_weight, ids, self.dtype, self.quantized)
        self.lm_head_weight = self.vocab.weight

    def keep_first_(self, keep: int, extra: Sequence[int] = ()) -> None:
        """Score only the first `keep` token ids and the ids in `extra` (`--draft-vocab`, as a
        draft model's `restrict_vocab_`): the head becomes the target head's first panels in
        their own format (a GGUF head stays in its blocks, so the kept ids' logits are the full
        head's bit for bit), views of the target's (which stays), plus the `extra` rows; every
        other id's logit is -inf. With a 248k-id vocabulary the head is most of a draft step
        (Qwen3.6-35B-A3B: 417 of ~460 MB), so cutting it is what lets a draft step cost a few
        percent of the target's."""
        self.lm_head_weight, self.vocab = restrict_head(
            self.lm_head_weight, keep, extra, self.dtype, copy=False
        )

    def quantize_(self, fmt: str) -> None:
        """The head's own operands (fc, its layer's projections) -> "int8" / "int4" in place
        (llama.operand_converter), instead of `pack_`: a head step reads its weights once, so
        it costs less with fewer bytes. The target's lm_head, shared, stays as it is."""
        convert = operand_converter(fmt)
        if convert is None:
            return
        shared = self.lm_head_weight
        convert_operands_(self, lambda w: w if w is shared else convert(w))
        self.quantized = fmt
        self._fused = None

    def pack_(self) -> None:
        """bf16 operands -> PanelWeight, as the target's `pack_` (a target head that is already
        packed is shared as it is)."""
        convert_operands_(self, to_panels)
        self._fused = None

    def _fused_layer(self) -> Any:
        """The head's layer as one C++ call (kernels/hybrid_layer.py, the Python layer's
        bits), None where it cannot run (operands not in a kernel format, a MoE block that is
        not one call, a head off the CPU). Built on first use after loading or conversion."""
        if self._fused is None:
            layer, kernel = self.layers[0], None
            if self.device.type == "cpu" and isinstance(layer, HybridDecoderLayer):
                kernel = fused_layer(layer, self.dtype)
            self._fused = False if kernel is None else kernel
        return self._fused or None

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(1, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Tensor,  # [N] t_{i+1} of each row
        hidden: Tensor,  # [N, H] h_i of each row (target hidden, or a chained step's output)
        caches: Sequence[KVCache],
        num_new: Sequence[int],
        logit_rows: Tensor,  # rows of N to score
        images: ImageRows | None = None,  # rows whose t_{i+1} is an image's, M-RoPE positions
    ) -> tuple[Tensor, Tensor, Tensor]:
        """-> logits [len(logit_rows), vocab] fp32, output pre-norm [N, H], post-norm [N, H].
        With `images` (a vision-language target) a row whose t_{i+1} is an image row reads
        that row's image embedding, as the target did, and every row its (t, h, w) position."""
        for cache, n in zip(caches, num_new, strict=True):
            cache.reserve(n)
        positions = torch.cat(
            [
                torch.arange(c.length, c.length + n, device=self.device)
                for c, n in zip(caches, num_new, strict=True)
            ]
        )
        emb, rope = self.rope.with_images(
            self.embed(token_ids), positions, images, self.mrope_section, self.dtype
        )
        emb = self.pre_fc_norm_embedding(emb)
        x = project(
            torch.cat([emb, self.pre_fc_norm_hidden(hidden.to(self.dtype))], -1), self.fc_weight
        )
        fused = self._fused_layer()
        if fused is not None:
            cos, sin = rope[0][:, 0], rope[1][:, 0]
            x = fused.forward(x, cos, sin, *many_args(caches, num_new))
        else:
            x = self.layers[0](x, rope, caches, num_new)
        out = self.norm(x)  # [N, H]
        rows = out[logit_rows]
        if self.vocab is not None:
            return self.vocab.logits(rows, self.lm_head_weight), x, out
        return project(rows, self.lm_head_weight).float(), x, out
