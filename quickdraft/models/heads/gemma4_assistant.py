"""The Gemma 4 assistant (Hugging Face `gemma4_assistant`, Gemma4AssistantForCausalLM): the
small drafter Gemma 4 ships for its targets, run by speculation/drafters/assistant.py.

Stage: a draft head. It has no KV of its own: every layer is a Gemma 4 decoder layer whose
attention has only queries, and attends to the KV the target already holds, of the target's
last local and last global layer that compute KV (`Gemma4Config.store_layer`). A step reads,
per sequence with L committed KV rows, the target's embedding of the last committed token
(position L, not yet through the target) joined with a hidden state `[2 * backbone]`
(projected to the assistant's width), runs at position L, and its query sees the target's keys
[0, L) (a local layer the last `sliding_window` + 1 of them: transformers' bidirectional
window, distance <= W, flipped to look back). It returns the logits of the next
token and its final hidden projected back to the target's width, which the next chained step
reads with the embedding of the token it drafted, at the same position over the same KV: the
first step's hidden is the target's post-norm hidden of position L - 1 (transformers'
Gemma4AssistantCandidateGenerator; after a rejection that generator also shows the assistant
the target's KV row of the rejected draft at position L, which is not the target's state: we
show [0, L) always, what it shows after the prompt and after a fully accepted draft).
The head: the assistant's (tied) lm_head, or with `use_ordered_embeddings` a centroid mask:
`centroids` scores `num_centroids` token clusters (`token_ordering` lists each cluster's
ids), only the top `centroid_intermediate_top_k` clusters' tokens are scored by the lm_head and
every other token gets the row's least such logit minus 1 (HF's, per row).
Checkpoints: a Hugging Face directory, or llama.cpp's `gemma4-assistant` GGUF (hub/gguf_gemma4.py
`assistant_plan`; its converter drops the centroid mask, so the whole vocabulary is scored).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from quickdraft.config import read_hf_config
from quickdraft.hub.convert import assistant_config
from quickdraft.hub.gguf_gemma4 import ASSISTANT_ARCH, assistant_plan
from quickdraft.hub.gguf_read import gguf_architecture, gguf_fp32, read_gguf
from quickdraft.kernels.gemm import panels_apply, project, to_panels
from quickdraft.models.caches.kv_cache import GroupedKVCache
from quickdraft.models.families.gemma4 import (
    DecoderLayer,
    DecoderModel,
    Gemma4LM,
    Matrix,
    fused_layer,
    quantizer,
    ropes,
)
from quickdraft.models.families.gemma4_config import Gemma4Config
from quickdraft.models.families.llama import Embedding
from quickdraft.models.formats.loader import TensorEntries, fill_weights, load_weights
from quickdraft.models.layers import convert_operands_


@dataclass(frozen=True, slots=True)
class AssistantConfig:
    text: Gemma4Config  # its decoder (kv_sources: the target's store layers)
    backbone_hidden_size: int  # the target's hidden size
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int

    @classmethod
    def from_hf(cls, path: str | Path, target: Gemma4Config) -> AssistantConfig:
        """`path`'s config.json, checked against the target it drafts for (a clear error for
        an assistant of another target)."""
        return cls.from_dict(*read_hf_config(path), target, str(path))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], gen: dict[str, Any], target: Gemma4Config, path: str = ""
    ) -> AssistantConfig:
        """A config.json dict (from `path`, named in errors) checked against the target."""
        if raw.get("model_type") != "gemma4_assistant":
            raise ValueError(f"{path}: model_type {raw.get('model_type')!r}, not gemma4_assistant")
        text = Gemma4Config.from_dict(raw["text_config"], gen)
        sources = tuple(target.store_layer(t) for t in text.layer_types)
        text = dataclasses.replace(text, kv_sources=sources, num_kv_shared_layers=0)
        for i, src in enumerate(sources):
            mine = (text.head_dims[i], text.kv_heads[i])
            theirs = (target.head_dims[src], target.kv_heads[src])
            if mine != theirs:
                raise ValueError(
                    f"{path}: assistant layer {i} ({text.layer_types[i]}) reads KV of head "
                    f"size {mine[0]} over {mine[1]} heads; the target's layer {src} holds "
                    f"{theirs[0]} over {theirs[1]}: an assistant for another model"
                )
        checks = {
            "backbone_hidden_size": (int(raw.get("backbone_hidden_size", 0)), target.hidden_size),
            "vocab_size": (text.vocab_size, target.vocab_size),
            "sliding_window": (text.sliding_window, target.sliding_window),
        }
        for key, (mine_v, theirs_v) in checks.items():
            if mine_v != theirs_v:
                raise ValueError(
                    f"{path}: assistant {key} {mine_v}, the target has {theirs_v}: an "
                    "assistant for another model"
                )
        if text.ple_size or text.moe or text.use_double_wide_mlp:
            raise ValueError(f"{path}: an assistant has no per-layer inputs, experts or wide MLPs")
        return cls(
            text,
            int(raw["backbone_hidden_size"]),
            bool(raw.get("use_ordered_embeddings", False)),
            int(raw.get("num_centroids", 2048)),
            int(raw.get("centroid_intermediate_top_k", 32)),
        )


def _no_target(*args: Any) -> Any:
    raise ValueError("this assistant was built without its target")


def load_assistant(
    target: nn.Module, path: str | Path, quantization: str = "none"
) -> Gemma4Assistant:
    """The assistant at `path` (a checkpoint dir or a gemma4-assistant GGUF) for `target`,
    bound to it; a clear error for a target that is not Gemma 4 or an assistant made for
    another one. `quantization` "int8" / "int4" (CPU kernels): its projections and head in
    that format (as draft models run; the centroid-masked head of the E2B / E4B assistants
    reads its rows by id from `head_rows`, kept as loaded), else bf16 panels on the CPU."""
    if not isinstance(target, Gemma4LM):
        kind = getattr(getattr(target, "config", None), "model_type", type(target).__name__)
        raise ValueError(f"{path}: a Gemma 4 assistant drafts for Gemma 4 targets, not {kind}")
    file = assistant_gguf(path)
    if file is not None:
        cfg, entries = _from_gguf(file, target.config)
        head = Gemma4Assistant(cfg, target.dtype, target.device, target)
        fill_weights(head, entries)
    else:
        cfg = AssistantConfig.from_hf(path, target.config)
        head = Gemma4Assistant(cfg, target.dtype, target.device, target)
        load_weights(head, sorted(Path(path).glob("*.safetensors")))
    convert = quantizer(quantization)
    if convert is not None:
        convert_operands_(head, convert)
    elif panels_apply(head.dtype, head.device):
        convert_operands_(head, to_panels)
    return head


def _from_gguf(file: Path, target: Gemma4Config) -> tuple[AssistantConfig, TensorEntries]:
    """A llama.cpp gemma4-assistant GGUF's config (checked against `target`) and its tensors
    under HF names, dequantized to fp32 as they are read (a drafter of ~80M weights: its
    projections then take the draft format, as a Hugging Face assistant's do)."""
    reader = read_gguf(file)
    text, backbone = assistant_config(reader)
    raw = {
        "model_type": "gemma4_assistant",
        "text_config": text,
        "backbone_hidden_size": backbone,
        "use_ordered_embeddings": False,  # llama.cpp scores the whole vocabulary
    }
    cfg = AssistantConfig.from_dict(raw, {}, target, str(file))
    tensors = {t.name: t for t in reader.tensors}
    shapes = {n: tuple(int(d) for d in reversed(t.shape)) for n, t in tensors.items()}
    if "output.weight" in shapes:
        raise ValueError(
            f"{file}: has output.weight, but a gemma4-assistant's head is its token_embd "
            "(llama.cpp ties them): not a file its converter wrote"
        )
    plan = assistant_plan(shapes, text, backbone)

    entries = [
        (
            file.name,
            item.name,
            partial(lambda it: it.build([gguf_fp32(tensors[n]) for n in it.sources]), item),
        )
        for item in plan
    ]
    return cfg, entries


def assistant_gguf(path: str | Path) -> Path | None:
    """The llama.cpp `gemma4-assistant` GGUF at `path` (the file, or a directory holding one
    and no config.json), else None."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file() or len(files) != 1:
            return None
        path = files[0]
    if path.suffix != ".gguf" or not path.is_file():
        return None
    return path if gguf_architecture(path) == ASSISTANT_ARCH else None


def is_assistant_dir(path: str | Path) -> bool:
    """Whether `path` is a Gemma 4 assistant: a checkpoint directory or llama.cpp's GGUF."""
    config = Path(path) / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("model_type") == "gemma4_assistant"
    return assistant_gguf(path) is not None


class MaskedEmbedding(nn.Module):
    def __init__(self, cfg: AssistantConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        vocab = cfg.text.vocab_size
        if vocab % cfg.num_centroids:
            raise ValueError(f"vocab {vocab} is not a multiple of {cfg.num_centroids} centroids")
        self.top_k, self.num_centroids = cfg.centroid_top_k, cfg.num_centroids
        self.centroids = Matrix(cfg.num_centroids, cfg.text.hidden_size, dtype, device)
        self.token_ordering = nn.Parameter(
            torch.zeros(vocab, dtype=torch.int64, device=device), requires_grad=False
        )

    def logits(self, h: Tensor, head: Tensor) -> Tensor:
        """h [B, H] final-norm rows -> [B, vocab] fp32: the chosen clusters' tokens scored by
        `head` [vocab, H] (rows in the model dtype), every other token the row's least such
        logit minus 1."""
        clusters = self.token_ordering.view(self.num_centroids, -1)
        top = torch.topk(self.centroids(h), self.top_k, dim=-1).indices
        out = []
        for row, chosen in zip(h, top, strict=True):
            ids = clusters[chosen].reshape(-1)  # [top_k * tokens per cluster]
            scores = project(row[None], head[ids])[0].float()
            full = scores.new_full((head.shape[0],), float(scores.min()) - 1.0)
            out.append(full.index_copy_(0, ids, scores))
        return torch.stack(out)


class _TargetKV:
    """A target's cache as the assistant's layers read it: its rows [0, L) as the keys of a
    query at position L - 1 (`length`), through `read`. Nothing is written."""

    __slots__ = ("cache", "length")

    def __init__(self, cache: GroupedKVCache, rows: int) -> None:
        self.cache, self.length = cache, rows - 1

    def read(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        return self.cache.read(layer, end)


class Gemma4Assistant(nn.Module):
    """HF's Gemma4AssistantForCausalLM (parameter names alike), bound to its target: the
    target's embedding lookup (`embed_target`) and cache maker (`target_cache`)."""

    def __init__(
        self,
        cfg: AssistantConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        target: Gemma4LM | None = None,
    ):
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = cfg, dtype, device
        # the target's methods, not the module (its parameters stay its own)
        self.embed_target: Callable[[Tensor], Tensor] = target.embed if target else _no_target
        self.target_cache: Callable[[int], GroupedKVCache] = (
            target.new_cache if target else _no_target
        )
        text = cfg.text
        self.hidden_size = cfg.backbone_hidden_size  # what it reads and hands back
        self.vocab_size = text.vocab_size
        self.model = DecoderModel(text, dtype, device)
        self.decoder_layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        for layer in self.decoder_layers:  # transformers' bidirectional window: distance <= W
            if layer.sliding:
                layer.self_attn.window = text.sliding_window + 1
        self.lm_head = Matrix(text.vocab_size, text.hidden_size, dtype, device)
        if text.tie_word_embeddings:
            assert isinstance(self.model.embed_tokens, Embedding)
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.op = self.lm_head.weight.detach()
        # the head's rows as loaded (a view filled by the load), what the centroid mask reads
        # by id whatever form the `lm_head` operand takes
        self.head_rows = self.lm_head.weight.detach()
        self.pre_projection = Matrix(text.hidden_size, 2 * self.hidden_size, dtype, device)
        self.post_projection = Matrix(self.hidden_size, text.hidden_size, dtype, device)
        self.masked_embedding = (
            MaskedEmbedding(cfg, dtype, device) if cfg.use_ordered_embeddings else None
        )
        self.ropes = ropes(text, device)
        self.requires_grad_(False)
        # its layers as C++ Gemma4Layers over the target's KV slots once built
        # (`_fused_layers`, from the first cache it reads); False: they cannot be
        self._fused: list[Any] | bool | None = None
        self._kv_groups: list[int] = []  # per layer, the target cache group it reads

    def _fused_layers(self, cache: GroupedKVCache) -> list[Any] | None:
        """Every layer as a C++ Gemma4Layer (kernels/gemma4_layer.py, the Python layers'
        bits) reading its source layer's slot of `cache` (a target cache: every one of the
        target's has the same slots), or None where some layer cannot run there."""
        if self._fused is None:
            where = [cache.slots[layer.self_attn.source] for layer in self.decoder_layers]
            layers = [
                fused_layer(layer, slot, self.dtype) if self.device.type == "cpu" else None
                for layer, (_, slot) in zip(self.decoder_layers, where, strict=True)
            ]
            self._kv_groups = [g for g, _ in where]
            self._fused = False if any(f is None for f in layers) else layers
        return self._fused if isinstance(self._fused, list) else None

    @torch.inference_mode()
    def forward(
        self,
        embeds: Tensor,  # [B, backbone] the target's embedding of each sequence's token
        hidden: Tensor,  # [B, backbone] the hidden state each row reads
        caches: list[GroupedKVCache],  # the target's caches
        rows: list[int],  # per sequence, the target KV rows its query sees: [0, L)
    ) -> tuple[Tensor, Tensor]:
        """-> (logits [B, vocab] fp32, the hidden to chain [B, backbone])."""
        x = torch.cat([embeds.to(self.dtype), hidden.to(self.dtype)], -1)  # [B, 2 backbone]
        x = self.pre_projection(x)
        positions = torch.tensor(rows, device=self.device)
        ropes = {local: r.tables(positions, self.dtype) for local, r in self.ropes.items()}
        views: Any = [_TargetKV(c, n) for c, n in zip(caches, rows, strict=True)]
        ones = [1] * len(rows)
        fused = self._fused_layers(caches[0]) if caches else None
        if fused is not None:  # each query at position L - 1 over the target's rows [0, L)
            starts = [n - 1 for n in rows]
            tables = {local: (cos[:, 0], sin[:, 0]) for local, (cos, sin) in ropes.items()}
            kv = {
                g: ([c.groups[g].k for c in caches], [c.groups[g].v for c in caches])
                for g in set(self._kv_groups)
            }
        for i, layer in enumerate(self.decoder_layers):
            if fused is None:
                x = layer(x, None, ropes[layer.sliding], views, ones)
            else:
                cos, sin = tables[layer.sliding]
                ks, vs = kv[self._kv_groups[i]]
                x = fused[i].forward(x, None, cos, sin, ks, vs, starts, ones)
        h = self.model.norm(x)
        if self.masked_embedding is not None:
            logits = self.masked_embedding.logits(h, self.head_rows)
        else:
            logits = self.lm_head(h).float()
        return logits, self.post_projection(h)
