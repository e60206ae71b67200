"""The packed copy of a GGUF model: every GEMM operand in the layout its kernel streams, so a
later start reads one file (~ the GGUF's size) and repacks nothing.

Stage: loading (models/formats/gguf_loader.py for dense and Gemma 3 files,
models/formats/gguf_qwen_loader.py for Qwen3-MoE and the hybrids,
models/formats/gguf_gemma4_loader.py). Contract: `save_packed(model, file)` writes a safetensors
file of every operand (`OperandModule.OPERANDS`; a MoE layer's routed experts, `Experts.operands`,
one pair per expert), every parameter, the Gated DeltaNet head orders and the embedding tables' raw
rows (the token one, and others such as Gemma 4's per-layer one); `fill_packed(model, file)` puts
them back into an empty model of the same config (what its constructor made) and returns it with the
same weights, bit for bit. One copy per weight format (the GGUF's own, int8, int4), named by layout
version: bump PACKED_VERSION when linear_gguf.py's or linear_int.py's layout or what is written here
changes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from quickdraft.kernels.gemm import Weight
from quickdraft.kernels.linear_bf16 import streamed_empty
from quickdraft.kernels.linear_gguf import FORMATS, GGUFPart, GGUFWeight
from quickdraft.kernels.linear_int import Int4Weight, Int8Weight
from quickdraft.memory import trim_heap
from quickdraft.models.families.gpt_oss import GptOssMoE
from quickdraft.models.families.moe import Experts
from quickdraft.models.families.qwen3_next import GatedDeltaNet
from quickdraft.models.layers import GGUFEmbedding, OperandModule, release_fused_

log = logging.getLogger(__name__)

# 3: a MoE model's routed experts and the Gated DeltaNet head orders; 4: experts' operand
# tuples of any width (gpt-oss's carry biases); 5: Q2_K's scale and min in one byte
PACKED_VERSION = 5


def packed_name(quantization: str = "none") -> str:
    kind = "" if quantization == "none" else f"{quantization}-"
    return f"packed-{kind}v{PACKED_VERSION}.safetensors"


PACKED_NAME = packed_name()


def _operands(model: nn.Module) -> list[tuple[str, OperandModule, str]]:
    return [
        (f"{name}.{op}" if name else op, module, op)
        for name, module in model.named_modules()
        if isinstance(module, OperandModule)
        for op in module.OPERANDS
    ]


def operands_of(model: nn.Module) -> list[Weight]:
    """Every GEMM operand of `model` that the packed copy holds: each module's `OPERANDS` and
    each MoE layer's routed experts (the members of their per-expert tuples)."""
    ops: list[Weight] = [getattr(module, op) for _, module, op in _operands(model)]
    for module in model.modules():
        if isinstance(module, Experts | GptOssMoE) and module.operands is not None:
            ops += [w for each in module.operands for w in each]
    return ops


def _put(tensors: dict[str, Tensor], meta: dict[str, str], key: str, w: Weight) -> None:
    """Operand `w` under `key`: its packed tensors, and how to rebuild it in `meta`."""
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
        assert isinstance(w, Tensor), f"{key}: {type(w).__name__} is not written"
        tensors[key] = w


def _take(tensors: dict[str, Tensor], meta: dict[str, str], key: str, dtype: torch.dtype) -> Weight:
    """The operand `_put` wrote under `key`."""
    if key not in meta:
        t = tensors.pop(key)
        return t if t.dtype == torch.float16 else t.to(dtype)  # a file's F16 operand stays
    kind, *spec = json.loads(meta[key])
    if kind == "gguf":
        k, parts = spec
        loaded = tuple(
            GGUFPart(FORMATS[fmt], tensors.pop(f"{key}.{j}"), n) for j, (fmt, n) in enumerate(parts)
        )
        return GGUFWeight(loaded, k)
    if kind == "int4":
        return Int4Weight(tensors.pop(f"{key}.0"), *spec)
    return Int8Weight(tensors.pop(f"{key}.0"), tensors.pop(f"{key}.1"), *spec)


