"""GGUF files written as llama.cpp writes them, for random-weight models: the tests' tiny files
and the benchmarks' (bench/hybrid.py --gguf) realistic-shape ones.

Stage: the inverse of the GGUF converter (hub/convert.py, hub/gguf_qwen.py); nothing in serving
calls it. Contract: `llama_cpp_tensors(state, arch, cfg)` lays a transformers state dict
(+ an MTP head as `mtp.*`) of the Qwen3-MoE / Qwen3-Next / Qwen3.5 / Qwen3.5-MoE families out
as llama.cpp's converter (convert_hf_to_gguf.py) does, every transform it applies (names,
1 + w norms, -exp(A_log), squeezed conv, split qkvz, tiled value heads, split experts, the MTP
head as `blk.{n}.nextn.*`); `write_gguf` writes those tensors with llama.cpp's metadata keys and
a byte-level tokenizer (`add_tiny_tokenizer`), the matrices in one block format gguf-py can
quantize (`WRITABLE`). K-quant files (Q4_K_M ...) come from llama.cpp's own quantizer
(`quickdraft.bench.peers.llama_cpp_quantize`) run on an F32 file written here. A file too
large to hold (a full-size MoE model) is streamed tensor by tensor from bytes its caller makes,
in any block format (`write_gguf_streamed`; bench/moe.py writes random blocks that way).
"""

from __future__ import annotations

import itertools
import math
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import quantize
from torch import Tensor

from quickdraft.hub.gguf_gemma4 import (
    ASSISTANT_ARCH,
    GEMMA4V_PROJECTOR,
    add_gemma4_metadata,
    gemma4_mmproj_names,
    gemma4_tensors,
)
from quickdraft.hub.gguf_qwen import (
    HYBRID_ARCHS,
    QWEN3VL_PROJECTOR,
    QWEN25VL_PROJECTOR,
    mmproj_names,
    qwen25_mmproj_names,
)

