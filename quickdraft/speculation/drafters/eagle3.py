"""EAGLE-3 drafter: a head as vLLM, SGLang and llama.cpp users bring it (models/heads/eagle3.py)
chains k drafts from the target's tapped residual stream, one head forward per draft.

The bookkeeping is the MTP drafter's (drafters/mtp.py): per request the head's KV of rows run
with the target's taps, and the taps of committed positions not run yet. The differences:
  - the engine hands over the tapped layers' outputs (`hidden_layers` = each tap's layer - 1,
    since a tap is the INPUT of its layer), concatenated low, mid, high;
  - `target_rows` fuses every job's queued taps into the head's width in ONE packed fc GEMM
    (input_norm first with `norm_before_fc`) before the catch-up forward;
  - a chained step feeds back the head's pre-norm output (post-norm with `norm_output`);
  - logits are over the head's draft vocabulary (`d2t`), widened to the target's with -inf.
Prefix cache, grammar and penalties, batching and image turns come with the MTP drafter.

Where a head comes from (`load_eagle3`): a directory with config.json and safetensors (or a
weights-only `pytorch_model.bin`), or a llama.cpp `eagle3` GGUF file (or a directory holding one).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor

from quickdraft.hub.convert import unpermute_rows
from quickdraft.kernels.gemm import Weight, panels_apply
from quickdraft.models.base import LanguageModel, module_of
from quickdraft.models.formats.loader import fill_weights
from quickdraft.models.heads.draft_vocab import (
    D2T,
    DraftVocab,
    check_declared,
    draft_ids,
    first_ids,
)
from quickdraft.models.heads.eagle3 import Eagle3Config, Eagle3Head
from quickdraft.speculation.drafters.mtp import MTPDrafter

_SKIPPED = ("t2d",)  # t2d (target -> draft membership) is implied by d2t

log = logging.getLogger(__name__)


class HeadTensors:
    """A head checkpoint's tensors by name (Hugging Face names), each read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._where: dict[str, str] = {}  # tensor name -> the file it is in
        self._read: dict[str, Callable[[], Tensor]] = {}
        self._canonical: dict[str, str] = {}  # the file's own name -> ours

    @classmethod
    def from_dir(cls, path: Path) -> HeadTensors:
        """safetensors files, else a weights-only pytorch_model.bin."""
        self = cls(path)
        files = sorted(path.glob("*.safetensors"))
        if files:
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        self._add(name, file, partial(_safetensor, file, name))
        elif (path / "pytorch_model.bin").is_file():
            file = path / "pytorch_model.bin"
            try:  # weights only: the restricted unpickler refuses any code object
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # any failure of the restricted unpickler
                raise ValueError(f"{file}: not a weights-only checkpoint ({e})") from None
            if not isinstance(state, dict):
                raise ValueError(f"{file}: holds a {type(state).__name__}, not a state dict")
            for name, t in state.items():
                if not isinstance(t, Tensor):
                    raise ValueError(f"{file}: entry {name!r} is not a tensor")
                self._add(name, file, partial(_same, t))
        else:
            raise ValueError(
                f"{path}: no *.safetensors or pytorch_model.bin with the head's weights"
            )
        return self

    @classmethod
    def from_gguf(cls, file: Path) -> tuple[HeadTensors, Eagle3Config]:
        """llama.cpp's `eagle3` GGUF: its tensors under Hugging Face names (q/k rows
        unpermuted, any block format dequantized), and its config from the metadata."""
        from quickdraft.hub.gguf_read import read_gguf

        reader = read_gguf(file)
        field = reader.fields.get("general.architecture")
        arch = None if field is None else str(field.contents())
        if arch != "eagle3":
            raise ValueError(f"{file}: GGUF architecture {arch!r}, not an EAGLE-3 head (eagle3)")

        def meta(key: str) -> Any:
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        cfg = Eagle3Config.from_gguf(file, meta)
        lc = cfg.layers
        heads = {"attn_q": lc.num_attention_heads, "attn_k": lc.num_key_value_heads}
        self = cls(file.parent)
        for t in reader.tensors:
            name, rows = _GGUF_NAMES.get(t.name, t.name), 0
            parts = t.name.split(".")
            if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER:
                if parts[2] == "rope_freqs":
                    raise ValueError(
                        f"{file}: {t.name}: scaled RoPE (Llama 3.1's) is not supported"
                    )
                name, rows = (
                    f"layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{parts[3]}",
                    heads.get(parts[2], 0),
                )
            self._add(t.name, file, partial(_gguf_tensor, t, rows), name)
        return self, cfg

    def _add(self, original: str, file: Path, read: Callable[[], Tensor], name: str = "") -> None:
        """Tensor `original` of `file`, under `name` (default: its Hugging Face name)."""
        if not name:
            name = original.removeprefix("model.")
            if name.startswith("midlayer."):  # the EAGLE repo's / SpecForge's one layer
                name = "layers.0." + name.removeprefix("midlayer.")
        self._where[name], self._read[name] = str(file), read
        self._canonical[original] = name

    def __contains__(self, name: str) -> bool:
        return name in self._read

    def get(self, name: str) -> Tensor:
        return self._read[name]()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def where(self, name: str) -> str:
        return self._where[name]

    def entries(self) -> Iterator[tuple[str, str, Callable[[], Tensor]]]:
        """(file, the file's own tensor name, its read), for `fill_weights` with `names`."""
        for original, name in self._canonical.items():
            yield self._where[name], original, self._read[name]

    def names(self, skip: set[str]) -> Callable[[str], tuple[str, tuple[()]] | None]:
        """The file's tensor names -> the head's parameter names (None: not a parameter)."""

        def name_of(original: str) -> tuple[str, tuple[()]] | None:
            name = self._canonical[original]
            return None if name in skip else (name, ())

        return name_of


