"""Run a Qwen3-MoE, hybrid Qwen3-Next / Qwen3.5 / Qwen3.5-MoE or gpt-oss GGUF on its own quantized
weights (`--dtype gguf`): the GEMM operands (attention, Gated DeltaNet in/out projections,
dense and shared-expert MLPs, every routed expert, the head, the MTP head's fc and layer) stay
in their block formats as `GGUFWeight`s, and the embedding table in its own (`GGUFEmbedding`,
which the MTP head embeds through too); the small tensors (norms, conv, A, dt, routers) are
dequantized through the converter's own plan (hub/gguf_qwen.py, hub/gguf_gpt_oss.py), which
also checks every tensor's presence and shape. gpt-oss's biases (q/k/v, o, every expert's) are
read as vectors beside their operands.

What llama.cpp's converter did to an operand is undone without touching its blocks: row
orders (Qwen3.5's tiled value heads in qkv / z / b / a; Qwen3-Next's [b, a] groups) reorder
whole rows; Qwen3-Next's q/k/v and z come as llama.cpp split them, so the model is built with
Qwen3.5's split in-projection layout; the one column reorder (Qwen3.5's out_proj, tiled value
heads) is left in the blocks and the layer gathers its heads into that order instead
(`GatedDeltaNet.out_heads`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from quickdraft.config import ModelConfig
from quickdraft.hub.gguf_gemma4 import gemma4_plan
from quickdraft.hub.gguf_gpt_oss import gpt_oss_plan
from quickdraft.hub.gguf_qwen import QWEN_ARCHS, Planned, qwen_plan
from quickdraft.kernels.gemm import Weight
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.models.families.gpt_oss import GptOssAttention, GptOssLayer, GptOssLM, GptOssMoE
from quickdraft.models.families.hybrid_config import HybridConfig
from quickdraft.models.families.llama import MLP, Attention, CausalLM, DecoderLayer
from quickdraft.models.families.moe import Experts, GatedMLP, RoutedMoE, SparseMoE
from quickdraft.models.families.qwen3_next import (
    GatedAttention,
    GatedDeltaNet,
    HybridDecoderLayer,
    HybridLM,
)
from quickdraft.models.formats.gguf_loader import GGUFFile, GGUFTensorError
from quickdraft.models.formats.packed_copy import PACKED_NAME, packed_or_built
from quickdraft.models.heads.mtp import MTPHead, hybrid_mtp_parts
from quickdraft.models.layers import GGUFEmbedding, release_fused_

log = logging.getLogger(__name__)

# the HF model_types of the files this loader runs
QWEN_TYPES = (*(t for _, t in QWEN_ARCHS.values()), "gpt_oss")
# experts repacked between two releases of their file pages: a 256-expert layer (~0.5 GB in
# Q4_K) would otherwise sit in memory twice, mapped and repacked, until its last expert
RELEASE_EVERY = 16
# HF tensors that become GEMM operands here, from the GGUF's blocks: q/k/v/o, in_proj_*,
# out_proj, gate/up/down (dense, shared expert, routed experts), the heads (the plan's other
# tensors are dequantized into parameters)
_OPERAND = re.compile(r"_proj|^lm_head\.|^mtp\.fc\.")


class PlanLoader:
    """A GGUF file read through its converter's plan (hub/): operands from the blocks, the
    other tensors dequantized into parameters (also Gemma 4's,
    models/formats/gguf_gemma4_loader.py)."""

    def __init__(self, file: Path, cfg: HybridConfig | ModelConfig, dtype: torch.dtype) -> None:
        self.f = GGUFFile(file, permute=False)
        self.arch = str(self.f.reader.fields["general.architecture"].contents())
        self.cfg, self.dtype = cfg, dtype
        shapes = {n: tuple(int(d) for d in reversed(t.shape)) for n, t in self.f.tensors.items()}
        try:
            if self.arch == "gpt-oss":
                plan = gpt_oss_plan(shapes, cfg.extra)
            elif self.arch == "gemma4":
                plan = gemma4_plan(shapes, cfg.extra)
            else:
                plan = qwen_plan(shapes, self.arch, cfg.extra)
        except Exception as e:  # HubError: a tensor missing, misshapen or left over
            raise GGUFTensorError(f"{file.name}: {e}") from e
        self.plan: dict[str, Planned] = {p.name: p for p in plan}

    def built(self, name: str) -> Tensor:
        """HF tensor `name` dequantized and rebuilt by the plan, fp32."""
        from gguf.quants import dequantize

        item, parts = self.plan[name], []
        for source in item.sources:
            t = self.f.get(source)
            arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
            parts.append(torch.from_numpy(arr).reshape([int(d) for d in reversed(t.shape)]))
        return item.build(parts)

    def fill(
        self, module: nn.Module, prefix: str, skip: str = "", operands: re.Pattern[str] = _OPERAND
    ) -> set[str]:
        """Every HF tensor under `prefix` (but `skip` and the `operands`) into `module`'s
        parameter of that name; returns the names filled."""
        filled = set()
        with torch.no_grad():
            for name in self.plan:
                if name == skip or (prefix == "" and name.startswith("mtp.")):
                    continue  # mtp.*: the MTP head's, loaded with it (load_gguf_mtp_head)
                if name.startswith(prefix) and not operands.search(name):
                    param = module.get_parameter(name[len(prefix) :])
                    param.copy_(self.built(name).reshape(param.shape))
                    filled.add(name[len(prefix) :])
        return filled

    def operand(self, parts: Sequence[tuple[str, int, int | np.ndarray]], k: int) -> Weight:
        return self.f.operand(parts, k, self.dtype)

    def attention(self, attn: GatedAttention | Attention, blk: str) -> None:
        """q (with the hybrids' output gate rows) / k / v fused, and o, as stored."""
        cfg = self.cfg
        d, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q_rows = (2 if isinstance(attn, GatedAttention) else 1) * heads * d
        qkv = [(blk + "attn_q.weight", q_rows, 0), (blk + "attn_k.weight", kv * d, 0)]
        qkv.append((blk + "attn_v.weight", kv * d, 0))
        attn.qkv = self.operand(qkv, cfg.hidden_size)
        attn.o = self.operand([(blk + "attn_output.weight", cfg.hidden_size, 0)], heads * d)

    def gated_delta_net(self, gdn: GatedDeltaNet, blk: str) -> None:
        cfg = self.cfg
        assert isinstance(cfg, HybridConfig) and not gdn.interleaved
        nk, nv, dk, dv = gdn.k_heads, gdn.v_heads, gdn.dk, gdn.dv
        per_v, key_dim, value_dim = nv // nk, nk * dk, nv * dv
        if self.f.has(blk + "ssm_in.weight"):
            raise GGUFTensorError(
                f"{self.f.path.name}: {blk}ssm_in.weight (an older Qwen3-Next layout) runs "
                "dequantized only: load with --dtype bf16"
            )
        if self.arch == "qwen3next":  # value heads grouped per key head, as in HF
            v_rows = np.arange(value_dim)
            heads = np.arange(nv)
            # ssm_ba holds [b (per_v), a (per_v)] per key head: take all b rows, then all a
            group = np.arange(nk)[:, None] * 2 * per_v + np.arange(per_v)[None, :]
            b = [(blk + "ssm_ba.weight", 2 * nv, group.reshape(-1))]  # (rows the file holds)
            a = [(blk + "ssm_ba.weight", 2 * nv, (group + per_v).reshape(-1))]
        else:  # llama.cpp tiled the value heads (v0 of every key head, v1 ...): regroup
            heads = (np.arange(per_v)[None, :] * nk + np.arange(nk)[:, None]).reshape(-1)
            v_rows = (heads[:, None] * dv + np.arange(dv)[None, :]).reshape(-1)
            b = [(blk + "ssm_beta.weight", nv, heads)]
            a = [(blk + "ssm_alpha.weight", nv, heads)]
            # out_proj's columns stay tiled: the layer hands it its heads in that order
            gdn.out_heads = torch.from_numpy(np.argsort(heads))
        qkv_rows = np.concatenate([np.arange(2 * key_dim), 2 * key_dim + v_rows])
        gdn.inp = self.operand(
            [
                (blk + "attn_qkv.weight", 2 * key_dim + value_dim, qkv_rows),
                (blk + "attn_gate.weight", value_dim, v_rows),
                *b,
                *a,
            ],
            cfg.hidden_size,
        )
        gdn.out = self.operand([(blk + "ssm_out.weight", cfg.hidden_size, 0)], value_dim)

    def mlp(self, mlp: nn.Module, blk: str, shared: str = "") -> None:
        """A dense MLP (`ffn_gate{shared}` ...), routed experts, or both plus the shared gate."""
        hidden = self.cfg.hidden_size
        if isinstance(mlp, GatedMLP | MLP):
            inter = mlp.inter
            mlp.gate_up = self.operand(
                [
                    (f"{blk}ffn_gate{shared}.weight", inter, 0),
                    (f"{blk}ffn_up{shared}.weight", inter, 0),
                ],
                hidden,
            )
            mlp.down = self.operand([(f"{blk}ffn_down{shared}.weight", hidden, 0)], inter)
            return
        assert isinstance(mlp, RoutedMoE | SparseMoE)
        self.experts(mlp.experts, blk)
        if isinstance(mlp, SparseMoE):
            self.mlp(mlp.shared_expert, blk, "_shexp")
            gate = self.built(f"{self.hf_prefix(blk)}mlp.shared_expert_gate.weight")  # [1, H]
            mlp.shared_gate = gate.to(self.dtype)

    def stacks(self, blk: str, n: int, inter: int) -> tuple[list[Weight], list[Weight]]:
        """Each of the `n` experts' gate + up rows and down rows as its own operands
        (GGUFWeights; model-dtype tensors from an unquantized file), from `ffn_gate_exps` and
        `ffn_up_exps` or one `ffn_gate_up_exps` (Gemma 4's), the file's pages of them released
        once repacked."""
        hidden = self.cfg.hidden_size
        fused = self.f.has(f"{blk}ffn_gate_up_exps.weight")
        rows = {"gate_up": 2 * inter} if fused else {"gate": inter, "up": inter}
        stacks = []  # (type, [n, rows, row bytes]) of the gate / up parts, then of down
        for part, count in (*rows.items(), ("down", hidden)):
            t = self.f.get(f"{blk}ffn_{part}_exps.weight")
            stacks.append((t.tensor_type.name, np.asarray(t.data).reshape(n, count, -1)))
        *parts, (down_t, down) = stacks
        gate_ups: list[Weight] = []
        downs: list[Weight] = []
        names = [f"{blk}ffn_{part}_exps.weight" for part in (*rows, "down")]
        for e in range(n):
            if e and e % RELEASE_EVERY == 0:  # the experts repacked so far: drop their pages
                for name, (_, stack) in zip(names, stacks, strict=True):
                    per = stack[0].nbytes
                    self.f.release(name, (e - RELEASE_EVERY) * per, e * per)
            if {kind for kind, _ in stacks} <= {"F32", "F16", "BF16"}:  # an unquantized file
                gu = np.concatenate([part[e] for _, part in parts]).astype(np.float32)
                gate_ups.append(torch.from_numpy(gu).to(self.dtype))
                downs.append(torch.from_numpy(down[e].astype(np.float32)).to(self.dtype))
                continue
            try:
                gate_ups.append(
                    GGUFWeight.concat(
                        [GGUFWeight.from_raw(kind, part[e], hidden) for kind, part in parts]
                    )
                )
                downs.append(GGUFWeight.from_raw(down_t, down[e], inter))
            except ValueError as err:  # a block format without a kernel
                raise GGUFTensorError(
                    f"{self.f.path.name}: {blk}ffn_*_exps: {err}; load with --dtype bf16"
                ) from err
        for name in names:  # repacked: drop the file's pages from this process
            self.f.release(name)
        return gate_ups, downs

    def experts(self, experts: Experts, blk: str) -> None:
        """Each expert's gate + up rows and down rows as its own GGUFWeights."""
        gate_up, down = self.stacks(blk, experts.gate_up_proj.shape[0], experts.inter)
        experts.operands = list(zip(gate_up, down, strict=True))
        # the stacked parameters are not read any more
        experts.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        experts.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)

    def gpt_oss_layer(self, layer: GptOssLayer, blk: str) -> None:
        """Attention as stored with its q/k/v and o biases; each expert's gate + up rows and
        down rows as its own operands, with their biases."""
        attn, moe = layer.self_attn, layer.mlp
        assert isinstance(attn, GptOssAttention) and isinstance(moe, GptOssMoE)
        self.attention(attn, blk)
        assert attn.qkv_bias is not None and attn.o_bias is not None
        d, kv = self.cfg.head_dim, self.cfg.num_key_value_heads
        sizes = (self.cfg.num_attention_heads * d, kv * d, kv * d)
        biases = zip(("attn_q", "attn_k", "attn_v"), sizes, strict=True)
        attn.qkv_bias.copy_(torch.cat([self.f.vector(f"{blk}{p}.bias", n) for p, n in biases]))
        attn.o_bias.copy_(self.f.vector(blk + "attn_output.bias", self.cfg.hidden_size))
        ex = moe.experts
        n = ex.gate_up_proj.shape[0]
        gate_up, down = self.stacks(blk, n, self.cfg.intermediate_size)
        bias = {
            part: self.f.get(f"{blk}ffn_{part}_exps.bias").data.reshape(n, -1)
            for part in ("gate", "up", "down")
        }
        moe.operands = [
            (
                gate_up[e],
                torch.from_numpy(np.concatenate([bias["gate"][e], bias["up"][e]])).to(self.dtype),
                down[e],
                torch.from_numpy(np.array(bias["down"][e])).to(self.dtype),
            )
            for e in range(n)
        ]
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            setattr(ex, name, nn.Parameter(torch.empty(0), requires_grad=False))

    def hf_prefix(self, blk: str) -> str:
        block = int(blk.split(".")[1])
        layers = self.cfg.num_hidden_layers
        return f"model.layers.{block}." if block < layers else f"mtp.layers.{block - layers}."

    def layer(self, layer: nn.Module, blk: str) -> None:
        assert isinstance(layer, HybridDecoderLayer | DecoderLayer)
        if isinstance(layer, GptOssLayer):
            self.gpt_oss_layer(layer, blk)
            return
        if isinstance(layer, HybridDecoderLayer) and layer.layer_type == "linear_attention":
            self.gated_delta_net(layer.linear_attn, blk)
        else:
            self.attention(layer.self_attn, blk)
        self.mlp(layer.mlp, blk)


