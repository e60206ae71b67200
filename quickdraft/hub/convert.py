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
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from quickdraft.config import GGUF_DTYPE, parse_dtype
from quickdraft.hub.errors import HubError, UnsupportedArchitectureError
from quickdraft.hub.gguf_gemma4 import ASSISTANT_ARCH, gemma4_config, gemma4_plan, per_layer
from quickdraft.hub.gguf_gpt_oss import gpt_oss_config, gpt_oss_plan
from quickdraft.hub.gguf_qwen import HYBRID_ARCHS, QWEN_ARCHS, Planned, qwen_config, qwen_plan
from quickdraft.memory import trim_heap

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
    # Qwen2-VL / Qwen2.5-VL's language model: Qwen2 with M-RoPE sections (the tower is the
    # mmproj file's, models/formats/gguf_vision.py)
    "qwen2vl": ("Qwen2_5_VLForConditionalGeneration", False),
    "gemma3": ("Gemma3ForCausalLM", False),  # text only; HF model_type "gemma3_text"
    # Qwen3-MoE and the hybrid Qwen3-Next / Qwen3.5 family: NEOX RoPE; layouts in gguf_qwen.py
    **{arch: (cls, False) for arch, (cls, _) in QWEN_ARCHS.items()},
    # sinks, alternating windows, YaRN, biased top-k experts; layout in gguf_gpt_oss.py
    "gpt-oss": ("GptOssForCausalLM", False),
    # per-layer head sizes, KV sharing, per-layer embeddings, experts; layout in gguf_gemma4.py
    "gemma4": ("Gemma4ForCausalLM", False),
}
# GGUF architecture -> HF model_type, where they differ
_MODEL_TYPES = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "gpt-oss": "gpt_oss",
    "qwen2vl": "qwen2_5_vl",
    **{a: t for a, (_, t) in QWEN_ARCHS.items()},
}
# Per-architecture renames on top of _LAYER_NAMES: Gemma 3 norms both sides of each block.
_ARCH_LAYER_NAMES = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
}
# llama.cpp's converter stores Gemma's zero-centred norm weights w as 1 + w (its RMSNorm
# multiplies by the weight); HF and our model code keep w and add the 1 in the norm.
_NORM_SHIFT = {"gemma3": 1.0}
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
# harmony (gpt-oss) ends an answer with <|return|> or a tool call with <|call|>; where both are
# in the vocabulary <|end|> only ends a message and generation goes on (llama.cpp's rule)
_HARMONY_EOG = frozenset(("<|return|>", "<|call|>"))
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def permutes_qk(arch: str) -> bool:
    """Whether llama.cpp stored `arch`'s q/k rows permuted (see _ARCHS)."""
    return _ARCHS.get(arch, ("", False))[1]


def layer_names(arch: str) -> dict[str, str]:
    """GGUF per-layer tensor kind -> HF module path inside `model.layers.N.` for `arch`."""
    return {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}


def norm_shift(arch: str) -> float:
    """What llama.cpp added to `arch`'s RMSNorm weights (subtract it to get HF's)."""
    return _NORM_SHIFT.get(arch, 0.0)


def _hf_name(gguf_name: str, arch: str = "") -> str:
    base, _, suffix = gguf_name.rpartition(".")
    names = layer_names(arch)
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        if m[2] in names:
            return f"model.layers.{m[1]}.{names[m[2]]}.{suffix}"
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


