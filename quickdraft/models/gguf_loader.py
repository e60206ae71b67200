"""Load a model whose weights are a GGUF file's own quantized tensors (over 400 lines: the file's
reader, the repack and the packed copy's writer and reader are one loading path). A "gguf"
model directory holds config.json, the tokenizer and `model.gguf`, a link to the file
(hub/convert.py writes it).

Each projection becomes a `GGUFWeight` (kernels/linear_gguf.py): the file's blocks repacked once
into the kernel's panel layout, the same weight values its reference dequantization gives;
fused q/k/v and gate/up operands join tensors of different formats part by part. Norms and
biases are read as they are; the embedding table stays in the mapped file and a lookup
dequantizes only the rows it reads (`GGUFEmbedding`). Unquantized 2-D tensors (F32 / F16 /
BF16) load in the model dtype like any other. A tensor in a format without a kernel here, a
missing tensor or a shape that does not match the config fails with an error that names it.
Qwen3-MoE and the hybrid Qwen3-Next / Qwen3.5 files load through models/gguf_qwen_loader.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quickdraft.hub.convert import (
    GGUF_LINK,
    layer_names,
    norm_shift,
    permutes_qk,
    unpermute_rows,
)
from quickdraft.kernels.gemm import Weight
from quickdraft.kernels.linear_bf16 import streamed_empty
from quickdraft.kernels.linear_gguf import FORMATS, GGUFPart, GGUFWeight
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight
from quickdraft.memory import trim_heap
from quickdraft.models.base import LanguageModel
from quickdraft.models.gemma3 import Gemma3LM
from quickdraft.models.gguf_gpu import runs_on_device, to_device_
from quickdraft.models.layers import GGUFEmbedding, OperandModule, release_fused_
from quickdraft.models.llama import CausalLM, operand_converter
from quickdraft.models.registry import model_class, read_config

log = logging.getLogger(__name__)

_FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFTensorError(ValueError):
    """A GGUF tensor that cannot be loaded: missing, misshapen or in an unsupported type."""


def is_gguf_dir(path: Path) -> bool:
    return (path / GGUF_LINK).is_file()


class GGUFFile:
    """The GGUF's tensors by name, read for one model."""

    def __init__(
        self, path: Path, permute: bool, convert: Callable[[Weight], Weight] | None = None
    ) -> None:
        """`convert`: applied to every operand as it is read (quantize_'s conversion), so the
        model is never whole in the file's formats."""
        from quickdraft.hub.gguf_read import read_gguf

        try:
            self.reader = read_gguf(path)
        except Exception as e:  # the reader raises bare ValueErrors / struct errors
            raise GGUFTensorError(f"{path.name}: not a readable GGUF file ({e})") from e
        self.path = path
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.permute = permute
        self.convert = convert
        # The reader parses the vocabulary into an object per token (~0.5 GB for 151k tokens);
        # the tokenizer was written beside the model when it was converted, and no weight needs
        # it: drop it now, or it stays resident through the whole repack.
        for key in [k for k in self.reader.fields if k.startswith("tokenizer.")]:
            del self.reader.fields[key]
        trim_heap()

    def get(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            raise GGUFTensorError(f"{self.path.name}: lacks tensor {name!r}")
        return t

    def has(self, name: str) -> bool:
        return name in self.tensors

    def rows(
        self, name: str, shape: tuple[int, int], heads: int | np.ndarray = 0
    ) -> tuple[str, np.ndarray]:
        """(type name, rows [N, row_bytes or K]) of a 2-D tensor of `shape` [N, K]; `heads`:
        the heads whose rows to unpermute, or the rows to take, in that order."""
        t = self.get(name)
        got = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else None
        if got != shape:
            raise GGUFTensorError(
                f"{self.path.name}: tensor {name!r} has shape {got}, the config says {shape}"
            )
        rows = np.asarray(t.data).reshape(shape[0], -1)
        if isinstance(heads, np.ndarray):
            return t.tensor_type.name, rows[heads]
        if self.permute and heads:
            rows = unpermute_rows(torch.from_numpy(np.array(rows)), heads).numpy()
        return t.tensor_type.name, rows

    def vector(self, name: str, size: int, heads: int = 0) -> Tensor:
        """A 1-D float tensor (norm weight, bias) as fp32."""
        t = self.get(name)
        if t.tensor_type.name not in _FLOAT_TYPES or int(t.n_elements) != size:
            raise GGUFTensorError(
                f"{self.path.name}: tensor {name!r} is {t.tensor_type.name} with "
                f"{int(t.n_elements)} values; expected {size} float values"
            )
        v = np.asarray(t.data, dtype=np.float32).reshape(size, 1)
        if self.permute and heads:
            v = unpermute_rows(torch.from_numpy(np.array(v)), heads).numpy()
        return torch.from_numpy(v.reshape(size).copy())

    def operand(
        self, parts: Sequence[tuple[str, int, int | np.ndarray]], k: int, dtype: torch.dtype
    ) -> Weight:
        """The rows of `parts` ([(name, rows, `rows`'s heads)]) stacked into one GEMM
        operand [sum rows, k]: a GGUFWeight when every part is in a format with a kernel, a
        dtype tensor when every part is a float type."""
        loaded = [(name, *self.rows(name, (n, k), heads)) for name, n, heads in parts]
        types = {t for _, t, _ in loaded}
        if types <= set(_FLOAT_TYPES):
            rows = [torch.from_numpy(np.array(r, dtype=np.float32)) for _, _, r in loaded]
            dense = torch.cat(rows).to(dtype)
            return self.convert(dense) if self.convert else dense
        if types & set(_FLOAT_TYPES):
            raise GGUFTensorError(
                f"{self.path.name}: {[n for n, _, _ in loaded]} mix float and quantized types; "
                "load with --dtype bf16"
            )
        for name, t, _ in loaded:
            if t not in FORMATS:
                raise GGUFTensorError(
                    f"{self.path.name}: tensor {name!r} is {t}, which has no quantized kernel "
                    f"here (supported: {', '.join(FORMATS)}); load with --dtype bf16 to run "
                    "it dequantized"
                )
        weight = GGUFWeight.concat([GGUFWeight.from_raw(t, r, k) for _, t, r in loaded])
        for name, _, _ in loaded:
            self.release(name)
        return self.convert(weight) if self.convert else weight

    def release(self, name: str) -> None:
        """Drop the mapped pages of tensor `name` from this process once it is repacked: they
        stay in the page cache, but no longer count towards its memory (a first load read
        every page of the file while the packed copy filled: 1.1 GB more at the peak)."""
        t = self.tensors[name]
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages inside
        end = (int(t.data_offset) + int(t.n_bytes)) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            with contextlib.suppress(OSError, ValueError):  # an advice; never fatal
                mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def load_gguf_model(
    path: Path, dtype: torch.dtype, device: torch.device | str, quantization: str = "none"
) -> LanguageModel:
    """The model in `path` (a "gguf" directory) with the GGUF's own weights, or with
    `quantization` ("int8" / "int4") weights made from their exact values: from the packed copy
    beside it when there is one (`packed_name`), else built from the file (each operand
    converted as it is read) and that copy written."""
    cfg = read_config(path)
    cls = model_class(cfg.model_type)
    where = torch.device(device)
    if where.type != "cpu":
        if not runs_on_device(cls, cfg) or quantization != "none":
            raise GGUFTensorError(
                f"GGUF weights run on a GPU for dense models in their own formats; "
                f"{cfg.model_type!r} ({quantization}) on {device}: load with --dtype bf16"
            )
        on_cpu = load_gguf_model(path, dtype, "cpu")
        assert isinstance(on_cpu, CausalLM)
        return to_device_(on_cpu, where)
    if cls not in (CausalLM, Gemma3LM):
        raise GGUFTensorError(
            f"GGUF weights run natively for dense models on the CPU; {cfg.model_type!r}: "
            "load with --dtype bf16"
        )
    cache = path / packed_name(quantization)
    if cache.is_file():
        try:
            return _load_packed(cache, cfg, dtype)  # type: ignore[return-value]
        except Exception as e:  # a stale or damaged copy: repack from the GGUF
            log.warning("ignoring %s (%s: %s); repacking from the GGUF", cache, type(e).__name__, e)
    # int8 / int4: each operand converted as it is read (the whole model in the GGUF's formats
    # and its quantized copy were both resident at the peak)
    model = _from_gguf(path / GGUF_LINK, cfg, dtype, quantization)
    trim_heap()
    _save_packed(model, cache)
    return model  # type: ignore[return-value]  # CausalLM implements LanguageModel


def _from_gguf(file: Path, cfg: Any, dtype: torch.dtype, quantization: str = "none") -> CausalLM:
    """The model of the GGUF `file` with its own weights, or each operand converted to
    `quantization` ("int8" / "int4", from its exact values) as soon as it is read."""
    model: CausalLM = model_class(cfg.model_type)(cfg, dtype, "cpu")  # type: ignore[assignment]
    f = GGUFFile(file, permute=permutes_qk(cfg.model_type), convert=operand_converter(quantization))
    arch = str(f.reader.fields["general.architecture"].contents())
    shift = norm_shift(arch)  # llama.cpp stored Gemma's 1 + w
    norms = {k: v for k, v in layer_names(arch).items() if k.endswith("norm")}
    hidden, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    q_size, kv_size = heads * cfg.head_dim, kv_heads * cfg.head_dim
    with torch.no_grad():
        for i, layer in enumerate(model.decoder_layers):
            pre, attn, mlp = f"blk.{i}.", layer.self_attn, layer.mlp
            attn.qkv = f.operand(
                [
                    (pre + "attn_q.weight", q_size, heads),
                    (pre + "attn_k.weight", kv_size, kv_heads),
                    (pre + "attn_v.weight", kv_size, 0),
                ],
                hidden,
                dtype,
            )
            attn.o = f.operand([(pre + "attn_output.weight", hidden, 0)], q_size, dtype)
            mlp.gate_up = f.operand(
                [
                    (pre + "ffn_gate.weight", cfg.intermediate_size, 0),
                    (pre + "ffn_up.weight", cfg.intermediate_size, 0),
                ],
                hidden,
                dtype,
            )
            mlp.down = f.operand(
                [(pre + "ffn_down.weight", hidden, 0)], cfg.intermediate_size, dtype
            )
            if attn.qkv_bias is not None:
                attn.qkv_bias.copy_(
                    torch.cat(
                        [
                            f.vector(pre + "attn_q.bias", q_size, heads),
                            f.vector(pre + "attn_k.bias", kv_size, kv_heads),
                            f.vector(pre + "attn_v.bias", kv_size),
                        ]
                    )
                )
            for kind, module in norms.items():  # every norm the layer has, by its HF path
                try:
                    weight = layer.get_submodule(module).weight
                except AttributeError:
                    continue  # not in this family (Llama's q/k norms)
                assert isinstance(weight, Tensor)
                weight.copy_(f.vector(f"{pre}{kind}.weight", weight.numel()) - shift)
        model.model.norm.weight.copy_(f.vector("output_norm.weight", hidden) - shift)
        head = "output.weight" if f.has("output.weight") else "token_embd.weight"
        model.head = f.operand([(head, cfg.vocab_size, 0)], hidden, dtype)
        qtype, table = f.rows("token_embd.weight", (cfg.vocab_size, hidden))
        # a copy: the model then holds no view of the mapped file, whose pages (all of them
        # read by the repack) stop counting towards the process's memory once it is closed
        model.model.embed_tokens = GGUFEmbedding(np.array(table), qtype, hidden, dtype)
    release_fused_(model)
    return model


# The packed copy: every operand's panels, the norms and biases, the embedding's raw rows, so
# a later start reads one file (~ the GGUF's size) and repacks nothing; one per weight format
# (the GGUF's own, int8, int4). Named by layout version: bump PACKED_VERSION when
# linear_gguf.py's or linear_int.py's layout or this file's naming changes.
PACKED_VERSION = 2


def packed_name(quantization: str = "none") -> str:
    kind = "" if quantization == "none" else f"{quantization}-"
    return f"packed-{kind}v{PACKED_VERSION}.safetensors"


PACKED_NAME = packed_name()


def _operands(model: CausalLM) -> list[tuple[str, OperandModule, str]]:
    return [
        (f"{name}.{op}" if name else op, module, op)
        for name, module in model.named_modules()
        if isinstance(module, OperandModule)
        for op in module.OPERANDS
    ]


_ST_DTYPES = {
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
}


def _write_safetensors(path: Path, tensors: dict[str, Tensor], meta: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor from the tensors' own memory (the format:
    an 8-byte header size, a JSON header of dtypes, shapes and offsets, the raw bytes):
    safetensors' save_file first gathers the whole file in memory, a second copy of every
    weight at the peak of a model's first load."""
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]