def _empty_model(cfg: Any, dtype: torch.dtype) -> nn.Module:
    if cfg.model_type == "gpt_oss":
        return GptOssLM(cfg, dtype)
    if isinstance(cfg, HybridConfig):
        # Qwen3-Next's in_proj_qkvz came split (attn_qkv + attn_gate): run Qwen3.5's layout
        return HybridLM(dataclasses.replace(cfg, interleaved_qkvz=False), dtype)
    return CausalLM(cfg, dtype)


def load_qwen_gguf(file: Path, cfg: Any, dtype: torch.dtype) -> nn.Module:
    """The model of GGUF `file` (config record `cfg` of its converted config.json): from the
    packed copy beside it when there is one (models/formats/packed_copy.py), else repacked from the
    file and that copy written."""
    return packed_or_built(
        file.parent / PACKED_NAME,
        lambda: _empty_model(cfg, dtype),
        lambda: _from_gguf(file, cfg, dtype),
        dtype,
        log,
    )


def _from_gguf(file: Path, cfg: Any, dtype: torch.dtype) -> nn.Module:
    loader = PlanLoader(file, cfg, dtype)
    model = _empty_model(cfg, dtype)
    with torch.no_grad():
        layers = list(model.model.layers)  # type: ignore[union-attr, arg-type]
        for i, layer in enumerate(
            tqdm(layers, desc=f"repacking {file.name}", unit="layer", disable=None)
        ):
            loader.layer(layer, f"blk.{i}.")
        head = "output.weight" if loader.f.has("output.weight") else "token_embd.weight"
        model.head = loader.operand([(head, cfg.vocab_size, 0)], cfg.hidden_size)  # type: ignore[assignment]
        # the table stays in its blocks (an MTP head embeds through this lookup too)
        qtype, table = loader.f.rows("token_embd.weight", (cfg.vocab_size, cfg.hidden_size))
        model.model.embed_tokens = GGUFEmbedding(np.array(table), qtype, cfg.hidden_size, dtype)  # type: ignore[union-attr]
        loader.fill(model, "", skip="model.embed_tokens.weight")
    release_fused_(model)
    return model