# the block formats gguf-py's `quantize` writes (it reads the K-quants but cannot write them)
WRITABLE = ("F32", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
# HF module suffix -> llama.cpp tensor kind (convert_hf_to_gguf's tensor map for these archs)
_KINDS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.gate": "ffn_gate_inp",
    "mlp.router": "ffn_gate_inp",  # gpt-oss
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def add_tiny_tokenizer(
    w: gguf.GGUFWriter,
    vocab: int,
    specials: tuple[str, ...] = TINY_SPECIALS,
    bos: str = "<s>",
    eos: str = "<|im_end|>",
    chat_template: str | None = CHATML,
) -> None:
    """A byte-level BPE tokenizer: the 256 byte symbols, one merge "Ġ t", `specials` as
    control tokens, padded to `vocab`; a chat template (ChatML unless told; None: none)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = sorted(bytes_to_unicode().values())
    tokens = [*alphabet, "Ġt", *specials]
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(alphabet) + 1) + [3] * (vocab - len(alphabet) - 1))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(tokens.index(bos))
    w.add_eos_token_id(tokens.index(eos))
    if chat_template is not None:
        w.add_chat_template(chat_template)


def tile_v(t: Tensor, dim: int, k_heads: int, per_v: int, head: int) -> Tensor:
    """llama.cpp's Qwen3.5 reorder: value heads grouped per key head -> tiled."""
    shape = list(t.shape)
    grouped = t.reshape(*shape[:dim], k_heads, per_v, head, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def llama_cpp_tensors(
    state: dict[str, Tensor], arch: str, cfg: dict[str, Any]
) -> dict[str, Tensor]:
    """A transformers state dict (+ `mtp.*`) as llama.cpp's converter writes it for `arch`
    (fp32 tensors in torch order)."""
    if arch == "gemma4":
        return gemma4_tensors(state, cfg)
    hybrid = arch in HYBRID_ARCHS
    layers = cfg["num_hidden_layers"]
    nk, nv = cfg.get("linear_num_key_heads", 1), cfg.get("linear_num_value_heads", 1)
    dk, dv = cfg.get("linear_key_head_dim", 1), cfg.get("linear_value_head_dim", 1)
    key_dim, per_v = nk * dk, nv // nk
    tiled = arch in ("qwen35", "qwen35moe")
    oss = arch == "gpt-oss"  # HF's experts [E, H, 2I] gate / up interleaved, with biases
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        t = t.detach().float().clone()
        if name.startswith("mtp."):  # the head goes in as one more block
            rest = name[len("mtp.") :]
            if rest.startswith("layers.0."):
                name = f"model.layers.{layers}.{rest[len('layers.0.') :]}"
            else:
                nextn = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm"}
                nextn |= {"pre_fc_norm_hidden": "hnorm", "norm": "shared_head_norm"}
                part, suffix = rest.split(".", 1)
                shift = 1 if hybrid and part != "fc" else 0  # the norms, not eh_proj
                out[f"blk.{layers}.nextn.{nextn[part]}.{suffix}"] = t + shift
                continue
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            kind = {"model.embed_tokens.weight": "token_embd.weight"}
            kind |= {"lm_head.weight": "output.weight", "model.norm.weight": "output_norm.weight"}
            out[kind[name]] = t + 1 if hybrid and name == "model.norm.weight" else t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(\.weight|\.bias)?", name)
        assert m is not None, name
        blk, module = f"blk.{m[1]}.", m[2]
        if hybrid and module.endswith("norm") and module != "linear_attn.norm":
            t = t + 1  # zero-centred norm weights stored as 1 + w
        if tiled and module.startswith("linear_attn."):
            if module == "linear_attn.in_proj_qkv" or module == "linear_attn.conv1d":
                t = torch.cat([t[: 2 * key_dim], tile_v(t[2 * key_dim :], 0, nk, per_v, dv)])
            elif module == "linear_attn.in_proj_z":
                t = tile_v(t, 0, nk, per_v, dv)
            elif module.rpartition(".")[2] in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
                t = tile_v(t, 0, nk, per_v, 1)
            elif module == "linear_attn.out_proj":
                t = tile_v(t, 1, nk, per_v, dv)
        if module == "post_attention_layernorm":
            post = "post_attention_norm" if hybrid or oss else "ffn_norm"
            out[blk + post + ".weight"] = t
        elif module == "self_attn.sinks":
            out[blk + "attn_sinks.weight"] = t
        elif oss and module == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> [E, I, H] each
            out[blk + "ffn_gate_exps.weight"] = t[:, :, 0::2].transpose(1, 2).contiguous()
            out[blk + "ffn_up_exps.weight"] = t[:, :, 1::2].transpose(1, 2).contiguous()
        elif oss and module == "mlp.experts.gate_up_proj_bias":
            out[blk + "ffn_gate_exps.bias"] = t[:, 0::2].contiguous()
            out[blk + "ffn_up_exps.bias"] = t[:, 1::2].contiguous()
        elif oss and module == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
            out[blk + "ffn_down_exps.weight"] = t.transpose(1, 2).contiguous()
        elif oss and module == "mlp.experts.down_proj_bias":
            out[blk + "ffn_down_exps.bias"] = t
        elif module == "linear_attn.A_log":
            out[blk + "ssm_a"] = -torch.exp(t)
        elif module == "linear_attn.dt_bias":
            out[blk + "ssm_dt.bias"] = t
        elif module == "linear_attn.conv1d":
            out[blk + "ssm_conv1d.weight"] = t.squeeze(1)
        elif module == "linear_attn.in_proj_qkvz":  # per key head [q k v z] -> qkv | z
            grouped = t.view(nk, 2 * dk + 2 * per_v * dv, -1)
            q, k, v, z = torch.split(grouped, [dk, dk, per_v * dv, per_v * dv], dim=1)
            out[blk + "attn_qkv.weight"] = torch.cat(
                [q.reshape(key_dim, -1), k.reshape(key_dim, -1), v.reshape(nv * dv, -1)]
            )
            out[blk + "attn_gate.weight"] = z.reshape(nv * dv, -1)
        elif module == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            out[blk + "ffn_gate_exps.weight"] = t[:, :inter]
            out[blk + "ffn_up_exps.weight"] = t[:, inter:]
        elif module == "mlp.experts.down_proj":
            out[blk + "ffn_down_exps.weight"] = t
        elif module == "mlp.shared_expert_gate":
            out[blk + "ffn_gate_inp_shexp.weight"] = t.reshape(-1)
        else:
            out[f"{blk}{_KINDS[module]}{m[3]}"] = t
    return out


def rope_sections(rotary_dim: int) -> list[int]:
    """Qwen3.5's M-RoPE sections as llama.cpp writes them: rotary_dim / 2 frequency pairs split
    over (time, height, width) as evenly as the first ones allow, e.g. 32 -> 11 11 10, + 0."""
    half = rotary_dim // 2
    return [half // 3 + (i < half % 3) for i in range(3)] + [0]


def write_gguf(
    path: Path,
    arch: str,
    cfg: dict[str, Any],
    tensors: dict[str, Tensor],
    qtype: str = "F32",
    specials: tuple[str, ...] = TINY_SPECIALS,
    chat_template: str | None = CHATML,
) -> Path:
    """The GGUF file of `tensors` (llama_cpp_tensors' output): llama.cpp's metadata keys for
    `arch` from the transformers config `cfg`, a tiny tokenizer of cfg's vocabulary (with
    `specials`, ids from 257); every matrix whose rows are whole blocks of `qtype` (one of
    WRITABLE) in it, the rest (norms, conv, A, dt) F32 as llama.cpp keeps them."""
    if qtype not in WRITABLE:
        raise ValueError(f"gguf-py cannot write {qtype!r}: choose one of {WRITABLE}")
    nextn = any(".nextn." in n for n in tensors)
    w = _metadata(path, arch, cfg, nextn, specials, chat_template)
    _write_tensors(w, tensors, qtype, lambda name, values: values.ndim >= 2)
    return path


def write_gguf_streamed(
    path: Path,
    arch: str,
    cfg: dict[str, Any],
    plan: dict[str, tuple[tuple[int, ...], str]],
    chunks: Callable[[str, tuple[int, ...], str], Iterator[np.ndarray]],
) -> Path:
    """A GGUF of any size written without holding it: `write_gguf`'s metadata, then for each
    tensor of `plan` (name -> torch-order shape and GGML type name, any type llama.cpp reads)
    the bytes `chunks(name, shape, type)` yields, in row order (uint8 rows of whole blocks for
    quantized types, float32 values for F32), streamed to the file."""
    nextn = any(".nextn." in n for n in plan)
    w = _metadata(path, arch, cfg, nextn, TINY_SPECIALS, CHATML)
    sizes = {}
    for name, (shape, qtype) in plan.items():
        qt = gguf.GGMLQuantizationType[qtype]
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        if shape[-1] % block:
            raise ValueError(f"{name} {shape}: rows are not whole {qtype} blocks of {block}")
        nbytes = math.prod(shape) // block * type_size
        sizes[name] = nbytes
        if qtype == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            byte_shape = (*shape[:-1], shape[-1] // block * type_size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    fout = w.fout[0]
    for name, (shape, qtype) in plan.items():
        fout.write(bytes(-fout.tell() % w.data_alignment))  # each tensor starts aligned
        written = 0
        for chunk in chunks(name, shape, qtype):
            buf = np.ascontiguousarray(chunk)
            fout.write(memoryview(buf.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
            written += buf.nbytes
        if written != sizes[name]:
            raise ValueError(f"{name}: {written} bytes written, {sizes[name]} expected")
    fout.write(bytes(-fout.tell() % w.data_alignment))
    w.close()
    return path


def _metadata(
    path: Path,
    arch: str,
    cfg: dict[str, Any],
    nextn: bool,
    specials: tuple[str, ...],
    chat_template: str | None,
) -> gguf.GGUFWriter:
    """A writer holding llama.cpp's metadata keys for `arch` from the transformers config."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"] + int(nextn))
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch in ("gemma4", ASSISTANT_ARCH):  # per-layer shapes, two RoPE bases
        add_gemma4_metadata(w, cfg)
        if arch == ASSISTANT_ARCH:  # the target's width; every layer a draft (nextn) layer
            w.add_embedding_length_out(cfg["backbone_hidden_size"])
            w.add_nextn_predict_layers(cfg["num_hidden_layers"])
    else:
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        if "intermediate_size" in cfg:
            w.add_feed_forward_length(cfg["intermediate_size"])
    if arch == "gpt-oss":  # every layer routed, its experts intermediate_size wide
        w.add_expert_count(int(cfg.get("num_local_experts") or cfg["num_experts"]))
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_rope_dimension_count(head_dim)
        rope = cfg["rope_parameters"]
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif "num_experts" in cfg and arch not in ("gemma4", ASSISTANT_ARCH):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch in HYBRID_ARCHS:
        rotary_dim = int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"])
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        w.add_rope_dimension_count(rotary_dim)
        if nextn:
            w.add_nextn_predict_layers(1)
        if arch in ("qwen35", "qwen35moe"):
            w.add_rope_dimension_sections(rope_sections(rotary_dim))
    if arch == "qwen2vl":  # Qwen2.5-VL's contiguous sections, padded to four as llama.cpp does
        w.add_rope_dimension_sections([*cfg["rope_parameters"]["mrope_section"], 0])
    add_tiny_tokenizer(w, cfg["vocab_size"], specials, chat_template=chat_template)
    return w


def _write_tensors(
    w: gguf.GGUFWriter,
    tensors: dict[str, Tensor],
    qtype: str,
    quantized: Callable[[str, np.ndarray], bool],  # which tensors go in qtype (where they fit)
) -> None:
    """The tensors (in `qtype` where `quantized` says so and their rows are whole blocks, F32
    otherwise), then the file is written and closed."""
    qt = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[qt][0]
    for name, t in tensors.items():
        values = np.ascontiguousarray(t.detach().float().numpy())
        if qtype != "F32" and quantized(name, values) and values.shape[-1] % block == 0:
            w.add_tensor(name, quantize(values, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_mmproj(
    path: Path,
    config: dict[str, Any],  # the composite config.json (text_config + vision_config)
    preprocessor: dict[str, Any],  # preprocessor_config.json
    state: dict[str, Tensor],  # a transformers state dict (its model.visual.* part)
    qtype: str = "F32",
) -> Path:
    """The vision tower of a Qwen3.5, Qwen2.5-VL or Gemma 4 checkpoint as llama.cpp's
    converter writes its mmproj file: `clip.*` keys, projector `qwen3vl_merger` /
    `qwen2.5vl_merger` / `gemma4v`, the Conv3d patch embedding split into two temporal slices
    (Qwen2.5-VL's fused qkv into three; Gemma 4's linear patch embedding as a Conv2d);
    matrices in `qtype` where their rows are whole blocks, the rest F32."""
    if qtype not in WRITABLE:
        raise ValueError(f"gguf-py cannot write {qtype!r}: choose one of {WRITABLE}")
    if config.get("model_type") == "gemma4":
        return _write_gemma4_mmproj(path, config, preprocessor, state, qtype)
    vision, text = config["vision_config"], config["text_config"]
    qwen25 = config.get("model_type") == "qwen2_5_vl"
    depth, patch = int(vision["depth"]), int(vision["patch_size"])
    visual = {
        k[len("model.visual.") :]: v for k, v in state.items() if k.startswith("model.visual.")
    }
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_projector_type(QWEN25VL_PROJECTOR if qwen25 else QWEN3VL_PROJECTOR)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(int(text["hidden_size"]))
    w.add_vision_patch_size(patch)
    w.add_vision_embedding_length(int(vision["hidden_size"]))
    w.add_vision_feed_forward_length(int(vision["intermediate_size"]))
    w.add_vision_block_count(depth)
    w.add_vision_head_count(int(vision["num_heads"]))
    w.add_vision_attention_layernorm_eps(float(text.get("rms_norm_eps", 1e-6)))
    w.add_vision_image_mean([float(v) for v in preprocessor["image_mean"]])
    w.add_vision_image_std([float(v) for v in preprocessor["image_std"]])
    w.add_vision_spatial_merge_size(int(vision.get("spatial_merge_size", 2)))
    if qwen25:
        w.add_vision_image_size(560)  # the converter's default; Qwen-VL sizes images itself
        w.add_vision_use_silu(True)
        w.add_vision_n_wa_pattern(window_pattern(list(vision["fullatt_block_indexes"])))
        if int(vision.get("window_size", 112)) != 112:  # llama.cpp's default; it reads no key
            w.add_vision_window_size(int(vision["window_size"]))
        tensors = {theirs: visual[ours] for ours, theirs in qwen25_mmproj_names(depth).items()}
        for i in range(depth):
            for p in ("weight", "bias"):
                q, k, v = visual[f"blocks.{i}.attn.qkv.{p}"].chunk(3)
                for name, t in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
                    tensors[f"v.blk.{i}.{name}.{p}"] = t
    else:
        w.add_vision_image_size(int(math.isqrt(int(vision["num_position_embeddings"])) * patch))
        w.add_vision_use_gelu(True)
        tensors = {theirs: visual[ours] for ours, theirs in mmproj_names(depth).items()}
    conv = visual["patch_embed.proj.weight"]  # [E, C, 2, p, p]
    if conv.shape[2] != 2:
        raise ValueError("llama.cpp's mmproj holds a temporal patch of 2 as two slices")
    tensors["v.patch_embd.weight"] = conv[:, :, 0]
    tensors["v.patch_embd.weight.1"] = conv[:, :, 1]
    _write_tensors(w, tensors, qtype, lambda name, v: v.ndim == 2 and "position_embd" not in name)
    return path


def _write_gemma4_mmproj(
    path: Path,
    config: dict[str, Any],
    preprocessor: dict[str, Any],
    state: dict[str, Tensor],
    qtype: str,
) -> Path:
    """`write_mmproj` for Gemma 4 (llama.cpp's `Gemma4VisionAudioModel`): the tower's names
    under `v.`, the embedder's projection `mm.input_projection`, the position table F32, the
    clipped projections' bounds as 1-element tensors."""
    vision, text = config["vision_config"], config["text_config"]
    depth, width = int(vision["num_hidden_layers"]), int(vision["hidden_size"])
    ours = {
        k[len("model.vision_tower.") :]: v
        for k, v in state.items()
        if k.startswith("model.vision_tower.")
    }
    ours |= {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.embed_vision.")}
    clipped, standardize = bool(vision.get("use_clipped_linears")), bool(vision.get("standardize"))
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_projector_type(GEMMA4V_PROJECTOR)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(int(text["hidden_size"]))
    w.add_vision_patch_size(int(vision["patch_size"]))
    w.add_vision_embedding_length(width)
    w.add_vision_feed_forward_length(int(vision["intermediate_size"]))
    w.add_vision_block_count(depth)
    w.add_vision_head_count(int(vision["num_attention_heads"]))
    w.add_vision_attention_layernorm_eps(float(vision.get("rms_norm_eps", 1e-6)))
    w.add_vision_image_size(224)  # the converter's placeholder: llama.cpp sizes images itself
    w.add_vision_projector_scale_factor(int(vision.get("pooling_kernel_size", 3)))
    plain = preprocessor.get("do_normalize") is False
    w.add_vision_image_mean([0.0] * 3 if plain else list(preprocessor.get("image_mean", [0.0] * 3)))
    w.add_vision_image_std([1.0] * 3 if plain else list(preprocessor.get("image_std", [1.0] * 3)))
    names = gemma4_mmproj_names(depth, clipped, standardize)
    tensors = {
        theirs: ours[name].reshape(-1) if ours[name].ndim == 0 else ours[name]
        for name, theirs in names.items()
    }
    proj = ours["patch_embedder.input_proj.weight"]  # [E, p p 3] -> the Conv2d [E, 3, p, p]
    p = int(vision["patch_size"])
    tensors["v.patch_embd.weight"] = proj.reshape(width, p, p, 3).permute(0, 3, 1, 2).contiguous()
    _write_tensors(w, tensors, qtype, lambda name, v: v.ndim == 2 and "position_embd" not in name)
    return path


def window_pattern(full: list[int]) -> int:
    """llama.cpp's `n_wa_pattern` for Qwen2.5-VL's full-attention blocks: every n-th block
    (7, 15, 23, 31 -> 8); a pattern it cannot express is refused, as its converter does."""
    n = full[0] + 1
    if any(b - a != n for a, b in itertools.pairwise(full)):
        raise ValueError(f"fullatt_block_indexes {full} are not every {n}th block")
    return n


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers whose attn_v / ffn_down go up to Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


_VALUES = ("attn_v.weight", "attn_qkv.weight")  # llama.cpp counts these together
# llama.cpp's types for rows that are not whole 256-value blocks (tensor_type_fallback)
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def q4_k_m_type(
    name: str,
    shape: tuple[int, ...],
    blocks: int,
    tied: bool = False,
    values: tuple[int, int] | None = None,
) -> str:
    """The type llama.cpp's quantizer gives tensor `name` in a Q4_K_M file of `blocks` blocks
    (as it typed every tensor of the cut files): routers, norms, conv and decay F32; the head
    Q6_K; attn_v / attn_qkv and every ffn_down Q6_K on _use_more_bits' layers; the rest Q4_K.
    `tied` (no output.weight): the token tables (per-layer ones too) take the head's Q6_K, and
    Gemma's per-layer model projection stays as the source has it (F32 here). `values`: this
    attn_v / attn_qkv tensor's place among the file's and their number, where some layers
    have none (`q4_k_m_types`); by default its layer of `blocks`. Rows that are not whole
    256-value blocks fall back as llama.cpp's do: Q4_K to Q5_0, Q6_K to Q8_0 (32-value
    blocks), F16 where even those do not fit."""
    if len(shape) == 1 or name.endswith("ffn_gate_inp.weight") or "ssm_conv1d" in name:
        return "F32"
    if name == "per_layer_model_proj.weight":
        return "F32"
    kind = _k_type(name, shape, blocks, tied, values)
    if shape[-1] % 256 == 0:
        return kind
    return _FALLBACK[kind] if shape[-1] % 32 == 0 else "F16"


def _k_type(
    name: str,
    shape: tuple[int, ...],
    blocks: int,
    tied: bool,
    values: tuple[int, int] | None,
) -> str:
    if name == "output.weight" or (tied and name.endswith("token_embd.weight")):
        return "Q6_K"
    if name == "token_embd.weight" or not name.startswith("blk."):
        return "Q4_K"
    layer, kind = int(name.split(".")[1]), name.split(".", 2)[2]
    if kind in _VALUES:
        return "Q6_K" if _use_more_bits(*(values or (layer, blocks))) else "Q4_K"
    return "Q6_K" if kind.startswith("ffn_down") and _use_more_bits(layer, blocks) else "Q4_K"


def q4_k_m_types(
    shapes: dict[str, tuple[int, ...]], blocks: int, tied: bool = False
) -> dict[str, str]:
    """`q4_k_m_type` of every tensor of a file (names in file order): llama.cpp places the
    n-th attn_v / attn_qkv tensor it meets by n over their number, which is the layer only
    where every layer has one (Gemma 4's KV-sharing layers have none)."""
    found = [n for n in shapes if n.startswith("blk.") and n.split(".", 2)[2] in _VALUES]
    place = {n: (i, len(found)) for i, n in enumerate(found)}
    return {n: q4_k_m_type(n, s, blocks, tied, place.get(n)) for n, s in shapes.items()}


# |d| (and dmin) per format for random blocks of zero-mean weights of ~0.05
_D = {"Q4_K": (2e-4, 1.5e-3), "Q6_K": (2e-5, 0.0), "Q5_0": (6e-3, 0.0), "Q8_0": (7e-4, 0.0)}


def random_chunks(name: str, shape: tuple[int, ...], qtype: str) -> Iterator[np.ndarray]:
    """Random data for `name`: valid blocks of `qtype` (random quants and sub-block scales,
    fp16 scales of a fixed magnitude) ~64 MB at a time, or F32 values fit for their role."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if qtype == "F32":
        n = int(np.prod(shape))
        if name.endswith("ssm_a"):
            yield -np.exp(rng.uniform(-1, 1, n)).astype(np.float32)
        elif name.endswith("ssm_dt.bias"):
            yield rng.uniform(0, 1, n).astype(np.float32)
        elif "norm" in name:
            yield (1 + rng.uniform(-0.1, 0.1, n)).astype(np.float32)
        else:  # routers, the shared expert's gate, conv
            yield (rng.standard_normal(n) * shape[-1] ** -0.5).astype(np.float32)
        return
    if qtype == "F16":
        yield (rng.standard_normal(int(np.prod(shape))) * 0.05).astype(np.float16)
        return
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    per_row = k // block * block_bytes
    d, dmin = _D[qtype]
    at = 208 if qtype == "Q6_K" else 0
    for r0 in range(0, rows, max(1, (64 << 20) // per_row)):
        n = min(rows - r0, max(1, (64 << 20) // per_row))
        raw = rng.integers(0, 256, (n, k // block, block_bytes), dtype=np.uint8)
        raw[..., at : at + 2] = np.array([d], np.float16).view(np.uint8)
        if dmin:
            raw[..., 2:4] = np.array([dmin], np.float16).view(np.uint8)
        yield raw
