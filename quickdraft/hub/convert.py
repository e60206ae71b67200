"""GGUF file -> Hugging Face-format directory, once per file and dtype.

`convert_gguf` dequantizes tensor by tensor with the `gguf` package (besides the mmapped GGUF,
memory holds one fp32 tensor at a time), undoes llama.cpp's q/k row permutation for the llama
architecture, and writes config.json, generation_config.json, model.safetensors and the
tokenizer files under a temporary name renamed into place: a failed or interrupted run leaves
no half-written directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from quickdraft.config import GGUF_DTYPE, parse_dtype
from quickdraft.hub.errors import HubError, UnsupportedArchitectureError

GGUF_LINK = "model.gguf"  # in a "gguf" model directory: a link to the GGUF file it runs


def is_hf_dir(path: Path) -> bool:
    """A converted (or user-given) Hugging Face-format model directory: config, tokenizer and
    weights (*.safetensors, or a link to the GGUF file whose own weights it runs)."""
    return (
        (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
        and (any(path.glob("*.safetensors")) or (path / GGUF_LINK).is_file())
    )


# GGUF architecture -> (HF class, llama.cpp permuted q/k rows). llama.cpp's converter permutes
# q/k rows for archs it ropes in "normal" (adjacent-pair) mode so that matches HF's rotate_half;
# qwen2 and qwen3 use NEOX mode (already rotate_half), so their rows are stored as in HF.
_ARCHS: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),  # + per-head q/k RMSNorm (attn_q_norm, attn_k_norm)
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
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


def permutes_qk(arch: str) -> bool:
    """Whether llama.cpp stored `arch`'s q/k rows permuted (see _ARCHS)."""
    return _ARCHS.get(arch, ("", False))[1]


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        if m[2] in _LAYER_NAMES:
            return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{suffix}"
    elif base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise HubError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know of")


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows [r0 r1 ... | r(d/2) ...] were interleaved.
    Rows may be any row layout, a quantized tensor's bytes included (rows are whole blocks)."""
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
    if arch != "qwen2":  # qwen2 always has q/k/v biases and its config has no such field
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
                w = unpermute_rows(w, cfg["num_attention_heads"])
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_rows(w, cfg["num_key_value_heads"])
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
    """Write a Hugging Face-format directory for `gguf_path` at `out_dir` (must not exist).
    dtype "gguf": config and tokenizer only, and a link to the GGUF file (its weights are
    loaded as they are, models/gguf_loader.py); else the weights dequantized to `dtype`."""
    import gguf

    torch_dtype = parse_dtype(dtype)
    if out_dir.exists():
        raise HubError(f"{out_dir} already exists; remove it to convert again")
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # the reader raises bare ValueErrors (reshape, struct) on bad files
        raise HubError(f"{gguf_path}: not a readable GGUF file (truncated or damaged?): {e}") from e
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
        if dtype == GGUF_DTYPE:
            (tmp / GGUF_LINK).symlink_to(gguf_path.resolve())
        else:
            _write_safetensors(
                tmp / "model.safetensors",
                reader,
                cfg,
                permutes_qk(arch),
                torch_dtype,
                progress,
                gguf_path.name,
            )
        tmp.chmod(0o755)  # mkdtemp creates 0700
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_hf_dir(out_dir):  # not a concurrent conversion finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