def load_gguf_mtp_head(model: nn.Module, file: Path) -> MTPHead:
    """The MTP head of a hybrid GGUF (`blk.{n_layers}`: nextn.* + a full-attention layer),
    sharing `model`'s embedding table and head; its operands in their block formats."""
    cfg = model.config
    assert isinstance(cfg, HybridConfig)
    dtype, device = model.dtype, model.device
    assert isinstance(dtype, torch.dtype) and isinstance(device, torch.device)
    loader = PlanLoader(file, cfg, dtype)
    if cfg.mtp_num_hidden_layers != 1 or "mtp.fc.weight" not in loader.plan:
        raise ValueError(
            f"{file.name} has no MTP head (no mtp.* tensors): a GGUF carries it as "
            f"blk.N.nextn.* tensors with {loader.arch}.nextn_predict_layers = 1; this file "
            f"declares {cfg.mtp_num_hidden_layers}. Use ngram or draft instead"
        )
    parts = hybrid_mtp_parts(cfg, dtype, device)
    embed_tokens = model.get_submodule("model.embed_tokens")
    head = MTPHead(parts, cfg.hidden_size, embed_tokens, model.head, dtype, device)
    with torch.no_grad():
        loader.layer(head.layers[0], f"blk.{cfg.num_hidden_layers}.")
        loader.fill(head, "mtp.")
        head.fc_weight = loader.operand(
            [(f"blk.{cfg.num_hidden_layers}.nextn.eh_proj.weight", cfg.hidden_size, 0)],
            2 * cfg.hidden_size,
        )
    release_fused_(head)
    return head