def _save_packed(model: CausalLM, file: Path) -> None:
    tensors: dict[str, Tensor] = {}
    meta: dict[str, str] = {}
    for key, module, op in _operands(model):
        w = getattr(module, op)
        if isinstance(w, GGUFWeight):
            meta[key] = json.dumps(["gguf", w.in_features, [[p.fmt.name, p.n] for p in w.parts]])
            for j, part in enumerate(w.parts):
                tensors[f"{key}.{j}"] = part.packed
        elif isinstance(w, Int4Weight):
            meta[key] = json.dumps(["int4", w.out_features, w.in_features])
            tensors[f"{key}.0"] = w.packed
        elif isinstance(w, Int8Weight):
            meta[key] = json.dumps(["int8", w.in_features])
            tensors[f"{key}.0"], tensors[f"{key}.1"] = w.packed, w.scale
        else:
            tensors[key] = w
    for name, param in model.named_parameters():
        if param.numel():
            tensors[f"param.{name}"] = param.detach()
    emb = model.model.embed_tokens
    assert isinstance(emb, GGUFEmbedding)
    tensors["embedding"] = torch.from_numpy(emb.raw)
    meta["embedding"] = json.dumps([emb.qtype.name, emb.dim])
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        _write_safetensors(tmp, tensors, meta)
        os.replace(tmp, file)
        for old in file.parent.glob("packed-*.safetensors"):  # other layout versions' copies
            if not old.name.endswith(f"v{PACKED_VERSION}.safetensors"):
                old.unlink(missing_ok=True)
    except OSError as e:  # a read-only model directory: run, repack again next time
        log.warning("could not write %s (%s); the next start repacks again", file, e)
    finally:
        tmp.unlink(missing_ok=True)