# llama.cpp's eagle3 tensor names -> the Hugging Face ones (models/heads/eagle3.py's parameters)
_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "enc.output_norm.weight": "input_norm.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_norm_2": "hidden_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "rope_freqs": "rope_freqs",
}


def _gguf_tensor(t: Any, heads: int) -> Tensor:
    """A GGUF tensor as fp32 (d2t as int64), q/k rows unpermuted when `heads` > 0."""
    from gguf import GGMLQuantizationType

    from quickdraft.hub.gguf_read import gguf_fp32

    if t.tensor_type == GGMLQuantizationType.I64:
        return torch.from_numpy(np.array(t.data, dtype=np.int64)).reshape(-1)
    w = gguf_fp32(t)
    return unpermute_rows(w, heads) if heads else w


def _same(t: Tensor) -> Tensor:
    return t


def _safetensor(file: Path, name: str) -> Tensor:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return f.get_tensor(name)


def load_eagle3(
    model: LanguageModel,
    path: str | Path,
    quantization: str = "none",
    keep: int = 0,
    extra: Sequence[int] = (),
) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The EAGLE-3 head at `path` for target `model`, and the target layers it taps; a clear
    error naming the file and field for a head made for another target or a layout not ours.
    `keep` > 0 (`--draft-vocab`): a head that scores the whole vocabulary with the target's
    head scores only ids [0, keep) and `extra` (a head with its own draft vocabulary or its
    own lm_head keeps what it has)."""
    target = module_of(model)
    shape: Any = target.config
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such EAGLE-3 head (file or directory)")
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else [path]
    if path.suffix == ".gguf" or (not (path / "config.json").is_file() and len(ggufs) == 1):
        tensors, cfg = HeadTensors.from_gguf(ggufs[0])
    elif (path / "config.json").is_file():
        cfg = Eagle3Config.from_dir(path, json.loads((path / "config.json").read_text()))
        tensors = HeadTensors.from_dir(path)
    else:
        raise ValueError(
            f"{path}: not an EAGLE-3 head (a directory with config.json and safetensors, or "
            "llama.cpp's eagle3 GGUF)"
        )
    taps = cfg.taps(shape.num_hidden_layers)
    h, vocab = cfg.layers.hidden_size, shape.vocab_size
    if cfg.target_hidden_size != shape.hidden_size:
        raise ValueError(
            f"{cfg.source}: target_hidden_size {cfg.target_hidden_size} (the hidden_size when "
            f"absent): the head was made for another target; this one has {shape.hidden_size}"
        )
    if cfg.layers.vocab_size not in (0, vocab):  # 0: a GGUF that does not say
        raise ValueError(
            f"{cfg.source}: vocab_size {cfg.layers.vocab_size}, the target's is {vocab}: "
            "the head was made for another tokenizer"
        )
    if "fc.weight" not in tensors:
        raise ValueError(f"{path}: no fc.weight (the fusion of the target's taps)")
    want = (h, len(taps) * shape.hidden_size)
    if tensors.shape("fc.weight") != want:
        raise ValueError(
            f"{tensors.where('fc.weight')}: fc.weight has shape {tensors.shape('fc.weight')}, "
            f"{len(taps)} taps {list(taps)} of this target need {want}"
        )
    ids = None
    if D2T in tensors:
        ids = draft_ids(tensors.get(D2T), vocab, tensors.where(D2T))
        check_declared(Path(cfg.source), cfg.draft_vocab_size, ids)
    elif cfg.draft_vocab_size is not None and cfg.draft_vocab_size != vocab:
        raise ValueError(
            f"{path}: draft_vocab_size {cfg.draft_vocab_size} but no d2t tensor mapping the "
            "draft vocabulary onto the target's"
        )
    own_embed = "embed_tokens.weight" in tensors
    own_head = "lm_head.weight" in tensors
    if h != shape.hidden_size and not (own_embed and own_head):
        raise ValueError(
            f"{path}: a head {h} wide for a {shape.hidden_size}-wide target needs its own "
            "embed_tokens.weight and lm_head.weight"
        )
    if ids is None and 0 < keep < vocab:
        if own_head:
            log.warning("%s: --draft-vocab ignored: the head has its own lm_head", path)
        else:
            ids = first_ids(keep, vocab, extra)
    embed = None if own_embed else target.get_submodule("model.embed_tokens")
    quantized = quantization if quantization in ("int8", "int4") else None
    lm_head: Weight | None = None
    if not own_head:  # the target's head, or its rows of the draft vocabulary
        shared = cast(Weight, target.head)
        rows = None if ids is None else DraftVocab(shared, ids, model.dtype, quantized).weight
        lm_head = shared if rows is None else rows
    head = Eagle3Head(cfg, len(taps), embed, lm_head, ids, vocab, model.dtype, model.device)
    fill_weights(head, tensors.entries(), tensors.names({D2T, *_SKIPPED}))
    if quantized is not None:  # a draft's precision only moves its acceptance
        head.quantize_(quantized)
    elif panels_apply(model.dtype, model.device):  # as `loading.load` packs the target
        head.pack_()
    return head, taps


class Eagle3Drafter(MTPDrafter):
    """The MTP drafter over an EAGLE-3 head (module docstring)."""

    def __init__(self, head: Eagle3Head, taps: tuple[int, ...]) -> None:
        super().__init__(head, None, "post_norm" if head.cfg.norm_output else "pre_norm")
        # the engine hands over layer outputs; a tap is the input of its layer
        self.hidden_layers = tuple(t - 1 for t in taps)

    @property
    def eagle(self) -> Eagle3Head:
        """The head, typed (the MTP drafter holds it as a ChainHead)."""
        return cast(Eagle3Head, self.head)

    def target_rows(self, rows: list[Tensor]) -> list[Tensor]:
        counts = [r.shape[0] for r in rows]
        fused = self.eagle.fuse(torch.cat(rows) if len(rows) > 1 else rows[0])  # [sum, H]
        return list(fused.split(counts))


def eagle3_drafter(
    model: LanguageModel,
    path: str | Path,
    quantization: str = "none",
    keep: int = 0,
    extra: Sequence[int] = (),
) -> Eagle3Drafter:
    """The drafter for target `model` from the EAGLE-3 head at `path` (`keep`, `extra`: as
    load_eagle3)."""
    return Eagle3Drafter(*load_eagle3(model, path, quantization, keep, extra))
