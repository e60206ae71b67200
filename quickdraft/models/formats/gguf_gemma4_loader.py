"""Run a Gemma 4 GGUF on its own quantized weights (`--dtype gguf`): every GEMM operand
(q / k / v per layer shape, o, the dense MLP, each routed expert's gate + up rows and down
rows, the router, the per-layer-embedding projections, the head) stays in its block format as
a `GGUFWeight`, and both embedding tables (the token one and the per-layer one, 262144 rows of
35 x 256 in E2B) stay in the file's blocks as `GGUFEmbedding`s; norms, scales and layer scalars
are dequantized through the converter's plan (hub/gguf_gemma4.py), which also checks every
tensor's presence and shape. A packed copy beside the link (models/formats/packed_copy.py) makes
later starts read one file.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from quickdraft.models.families.gemma4 import DecoderLayer, Gemma4LM
from quickdraft.models.families.gemma4_config import Gemma4Config
from quickdraft.models.formats.gguf_qwen_loader import PlanLoader
from quickdraft.models.formats.packed_copy import PACKED_NAME, packed_or_built
from quickdraft.models.layers import GGUFEmbedding, release_fused_

log = logging.getLogger(__name__)

# HF tensors read as operands (or embedding tables) here; the plan's others fill parameters
_OPERANDS = re.compile(
    r"_proj\.weight$|experts\.|^lm_head\.|embed_tokens|router\.proj\.|per_layer_input_gate\."
    r"|per_layer_projection\.|per_layer_model_projection\."
)


def load_gemma4_gguf(file: Path, cfg: Gemma4Config, dtype: torch.dtype) -> Gemma4LM:
    """The model of GGUF `file` (config record of its converted config.json): from the packed
    copy beside it when there is one, else repacked from the file and that copy written."""
    model = packed_or_built(
        file.parent / PACKED_NAME,
        lambda: Gemma4LM(cfg, dtype),
        lambda: _from_gguf(file, cfg, dtype),
        dtype,
        log,
    )
    assert isinstance(model, Gemma4LM)
    return model


def _layer(loader: PlanLoader, layer: DecoderLayer, blk: str) -> None:
    cfg = loader.cfg
    assert isinstance(cfg, Gemma4Config)
    hidden, attn = cfg.hidden_size, layer.self_attn
    d, heads, kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    qkv = [(blk + "attn_q.weight", heads * d, 0)]
    if attn.own:
        qkv.append((blk + "attn_k.weight", kv * d, 0))
        if not attn.shares_v:
            qkv.append((blk + "attn_v.weight", kv * d, 0))
    attn.qkv = loader.operand(qkv, hidden)
    attn.o = loader.operand([(blk + "attn_output.weight", hidden, 0)], heads * d)
    inter = layer.mlp.down_proj.weight.shape[1]
    mlp = [(blk + "ffn_gate.weight", inter, 0), (blk + "ffn_up.weight", inter, 0)]
    layer.mlp.gate_up = loader.operand(mlp, hidden)
    layer.mlp.down = loader.operand([(blk + "ffn_down.weight", hidden, 0)], inter)
    if layer.ple:
        size = cfg.ple_size
        gate = loader.operand([(blk + "inp_gate.weight", size, 0)], hidden)
        layer.per_layer_input_gate.op = gate
        layer.per_layer_projection.op = loader.operand([(blk + "proj.weight", hidden, 0)], size)
    if layer.moe:
        n = cfg.num_experts
        layer.router.proj.op = loader.operand([(blk + "ffn_gate_inp.weight", n, 0)], hidden)
        loader.experts(layer.experts, blk)  # fused or split gate / up


def _table(loader: PlanLoader, name: str, rows: int, dim: int) -> GGUFEmbedding:
    """A lookup table left in its blocks (a copy: the model holds no view of the mapping)."""
    qtype, table = loader.f.rows(name, (rows, dim))
    return GGUFEmbedding(np.array(table), qtype, dim, loader.dtype)


def _from_gguf(file: Path, cfg: Gemma4Config, dtype: torch.dtype) -> Gemma4LM:
    loader = PlanLoader(file, cfg, dtype)
    model = Gemma4LM(cfg, dtype)
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    with torch.no_grad():
        layers = tqdm(model.decoder_layers, desc=f"repacking {file.name}", disable=None)
        for i, layer in enumerate(layers):
            _layer(loader, layer, f"blk.{i}.")
        head = "output.weight" if loader.f.has("output.weight") else "token_embd.weight"
        model.head = loader.operand([(head, vocab, 0)], hidden)
        inner = model.model
        inner.embed_tokens = _table(loader, "token_embd.weight", vocab, hidden)
        if cfg.ple_size:
            size = cfg.num_hidden_layers * cfg.ple_size
            proj = [("per_layer_model_proj.weight", size, 0)]
            inner.per_layer_model_projection.op = loader.operand(proj, hidden)
            inner.embed_tokens_per_layer = _table(
                loader, "per_layer_token_embd.weight", cfg.ple_vocab, size
            )
        filled = loader.fill(model, "", operands=_OPERANDS)
    release_fused_(model)
    # what the operands replaced is empty now: every other parameter came from the file
    left = [n for n, p in model.named_parameters() if p.numel() and n not in filled]
    assert not left, f"parameters the plan did not fill: {left[:4]}"
    return model