def _hf_config(
    reader: Any, arch: str, dtype: torch.dtype, family: str = ""
) -> tuple[dict[str, Any], list[int]]:
    """(config.json dict, eos ids for generation_config.json) from GGUF metadata; `family`:
    the architecture whose fields `arch`'s keys hold (the Gemma 4 assistant's: gemma4's)."""
    prefix, arch = arch, family or arch

    def meta(key: str, default: Any = None, required: bool = False) -> Any:
        value = _metadata(reader, f"{prefix}.{key}", default)
        if value is None and required:
            raise HubError(f"GGUF metadata lacks {prefix}.{key}")
        return value

    hidden, heads = (
        int(meta("embedding_length", required=True)),
        int(meta("attention.head_count", required=True)),
    )
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dim = meta("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim and arch not in HYBRID_ARCHS:
        raise UnsupportedArchitectureError(f"partial rotary ({rope_dim}/{head_dim}) unsupported")
    rope_scale = float(meta("rope.scaling.factor", 1.0))
    scaling = meta("rope.scaling.type", "none")
    if arch != "gpt-oss" and (  # gpt-oss: YaRN, read by gpt_oss_config
        scaling not in ("none", "linear")
        or (rope_scale != 1.0 and arch != "gemma3")  # Gemma 3 4B+: linear on its global layers
    ):
        raise UnsupportedArchitectureError("scaled RoPE is not supported yet")
    tokens: list[str] = _metadata(reader, "tokenizer.ggml.tokens")
    eos = _metadata(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    for key in ("eot_token_id", "eom_token_id"):
        if (i := _metadata(reader, f"tokenizer.ggml.{key}")) is not None:
            eos_ids.append(int(i))
    eos_ids += [i for i, t in enumerate(tokens) if t in _EOG_TOKENS]
    if _HARMONY_EOG.issubset(tokens):  # gpt-oss: <|end|> closes a message, not the answer
        eos_ids = [i for i in eos_ids if tokens[i] != "<|end|>"]
        eos_ids += [tokens.index(t) for t in sorted(_HARMONY_EOG)]
    eos_ids = list(dict.fromkeys(eos_ids))  # dedupe, keep the GGUF's own eos first
    tied = all(t.name != "output.weight" for t in reader.tensors)
    theta = _f32(meta("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": [_ARCHS[arch][0]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": int(meta("vocab_size", len(tokens))),
        "hidden_size": hidden,
        # MoE files may carry no dense width (every layer routed)
        # Gemma 4: per-layer arrays (read whole by gemma4_config)
        "intermediate_size": per_layer(
            meta("feed_forward_length", 0)
            if arch in (*QWEN_ARCHS, "gpt-oss")
            else meta("feed_forward_length", required=True),
            1,
        )[0],
        "num_hidden_layers": int(meta("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": per_layer(meta("attention.head_count_kv", heads), 1)[0],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", required=True)),
        # both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(meta("context_length", required=True)),
        "tie_word_embeddings": tied,
        "bos_token_id": _metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if eos_ids else None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch not in ("qwen2", "qwen2vl"):  # these always have q/k/v biases, and no such field
        cfg["attention_bias"] = any(t.name == "blk.0.attn_q.bias" for t in reader.tensors)
    # an embedding model's pooling (llama.cpp's llama_pooling_type: 1 mean, 2 cls, 3 last; its
    # NONE and RANK leave /v1/embeddings to the server's default)
    pooling = {1: "mean", 2: "cls", 3: "last"}.get(int(meta("pooling_type", 0)))
    if pooling is not None:
        cfg["pooling"] = pooling
    if arch == "qwen2vl":  # the M-RoPE sections (llama.cpp pads them to four with a 0)
        sections = meta("rope.dimension_sections", required=True)
        cfg["rope_parameters"]["mrope_section"] = [int(s) for s in list(sections)[:3]]
    if arch == "gemma3":
        cfg.update(_gemma3_config(meta, cfg, theta, rope_scale))
    if arch in QWEN_ARCHS:
        cfg.update(qwen_config(meta, arch, cfg))
    if arch == "gpt-oss":
        cfg.update(gpt_oss_config(meta, cfg))
    if arch == "gemma4":
        names = {t.name for t in reader.tensors}
        freqs = next((t.data for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        cfg.update(gemma4_config(meta, cfg, names, freqs))
    return cfg, eos_ids


def _gemma3_config(meta: Any, cfg: dict[str, Any], theta: float, scale: float) -> dict[str, Any]:
    """Gemma 3's fields beyond Llama's, as llama.cpp reads them (llama-model.cpp): every 6th
    layer global, the others local with a `sliding_window` and RoPE base 10000; queries
    scaled by head_dim ** -0.5 (hidden / heads for the 62-layer 27B)."""
    n = cfg["num_hidden_layers"]
    pattern = int(meta("attention.sliding_window_pattern", 6))
    global_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scale != 1.0:
        global_rope = {"rope_type": "linear", "rope_theta": theta, "factor": scale}
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(meta("attention.sliding_window", required=True)),
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
        ],
        "rope_parameters": {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def tensor_plan(reader: Any, arch: str, cfg: dict[str, Any]) -> list[Planned]:
    """Every HF tensor of the converted model and the GGUF tensors it is made from."""
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    if arch in QWEN_ARCHS:
        return qwen_plan(shapes, arch, cfg)
    if arch == "gpt-oss":
        return gpt_oss_plan(shapes, cfg)
    if arch == "gemma4":
        return gemma4_plan(shapes, cfg)
    permute, shift = permutes_qk(arch), norm_shift(arch)
    plan = []
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        heads = 0
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = cfg["num_attention_heads"]
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = cfg["num_key_value_heads"]
        minus = shift if name.endswith("norm.weight") else 0.0
        plan.append(
            Planned(
                name, shapes[t.name], (t.name,), partial(_dense_build, heads=heads, minus=minus)
            )
        )
    return plan


def _dense_build(ts: list[torch.Tensor], heads: int, minus: float) -> torch.Tensor:
    """llama.cpp's permuted q/k rows (`heads` > 0) and 1 + w norms (`minus`) undone."""
    w = unpermute_rows(ts[0], heads) if heads else ts[0]
    return w - minus if minus else w


def _write_safetensors(
    path: Path,
    reader: Any,
    plan: list[Planned],
    dtype: torch.dtype,
    progress: bool,
    label: str,
) -> None:
    """Stream tensors into a safetensors file: header first (shapes are known), then one
    tensor at a time, built from its dequantized GGUF sources: memory holds those in fp32
    and the cast copy at most."""
    from quickdraft.hub.gguf_read import gguf_fp32

    itemsize = torch.empty((), dtype=dtype).element_size()
    tensors = {t.name: t for t in reader.tensors}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan:
        nbytes = math.prod(item.shape) * itemsize
        header[item.name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(item.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data 8-byte aligned

    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for item in tqdm(plan, desc=f"dequantize {label}", disable=not progress):
            w = item.build([gguf_fp32(tensors[n]) for n in item.sources])
            assert tuple(w.shape) == item.shape, (item.name, tuple(w.shape), item.shape)
            f.write(w.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del w


def _write_tokenizer(gguf_path: Path, out: Path, chat_template: str | None, arch: str) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # An empty directory holding only a link to the GGUF, so transformers cannot pick up an
    # unrelated tokenizer_config.json that happens to sit next to the user's file.
    src = out / ".src"
    src.mkdir()
    (src / gguf_path.name).symlink_to(gguf_path.resolve())
    # AutoTokenizer first parses the model config, and transformers' GGUF reader does not know
    # every arch (qwen3next, qwen2vl); the tokenizer itself comes from tokenizer.ggml.* alone
    fast = (*HYBRID_ARCHS, "qwen2vl", "gpt-oss", "gemma4")
    loader = PreTrainedTokenizerFast if arch in fast else AutoTokenizer
    tok = loader.from_pretrained(str(src), gguf_file=gguf_path.name)
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


def assistant_config(reader: Any) -> tuple[dict[str, Any], int]:
    """A Gemma 4 assistant GGUF's (llama.cpp `gemma4-assistant`) text config.json dict and
    the target width it reads (`embedding_length_out`)."""
    cfg, _ = _hf_config(reader, ASSISTANT_ARCH, torch.float32, family="gemma4")
    backbone = _metadata(reader, f"{ASSISTANT_ARCH}.embedding_length_out")
    if backbone is None:
        raise HubError(f"GGUF metadata lacks {ASSISTANT_ARCH}.embedding_length_out")
    return cfg, int(backbone)


def convert_gguf(
    gguf_path: Path, out_dir: Path, dtype: str = "bf16", progress: bool = True
) -> Path:
    """Write a Hugging Face-format directory for `gguf_path` at `out_dir` (must not exist).
    dtype "gguf": config and tokenizer only, and a link to the GGUF file (its weights are
    loaded as they are, models/formats/gguf_loader.py); else the weights dequantized to `dtype`."""
    from quickdraft.hub.gguf_read import read_gguf

    torch_dtype = parse_dtype(dtype)
    if out_dir.exists():
        raise HubError(f"{out_dir} already exists; remove it to convert again")
    try:
        reader = read_gguf(gguf_path)
    except Exception as e:  # the reader raises bare ValueErrors (reshape, struct) on bad files
        raise HubError(f"{gguf_path}: not a readable GGUF file (truncated or damaged?): {e}") from e
    arch = _metadata(reader, "general.architecture")
    if arch == ASSISTANT_ARCH:
        raise UnsupportedArchitectureError(
            f"{gguf_path.name}: a Gemma 4 assistant drafts for its target: serve the target "
            f"with --speculative-method assistant --draft-model {gguf_path}"
        )
    if arch not in _ARCHS:
        raise UnsupportedArchitectureError(
            f"{gguf_path.name}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(_ARCHS)})"
        )
    cfg, eos_ids = _hf_config(reader, arch, torch_dtype)
    chat_template = _metadata(reader, "tokenizer.chat_template")
    if dtype == GGUF_DTYPE:  # no weights to read: drop the parsed vocabulary (~0.5 GB for
        del reader  # 151k tokens) before transformers parses the file once more
        trim_heap()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        _write_tokenizer(gguf_path, tmp, chat_template, arch)
        trim_heap()  # transformers' copy of the vocabulary, and its tokenizer's
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos_ids}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if dtype == GGUF_DTYPE:
            (tmp / GGUF_LINK).symlink_to(gguf_path.resolve())
        else:
            _write_safetensors(
                tmp / "model.safetensors",
                reader,
                tensor_plan(reader, arch, cfg),
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