def _read_packed(file: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    """(metadata, tensors) of a safetensors file written by `_save_packed`, read with plain
    file reads into fresh buffers (the panels on huge pages, `streamed_empty`): mapping the
    file and copying out of it would hold both copies resident at the peak."""
    dtypes = {
        "U8": torch.uint8,
        "I8": torch.int8,
        "F32": torch.float32,
        "BF16": torch.bfloat16,
        "F16": torch.float16,
    }
    out: dict[str, Tensor] = {}
    with file.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
        meta = header.pop("__metadata__", {}) or {}
        base = 8 + size
        for name, info in header.items():
            start, end = info["data_offsets"]
            t = streamed_empty(tuple(info["shape"]), dtypes[info["dtype"]])
            view = t.view(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
            if end - start != view.nbytes:
                raise ValueError(f"{file.name}: tensor {name} has {end - start} bytes")
            fh.seek(base + start)
            if fh.readinto(memoryview(view)) != view.nbytes:  # type: ignore[arg-type]
                raise ValueError(f"{file.name}: truncated at tensor {name}")
            out[name] = t
    return meta, out


def _load_packed(file: Path, cfg: Any, dtype: torch.dtype) -> CausalLM:
    meta, tensors = _read_packed(file)
    model: CausalLM = model_class(cfg.model_type)(cfg, dtype, "cpu")  # type: ignore[assignment]
    for key, module, op in _operands(model):
        if key in meta:
            kind, *spec = json.loads(meta[key])
            w: Weight
            if kind == "gguf":
                k, parts = spec
                loaded = tuple(
                    GGUFPart(FORMATS[fmt], tensors.pop(f"{key}.{j}"), n)
                    for j, (fmt, n) in enumerate(parts)
                )
                w = GGUFWeight(loaded, k)
            elif kind == "int4":
                w = Int4Weight(tensors.pop(f"{key}.0"), *spec)
            else:
                w = Int8Weight(tensors.pop(f"{key}.0"), tensors.pop(f"{key}.1"), *spec)
            setattr(module, op, w)
        else:
            setattr(module, op, tensors.pop(key).to(dtype))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if f"param.{name}" in tensors:
                param.copy_(tensors.pop(f"param.{name}"))
    qtype, dim = json.loads(meta["embedding"])
    model.model.embed_tokens = GGUFEmbedding(tensors.pop("embedding").numpy(), qtype, dim, dtype)
    release_fused_(model)
    return model