_ST_DTYPES = {
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int64: "I64",
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


def save_packed(model: nn.Module, file: Path) -> None:
    """`model`'s weights as `fill_packed` reads them back (module docstring); a directory that
    cannot be written only costs the next start a repack."""
    tensors: dict[str, Tensor] = {}
    meta: dict[str, str] = {}
    for key, module, op in _operands(model):
        _put(tensors, meta, key, getattr(module, op))
    for name, module in model.named_modules():
        if isinstance(module, Experts | GptOssMoE) and module.operands is not None:
            width = len(module.operands[0])  # (gate_up, down); gpt-oss: with their biases
            meta[f"{name}.operands"] = json.dumps(["experts", len(module.operands), width])
            for e, each in enumerate(module.operands):
                for i, w in enumerate(each):
                    _put(tensors, meta, f"{name}.operands.{e}.{i}", w)
        elif isinstance(module, GatedDeltaNet) and module.out_heads is not None:
            tensors[f"out_heads.{name}"] = module.out_heads
    for name, param in model.named_parameters():
        if param.numel():
            tensors[f"param.{name}"] = param.detach()
    emb = model.get_submodule("model.embed_tokens")
    assert isinstance(emb, GGUFEmbedding)
    for name, module in model.named_modules():  # the token table, and others (Gemma 4's PLE)
        if isinstance(module, GGUFEmbedding):
            key = "embedding" if module is emb else f"embedding:{name}"
            tensors[key] = torch.from_numpy(module.raw)
            meta[key] = json.dumps([module.qtype.name, module.dim])
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        # other layout versions' copies go first: no start reads them, and a model's copy is
        # as big as the model (a stale 20 GiB copy left no room on disk for its successor)
        for old in file.parent.glob("packed-*.safetensors"):
            if not old.name.endswith(f"v{PACKED_VERSION}.safetensors"):
                old.unlink(missing_ok=True)
        _write_safetensors(tmp, tensors, meta)
        os.replace(tmp, file)
    except OSError as e:  # a read-only model directory: run, repack again next time
        log.warning("could not write %s (%s); the next start repacks again", file, e)
    finally:
        tmp.unlink(missing_ok=True)


READ_THREADS = 4  # readers of a packed copy, each a contiguous quarter of its bytes


def _read_packed(file: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    """(metadata, tensors) of a safetensors file written by `save_packed`, read with plain
    file reads into fresh buffers (the panels on huge pages, `streamed_empty`): mapping the
    file and copying out of it would hold both copies resident at the peak. READ_THREADS
    threads read contiguous ranges of it at once (`os.preadv` releases the GIL): from a cold
    page cache one reader took 44 s for the full-size 35B-A3B copy (21.5 GB in 31k tensors,
    0.5 GB/s), where this disk gives 1.2 GB/s to one stream and 2.4 to four."""
    dtypes = {v: k for k, v in _ST_DTYPES.items()}
    out: dict[str, Tensor] = {}
    jobs: list[tuple[int, str, Any]] = []  # (file offset, name, destination bytes)
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
        jobs.append((base + start, name, view))
        out[name] = t
    jobs.sort(key=lambda j: j[0])
    total = sum(j[2].nbytes for j in jobs)
    cuts = [0]
    done = 0
    for i, job in enumerate(jobs):  # contiguous ranges of about equal bytes
        done += job[2].nbytes
        if done * READ_THREADS >= total * len(cuts) and len(cuts) < READ_THREADS:
            cuts.append(i + 1)
    cuts.append(len(jobs))
    fd = os.open(file, os.O_RDONLY)
    try:

        def read(lo: int, hi: int) -> None:
            for offset, name, view in jobs[lo:hi]:
                got = 0
                while got < view.nbytes:  # preadv may return short reads
                    n = os.preadv(fd, [memoryview(view[got:])], offset + got)
                    if n <= 0:
                        raise ValueError(f"{file.name}: truncated at tensor {name}")
                    got += n

        with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            for f in [pool.submit(read, lo, hi) for lo, hi in itertools.pairwise(cuts)]:
                f.result()
    finally:
        os.close(fd)
    return meta, out


def fill_packed(model: nn.Module, file: Path, dtype: torch.dtype) -> nn.Module:
    """`model` (empty, as its constructor made it) with the weights of packed copy `file`."""
    meta, tensors = _read_packed(file)
    for key, module, op in _operands(model):
        setattr(module, op, _take(tensors, meta, key, dtype))
    for name, module in model.named_modules():
        if isinstance(module, Experts | GptOssMoE) and f"{name}.operands" in meta:
            _, count, width = json.loads(meta[f"{name}.operands"])
            loaded = [
                tuple(_take(tensors, meta, f"{name}.operands.{e}.{i}", dtype) for i in range(width))
                for e in range(count)
            ]
            stacked = module.experts if isinstance(module, GptOssMoE) else module
            for pname, _ in list(stacked.named_parameters(recurse=False)):
                setattr(stacked, pname, nn.Parameter(torch.empty(0), requires_grad=False))
            module.operands = loaded  # type: ignore[assignment]
        elif isinstance(module, GatedDeltaNet) and f"out_heads.{name}" in tensors:
            module.out_heads = tensors.pop(f"out_heads.{name}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if f"param.{name}" in tensors:
                param.copy_(tensors.pop(f"param.{name}"))
    for key in [k for k in meta if k == "embedding" or k.startswith("embedding:")]:
        qtype, dim = json.loads(meta[key])
        table = GGUFEmbedding(tensors.pop(key).numpy(), qtype, dim, dtype)
        owner, _, attr = (
            key[len("embedding:") :] if ":" in key else "model.embed_tokens"
        ).rpartition(".")
        setattr(model.get_submodule(owner), attr, table)
    release_fused_(model)
    return model


def packed_or_built(
    cache: Path,
    empty: Callable[[], nn.Module],  # the model as its constructor makes it
    build: Callable[[], nn.Module],  # the model repacked from the GGUF
    dtype: torch.dtype,
    warn: logging.Logger,  # the loader's log, where an ignored copy is reported
) -> nn.Module:
    """The model from packed copy `cache` when it reads back, else built from the GGUF and the
    copy (re)written: a stale or damaged copy is reported and replaced."""
    if cache.is_file():
        try:
            return fill_packed(empty(), cache, dtype)
        except Exception as e:  # a stale or damaged copy: repack from the GGUF
            warn.warning(
                "ignoring %s (%s: %s); repacking from the GGUF", cache, type(e).__name__, e
            )
    model = build()
    trim_heap()
    save_packed(model, cache)
    return model
