"""Load a model whose weights are a GGUF file's own quantized tensors. A "gguf" model
directory holds config.json, the tokenizer and `model.gguf`, a link to the file (hub/convert.py
writes it).

Each projection becomes a `GGUFWeight` (kernels/linear_gguf.py): the file's blocks repacked once
into the kernel's panel layout, the same weight values its reference dequantization gives, and
kept in the packed copy beside the link (models/formats/packed_copy.py) that later starts read;
fused q/k/v and gate/up operands join tensors of different formats part by part. Norms and biases
are read as they are; the embedding table stays in the mapped file and a lookup dequantizes only the
rows it reads (`GGUFEmbedding`). Unquantized 2-D tensors (F32 / F16 / BF16) load in the model dtype
like any other. A tensor in a format without a kernel here, a missing tensor or a shape that does
not match the config fails with an error that names it. Qwen3-MoE and the hybrid Qwen3-Next /
Qwen3.5 files load through models/formats/gguf_qwen_loader.py.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
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
from quickdraft.kernels.linear_gguf import FORMATS, GGUFWeight
from quickdraft.memory import trim_heap
from quickdraft.models.base import LanguageModel
from quickdraft.models.families.gemma3 import Gemma3LM
from quickdraft.models.families.llama import CausalLM, operand_converter
from quickdraft.models.formats.gguf_gpu import runs_on_device, to_device_
from quickdraft.models.formats.packed_copy import packed_name, packed_or_built
from quickdraft.models.layers import GGUFEmbedding, release_fused_
from quickdraft.models.registry import model_class, read_config

log = logging.getLogger(__name__)

_FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFTensorError(ValueError):
    """A GGUF tensor that cannot be loaded: missing, misshapen or in an unsupported type."""


class GGUFFormatError(GGUFTensorError):
    """A GGUF model whose family runs on its own blocks only, asked for another format (an
    int8 / int4 copy) or device."""


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
            dense = torch.cat(rows)
            # F16 stays fp16 where it runs as it is (the linear kernel widens it exactly); F32,
            # BF16 and what is converted (int8 / int4) take the model dtype
            keep = types == {"F16"} and dtype != torch.float32 and self.convert is None
            dense = dense.half() if keep else dense.to(dtype)
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

    def release(self, name: str, lo: int = 0, hi: int | None = None) -> None:
        """Drop the mapped pages of tensor `name` (of its bytes [lo, hi), all by default) from
        this process once it is repacked: they stay in the page cache, but no longer count
        towards its memory (a first load read every page of the file while the packed copy
        filled: 1.1 GB more at the peak)."""
        t = self.tensors[name]
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        hi = int(t.n_bytes) if hi is None else hi
        start = -(-(int(t.data_offset) + lo) // mmap.PAGESIZE) * mmap.PAGESIZE  # pages inside
        end = (int(t.data_offset) + hi) // mmap.PAGESIZE * mmap.PAGESIZE
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
    # int8 / int4: each operand converted as it is read (the whole model in the GGUF's formats
    # and its quantized copy were both resident at the peak)
    model = packed_or_built(
        path / packed_name(quantization),
        lambda: cls(cfg, dtype, "cpu"),
        lambda: _from_gguf(path / GGUF_LINK, cfg, dtype, quantization),
        dtype,
        log,
    )
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
