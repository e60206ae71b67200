"""The DFlash block drafter's model (z-lab's `DFlashDraftModel` checkpoints): a few target-width
decoder layers that draft a whole block in one forward from the target's own hidden states.

Stage: the model half of the DFlash drafter (drafters/dflash.py owns the per-request
bookkeeping). Checkpoint layout (config.json + *.safetensors, the public one):
    config    `dflash_config.target_layer_ids` (0-based target layers whose outputs are read;
              default: spread over layers 1 .. L-3), `dflash_config.mask_token_id`,
              `block_size` (top level or in dflash_config; default 16), Qwen3 layer shapes
              (hidden_size = the target's), `layer_types` / `sliding_window` per layer
    tensors   fc.weight [H, len(taps) * H] (no bias), hidden_norm.weight, norm.weight and
              layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
              self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.weight (an optional `model.` prefix
              is dropped; an embed_tokens / lm_head copy is ignored: the target's are used);
              optional `d2t` [V_d] with `draft_vocab_size`: a reduced draft vocabulary
              (models/heads/draft_vocab.py; `DFlashModel.restrict_vocab_` scores only those ids)
No embedding and no lm_head of its own: the block rows are the target's (raw) token embeddings,
the logits the target's lm_head over this model's final norm.

Contract:
  extend_context(hidden [C, len(taps) * H], caches, counts)
        the target's tapped hidden rows of newly committed tokens, packed over requests ->
        ctx = hidden_norm(fc(hidden)); every layer's K/V of ctx (k_norm, RoPE at the row's real
        position; no query, no layer runs on them) appended to each request's ContextCache and
        committed: one context entry per committed token, used only as K/V.
  forward(x [NB, H], caches, sizes, logit_rows, window) -> logits [len(logit_rows), vocab]
        each request's block (its embedded [last committed token, MASK x (B-1)]) at positions
        right after its context: per layer the block's K/V are written past the cache's length
        and its queries attend to the context and the whole block, NON-causal inside it (unless
        the checkpoint says `is_causal`), within the layer's sliding window if it has one and the
        last `window` context entries if window > 0. Nothing is committed: the block's K/V are
        overwritten by the next call, so dropping them is the usual O(1) commit of a length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.config import ModelConfig, read_hf_config
from quickdraft.kernels.gemm import Weight, project, to_panels
from quickdraft.kernels.pointwise import rope as apply_rope
from quickdraft.models.caches.kv_cache import KVCache
from quickdraft.models.families.llama import MLP, Attention
from quickdraft.models.heads.draft_vocab import DraftVocab
from quickdraft.models.layers import (
    LinearView,
    OperandModule,
    RMSNorm,
    Rope,
    convert_operands_,
)

# architectures this module runs; DFlash2 adds per-layer convolutions and a candidate selector
DFLASH_ARCHITECTURES = ("DFlashDraftModel",)


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The public default tap set when a checkpoint names none: `num_draft_layers` layers
    spread evenly over 1 .. L-3 (one layer: the middle one)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    """A DFlash checkpoint's config.json (module docstring): values are read from
    `dflash_config` first, then the top level, as the public code reads them."""

    layers: ModelConfig  # the draft layers' shapes (Qwen3 style: q/k RMSNorm)
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form the context
    block_size: int  # rows of one drafter forward: the last token + block_size - 1 masks
    mask_token_id: int
    windows: tuple[int, ...]  # per draft layer: sliding window (0: full attention)
    causal: bool = False  # the checkpoint's `is_causal`: causal inside the block
    num_target_layers: int | None = None  # the target it was trained for, if it says
    input_embedding_scale: float = 1.0
    draft_vocab_size: int | None = None  # a reduced draft vocabulary's size (tensor `d2t`)

    @classmethod
    def from_dir(cls, path: str | Path) -> DFlashConfig:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json (expected a DFlash drafter checkpoint)")
        return cls.from_dict(read_hf_config(path)[0])

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        archs = raw.get("architectures") or []
        if archs and not set(archs) & set(DFLASH_ARCHITECTURES):
            raise ValueError(
                f"DFlash checkpoint architecture {archs}: only {list(DFLASH_ARCHITECTURES)} is "
                "supported (DFlash2's convolutions and candidate selector are not)"
            )
        extra: dict[str, Any] = raw.get("dflash_config") or {}

        def value(name: str, default: Any = None) -> Any:
            return extra.get(name, raw.get(name, default))

        layers = ModelConfig.from_dict({**raw, "model_type": raw.get("model_type") or "qwen3"})
        layers = dataclasses.replace(layers, qk_norm=True)  # every DFlash layer has q/k norms
        n = layers.num_hidden_layers
        num_target = raw.get("num_target_layers")
        taps = value("target_layer_ids")
        if taps is None:
            if num_target is None:
                raise ValueError(
                    "DFlash config names neither target_layer_ids nor num_target_layers"
                )
            taps = default_target_layers(int(num_target), n)
        mask = value("mask_token_id")
        if mask is None:
            raise ValueError("DFlash config has no mask_token_id (dflash_config.mask_token_id)")
        block = int(value("block_size", 16))
        if block < 2:
            raise ValueError(f"DFlash block_size must be >= 2, got {block}")
        types = raw.get("layer_types") or [
            "sliding_attention"
            if raw.get("use_sliding_window") and i >= int(raw.get("max_window_layers", n))
            else "full_attention"
            for i in range(n)
        ]
        if len(types) != n:
            raise ValueError(f"DFlash config: {len(types)} layer_types for {n} layers")
        window = int(raw.get("sliding_window") or 0)
        return cls(
            layers=layers,
            target_layer_ids=tuple(int(t) for t in taps),
            block_size=block,
            mask_token_id=int(mask),
            windows=tuple(window if t == "sliding_attention" else 0 for t in types),
            causal=bool(raw.get("is_causal", False)),
            num_target_layers=None if num_target is None else int(num_target),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            draft_vocab_size=None
            if raw.get("draft_vocab_size") is None
            else int(raw["draft_vocab_size"]),
        )


class ContextCache(KVCache):
    """One request's context K/V `[layers, kv_heads, capacity, head_dim]`: entry e is the
    committed token at position `start + e` (start > 0 once a context window dropped older ones).
    Commit, rollback and growth are KVCache's."""

    __slots__ = ("start",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0

    @property
    def end(self) -> int:
        """Position after the last committed entry: where the next entry or block goes."""
        return self.start + self.length

    def restart(self, position: int) -> None:
        """Drop every entry; the next one written is the token at `position`."""
        self.start, self.length = position, 0


def block_attention(
    q: Tensor,  # [n, heads, d] the block's queries, at positions first .. first + n - 1
    k: Tensor,  # [kv_heads, S, d] keys at positions key_start .. key_start + S - 1
    v: Tensor,
    first: int,
    key_start: int,
    scale: float,
    window: int = 0,
    causal: bool = False,
) -> Tensor:
    """Grouped-query attention of a block over every key it is given (non-causal), by SDPA;
    `causal` / `window` (a sliding-window layer: |query - key| < window) mask by position.
    -> [n, heads * d]. Query heads sharing a kv head fold into the row dimension, as in
    kernels/attention.py, so the keys are never repeated."""
    n, heads, d = q.shape
    kv_heads, keys = k.shape[0], k.shape[1]
    group = heads // kv_heads
    qg = q.view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, d)
    mask = None
    if causal or window:
        rows = (torch.arange(n, device=q.device) + first).repeat(group)[:, None]
        cols = torch.arange(keys, device=q.device)[None, :] + key_start
        mask = torch.ones(group * n, keys, dtype=torch.bool, device=q.device)
        if causal:
            mask &= cols <= rows
        if window:
            mask &= (rows - cols < window) & (cols - rows < window)
    out = F.scaled_dot_product_attention(qg, k[None], v[None], attn_mask=mask, scale=scale)
    return out[0].view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)


class DFlashAttention(Attention):
    """A dense attention layer's projections and norms (models/families/llama.py `Attention`), run
    as DFlash runs them: k/v only for context rows, a non-causal block over the context."""

    OPERANDS: ClassVar[tuple[str, ...]] = ("qkv", "kv", "o")

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        window: int,
        causal: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(cfg, layer_idx, dtype, device)
        self.window, self.causal = window, causal
        q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # context rows need k and v only: a view of the fused tensor's k/v rows until packed
        self.kv: Weight = self.qkv_weight[q_size:]
        self.kv_bias = None if self.qkv_bias is None else self.qkv_bias[q_size:]

    def context_kv(self, ctx: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Projected context rows [C, H] -> their k (normed, rotated), v `[C, kv_heads, d]`."""
        assert self.k_norm is not None, "DFlash layers have q/k norms"
        n, d = ctx.shape[0], self.head_dim
        kv = project(ctx, self.kv, self.kv_bias)  # [C, 2 * kv_size]
        k = self.k_norm(kv[:, : self.kv_size].view(n, self.num_kv_heads, d))
        v = kv[:, self.kv_size :].view(n, self.num_kv_heads, d)
        return apply_rope(k, rope[0][:, 0], rope[1][:, 0]), v

    def forward(  # type: ignore[override]  # a block over context caches, not causal rows
        self,
        x: Tensor,  # [NB, hidden] the normed block rows of every request
        rope: tuple[Tensor, Tensor],  # cos, sin [NB, 1, head_dim]
        caches: Sequence[ContextCache],
        sizes: Sequence[int],
        window: int,  # context entries a block sees (0: all)
    ) -> Tensor:
        q, k, v = self.rotated_qkv(x, rope)
        outs, start = [], 0
        for cache, count in zip(caches, sizes, strict=True):
            seg = slice(start, start + count)
            keys, values = cache.write(
                self.layer_idx, k[seg].transpose(0, 1), v[seg].transpose(0, 1)
            )  # the whole context + this block, uncommitted
            assert isinstance(keys, Tensor) and isinstance(values, Tensor)  # never imports blocks
            lo = max(0, cache.length - window) if window else 0
            outs.append(
                block_attention(
                    q[seg],
                    keys[:, lo:],
                    values[:, lo:],
                    cache.end,  # the block's first position
                    cache.start + lo,
                    self.scale,
                    self.window,
                    self.causal,
                )
            )
            start += count
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [NB, H * d]
        return project(out, self.o)


class DFlashLayer(nn.Module):
    def __init__(
        self, cfg: DFlashConfig, idx: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        shape = cfg.layers
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype, device)
        self.self_attn = DFlashAttention(shape, idx, cfg.windows[idx], cfg.causal, dtype, device)
        self.post_attention_layernorm = RMSNorm(
            shape.hidden_size, shape.rms_norm_eps, dtype, device
        )
        self.mlp = MLP(shape, dtype, device)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        caches: Sequence[ContextCache],
        sizes: Sequence[int],
        window: int,
    ) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, caches, sizes, window)
        x, h = self.post_attention_layernorm.add_forward(x, attn)
        return x + self.mlp(h)


class DFlashModel(OperandModule):
    OPERANDS: ClassVar[tuple[str, ...]] = ("fc_weight", "lm_head_weight")

    def __init__(
        self,
        cfg: DFlashConfig,
        lm_head_weight: Weight,  # [vocab, H] the target's GEMM operand
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = cfg.layers
        self.cfg, self.dtype, self.device = cfg, dtype, device
        size, taps = shape.hidden_size, len(cfg.target_layer_ids)
        self.fc = LinearView(torch.empty(size, taps * size, dtype=dtype, device=device), None)
        self.fc_weight: Weight = self.fc.weight.detach()  # GEMM operand (until packed)
        self.hidden_norm = RMSNorm(size, shape.rms_norm_eps, dtype, device)
        self.layers = nn.ModuleList(
            DFlashLayer(cfg, i, dtype, device) for i in range(shape.num_hidden_layers)
        )
        # the same modules, typed (ModuleList items are plain nn.Modules to a type checker)
        self.decoder_layers: list[DFlashLayer] = list(self.layers)  # type: ignore[arg-type]
        self.norm = RMSNorm(size, shape.rms_norm_eps, dtype, device)
        self.rope = Rope(shape.head_dim, shape.rope_theta, device)
        # the target's storage, shared: not a parameter of the drafter
        self.lm_head_weight = (
            lm_head_weight.detach() if isinstance(lm_head_weight, Tensor) else lm_head_weight
        )
        self.vocab_size = lm_head_weight.shape[0]
        self.vocab: DraftVocab | None = None  # the draft vocabulary (restrict_vocab_), if any
        self.requires_grad_(False)

    def restrict_vocab_(self, ids: Tensor) -> None:
        """Score only token ids `ids` [V_d] (a checkpoint's reduced draft vocabulary): the head
        becomes those rows of the target's, dequantized to the model dtype (and packed when the
        target's head runs a kernel operand); every other id's logit is -inf. Call after
        `pack_`."""
        self.vocab = DraftVocab(self.lm_head_weight, ids, self.dtype)
        self.lm_head_weight = self.vocab.weight

    def pack_(self) -> None:
        """bf16 operands -> PanelWeight, as the target's `pack_` (a packed target head is
        shared as it is)."""
        convert_operands_(self, to_panels)

    def new_cache(self, capacity: int) -> ContextCache:
        shape = self.cfg.layers
        return ContextCache(
            shape.num_hidden_layers,
            shape.num_key_value_heads,
            shape.head_dim,
            capacity,
            self.dtype,
            self.device,
        )

    def _positions(self, caches: Sequence[ContextCache], counts: Sequence[int]) -> Tensor:
        for cache, n in zip(caches, counts, strict=True):
            cache.reserve(n)
        return torch.cat(
            [
                torch.arange(c.end, c.end + n, device=self.device)
                for c, n in zip(caches, counts, strict=True)
            ]
        )

    @torch.inference_mode()
    def extend_context(
        self,
        hidden: Tensor,  # [C, len(taps) * H] target tap rows, packed in `caches` order
        caches: Sequence[ContextCache],
        counts: Sequence[int],  # rows per request; sums to C
    ) -> None:
        """Append (and commit) the context entries of the rows (module docstring)."""
        ctx = self.hidden_norm(project(hidden.to(self.dtype), self.fc_weight))  # [C, H]
        rope = self.rope.tables(self._positions(caches, counts), self.dtype)
        for i, layer in enumerate(self.decoder_layers):
            k, v = layer.self_attn.context_kv(ctx, rope)
            start = 0
            for cache, n in zip(caches, counts, strict=True):
                cache.write(
                    i, k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)
                )
                start += n
        for cache, n in zip(caches, counts, strict=True):
            cache.commit(cache.length + n)

    @torch.inference_mode()
    def forward(
        self,
        x: Tensor,  # [NB, H] the embedded blocks, packed in `caches` order
        caches: Sequence[ContextCache],
        sizes: Sequence[int],  # block rows per request; sums to NB
        logit_rows: Tensor,  # rows of NB to score
        window: int = 0,  # context entries a block sees (0: all)
    ) -> Tensor:
        """-> logits [len(logit_rows), vocab] fp32 (module docstring)."""
        rope = self.rope.tables(self._positions(caches, sizes), self.dtype)
        x = x.to(self.dtype)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        for layer in self.decoder_layers:
            x = layer(x, rope, caches, sizes, window)
        logits = project(self.norm(x[logit_rows]), self.lm_head_weight).float()
        return logits if self.vocab is None else self.vocab.full(logits)
