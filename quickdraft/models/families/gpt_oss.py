"""gpt-oss (Hugging Face `gpt_oss`, GptOssForCausalLM; GGUF `gpt-oss`).

Stage: the target model, the decoder of models/families/llama.py (CausalLM's forward, its packed
rows, KV cache and head) with its own layers. What differs from the Llama family:
- attention sinks: a learned logit per query head joins every row's softmax as a key of value
  0 (kernels/attention.py `sinks`, HF's `s_aux`); q, k, v and o carry biases;
- sliding and full layers alternate (`layer_types`: the even layers see the last
  `sliding_window` keys, 128); the cache keeps every key and `attend` masks by the window per
  query position, as for Gemma 3, so a verify row sees what its decode step sees;
- YaRN RoPE (factor 32 over a 4096-token original context, cos and sin scaled by
  0.1 ln 32 + 1), NEOX rotation;
- every layer's MLP is a top-k MoE: the router (with a bias) picks k of E experts and a
  softmax over the k chosen logits weighs them; an expert is
  down(swiglu_oai(gate_up(x) + b)) + b with g = min(gate, 7), u = clamp(up, -7, 7),
  swiglu_oai = (u + 1) * g * sigmoid(1.702 g). The weighted sum runs in slot order in fp32, so
  a row's result depends on that row only.
Parameter names are Hugging Face's; its experts are stacked `[E, hidden, 2 * inter]` with gate
and up interleaved (columns 2i and 2i + 1): the GEMM operands are their de-interleaved
transposes, made once (`GptOssMoE.operands`), or a GGUF file's own tensors, or the released
checkpoints' own MXFP4 (`*_blocks` / `*_scales`, `mxfp4_experts`) repacked into ggml's MXFP4
blocks, the same values, run by the GGUF kernels.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from quickdraft.config import ModelConfig, read_hf_config
from quickdraft.kernels.gemm import Weight, project
from quickdraft.kernels.linear_gguf import GGUFWeight
from quickdraft.kernels.moe_gguf import grouped_experts, moe_block, reference_experts
from quickdraft.models.families.llama import Attention, CausalLM, DecoderLayer
from quickdraft.models.layers import LinearView, RMSNorm, Rope

SLIDING = "sliding_attention"


@dataclass(frozen=True, slots=True)
class GptOssConfig(ModelConfig):
    sliding_window: int = 0  # keys a local layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer: "sliding_attention" | "full_attention"
    yarn: dict[str, Any] = field(default_factory=dict, compare=False)  # HF's rope_parameters
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    @classmethod
    def from_hf(cls, path: str | Path) -> GptOssConfig:
        return cls.from_dict(*read_hf_config(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], gen: dict[str, Any] | None = None) -> GptOssConfig:
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("yarn", "default"):
            raise ValueError(f"gpt_oss: rope type {kind!r} is not supported")
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 150000.0)))
        plain = {**raw, "rope_parameters": {"rope_theta": theta}, "rope_scaling": None}
        plain["num_experts"] = raw.get("num_local_experts", raw.get("num_experts", 0))
        plain["attention_bias"] = raw.get("attention_bias", True)  # transformers' default
        base = ModelConfig.from_dict(plain, gen)
        n = base.num_hidden_layers
        default = (SLIDING if i % 2 == 0 else "full_attention" for i in range(n))
        types = tuple(raw.get("layer_types") or default)
        if len(types) != n:
            raise ValueError(f"gpt_oss: {len(types)} layer_types for {n} layers")
        return cls(
            **{f.name: getattr(base, f.name) for f in fields(ModelConfig)},
            sliding_window=int(raw.get("sliding_window") or 0),
            layer_types=types,
            yarn=rope if kind == "yarn" else {},
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        )


class GptOssAttention(Attention):
    """Llama's attention (its forward) with an o bias, the per-head sinks and, on local layers,
    a window."""

    def __init__(self, cfg: GptOssConfig, layer_idx: int, dtype: torch.dtype, device: torch.device):
        super().__init__(cfg, layer_idx, dtype, device)
        q_size = self.num_heads * self.head_dim
        self.o_proj = LinearView(
            torch.empty(cfg.hidden_size, q_size, dtype=dtype, device=device),
            torch.zeros(cfg.hidden_size, dtype=dtype, device=device),
        )
        self.o = self.o_proj.weight.detach()
        assert self.o_proj.bias is not None
        self.o_bias = self.o_proj.bias.detach()  # the operand view, as `o` (not a parameter)
        self.sinks = nn.Parameter(
            torch.zeros(self.num_heads, dtype=dtype, device=device), requires_grad=False
        )
        local = cfg.layer_types[layer_idx] == SLIDING
        self.window = cfg.sliding_window if local else 0


def swiglu_oai(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """[N, 2 * inter] (gate columns, then up) -> (u + 1) * g * sigmoid(alpha g) [N, inter],
    g = min(gate, limit), u = clamp(up, -limit, limit), in the input's dtype (HF's order)."""
    inter = gate_up.shape[-1] // 2
    gate = gate_up[:, :inter].clamp(max=limit)
    up = gate_up[:, inter:].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Router(nn.Module):
    def __init__(self, num: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = nn.Parameter(torch.zeros(num, dtype=dtype, device=device), requires_grad=False)


class Experts(nn.Module):
    """HF's stacked expert tensors (the checkpoint's names and layout)."""

    def __init__(
        self, num: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()

        def param(*shape: int) -> nn.Parameter:  # empty: a GGUF load never touches its pages
            return nn.Parameter(
                torch.empty(*shape, dtype=dtype, device=device), requires_grad=False
            )

        self.gate_up_proj = param(num, hidden, 2 * inter)
        self.gate_up_proj_bias = param(num, 2 * inter)
        self.down_proj = param(num, inter, hidden)
        self.down_proj_bias = param(num, hidden)


# per expert: (gate_up [2 inter, hidden] gate rows then up rows, its bias, down, its bias)
ExpertOperands = tuple[Weight, Tensor, Weight, Tensor]


class GptOssMoE(nn.Module):
    def __init__(self, cfg: GptOssConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.top_k, self.alpha, self.limit = (
            cfg.num_experts_per_tok,
            cfg.swiglu_alpha,
            cfg.swiglu_limit,
        )
        self.router = Router(cfg.num_experts, cfg.hidden_size, dtype, device)
        self.experts = Experts(
            cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, dtype, device
        )
        # the GEMM operands per expert; None: made from `experts` on first use (a GGUF
        # model's loader sets them to the file's own tensors)
        self.operands: list[ExpertOperands] | None = None
        # an HF checkpoint's MXFP4 experts as GGUF operands (gate_up per expert, down per
        # expert), joined with the biases on first use; None: made from `experts`
        self.blocks: tuple[list[Weight], list[Weight]] | None = None
        self._grouped: Any = None  # the grouped kernel over `operands` (None: it cannot run)
        self._grouped_for: object = None  # the operand list it was built for
        self._block: Any = None  # the whole block as one call over `_grouped`
        self._block_for: object = None  # the grouped kernel and router it was built for

    def expert_operands(self) -> list[ExpertOperands]:
        if self.operands is None:
            ex = self.experts
            bias = torch.cat([ex.gate_up_proj_bias[:, 0::2], ex.gate_up_proj_bias[:, 1::2]], 1)
            if self.blocks is not None:
                gate_ups, downs = self.blocks
            else:
                gate_up = torch.cat([ex.gate_up_proj[..., 0::2], ex.gate_up_proj[..., 1::2]], 2)
                gate_ups = [g.T.contiguous() for g in gate_up]
                downs = [d.T.contiguous() for d in ex.down_proj]
            self.operands = [
                (gate_ups[e], bias[e].contiguous(), downs[e], ex.down_proj_bias[e])
                for e in range(bias.shape[0])
            ]
        return self.operands

    def grouped_kernel(self) -> Any:
        """The extension's grouped call over GGUF experts (kernels/moe_gguf.py, with the
        biases and this activation), built once per operand list; None where it cannot run."""
        ops = self.expert_operands()
        if self._grouped_for is not ops:
            self._grouped_for = ops
            pairs = [(gate_up, down) for gate_up, _, down, _ in ops]
            biases = (torch.stack([b for _, b, _, _ in ops]), torch.stack([b for *_, b in ops]))
            self._grouped = grouped_experts(
                pairs, ops[0][2].shape[0], biases, (self.alpha, self.limit)
            )
        return self._grouped

    def block(self) -> Any:
        """The routing and the grouped experts as one C++ call (kernels/moe_gguf.py
        `moe_block` with gpt-oss's routing), None where the grouped kernel cannot run."""
        grouped = self.grouped_kernel()
        key = (grouped, self.router.weight, self.router.bias)
        built = self._block_for
        if not isinstance(built, tuple) or any(a is not b for a, b in zip(key, built, strict=True)):
            self._block_for = key
            self._block = moe_block(
                grouped, self.router.weight, self.top_k, False, None, self.router.bias, True
            )
        return self._block

    def forward(self, x: Tensor) -> Tensor:
        """x [N, hidden] -> the weighted sum of each row's k experts [N, hidden]: one call
        when the experts are GGUF blocks (the whole block, else the routing here and the
        grouped experts), else `reference` (the same bits)."""
        block = self.block() if x.is_cpu else None
        if block is not None:
            out: Tensor = block.forward(x)
            return out
        logits = project(x, self.router.weight, self.router.bias)  # [N, E] in x's dtype
        top_value, top_idx = torch.topk(logits, self.top_k, dim=-1)
        weight = torch.softmax(top_value.float(), dim=-1)  # over the k chosen
        grouped = self.grouped_kernel() if x.is_cpu else None
        if grouped is not None:
            routed: Tensor = grouped.forward(x, top_idx, weight)
            return routed
        return self.reference(x, top_idx, weight)

    def reference(self, x: Tensor, top_idx: Tensor, weight: Tensor) -> Tensor:
        """One `project` pair per chosen expert, the weighted sum in slot order in fp32
        (kernels/moe_gguf.py's reference loop with this activation and the biases)."""
        ops = self.expert_operands()
        return reference_experts(
            x,
            top_idx,
            weight,
            [(gate_up, down) for gate_up, _, down, _ in ops],
            partial(swiglu_oai, alpha=self.alpha, limit=self.limit),
            [(b_gate_up, b_down) for _, b_gate_up, _, b_down in ops],
        )


class GptOssLayer(DecoderLayer):
    """DecoderLayer's forward over gpt-oss's attention and MoE."""

    def __init__(self, cfg: ModelConfig, idx: int, dtype: torch.dtype, device: torch.device):
        nn.Module.__init__(self)
        assert isinstance(cfg, GptOssConfig)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = GptOssAttention(cfg, idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = GptOssMoE(cfg, dtype, device)  # type: ignore[assignment]


class GptOssLM(CausalLM):
    LAYER: ClassVar[type[DecoderLayer]] = GptOssLayer

    def __init__(
        self, cfg: GptOssConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(cfg, dtype, device)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, self.device, cfg.yarn or None)


def is_mxfp4(cfg: ModelConfig) -> bool:
    """Whether an HF config's checkpoint holds its experts in MXFP4 (the released gpt-oss)."""
    quant = cfg.extra.get("quantization_config") or {}
    return cfg.model_type == "gpt_oss" and quant.get("quant_method") == "mxfp4"


def hf_mxfp4_blocks(blocks: Tensor, scales: Tensor) -> np.ndarray:
    """An HF checkpoint's MXFP4 rows -> ggml's MXFP4 blocks [rows, nb * 17], the same values.
    HF: `*_blocks` [rows, nb, 16], byte k holding values 2k (low nibble) and 2k + 1 of a block
    of 32; `*_scales` [rows, nb] E8M0, lut[code] * 2^(s - 127). ggml: the exponent byte, then
    byte j holding values j (low) and j + 16, (2 lut[code]) * 2^(e - 128): e = s."""
    b = blocks.numpy()
    v = np.empty((*b.shape[:-1], 32), np.uint8)
    v[..., 0::2], v[..., 1::2] = b & 15, b >> 4
    qs = v[..., :16] | (v[..., 16:] << 4)
    raw = np.concatenate([scales.numpy()[..., None].astype(np.uint8), qs], axis=-1)
    return raw.reshape(raw.shape[0], -1)


Entry = tuple[str, str, Callable[[], Tensor]]  # (file, tensor name, its read)
_PACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+_proj)_(blocks|scales)")


def _mxfp4(blocks: Tensor, scales: Tensor, k: int) -> GGUFWeight:
    return GGUFWeight.from_raw("MXFP4", hf_mxfp4_blocks(blocks, scales), k)


def mxfp4_experts(model: GptOssLM, entries: Iterable[Entry]) -> Iterator[Entry]:
    """`entries` (a checkpoint's tensors) without the experts' MXFP4 `*_blocks` / `*_scales`:
    each projection becomes its experts' MXFP4 GGUF operands as soon as both have been read
    (one tensor's raw blocks in memory at a time); the stacked expert parameters are emptied
    first (they are not filled). A missing or misplaced tensor is named."""
    for layer in model.decoder_layers:
        ex = layer.mlp.experts
        assert isinstance(ex, Experts)
        ex.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        ex.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)
    return _mxfp4_entries(model, entries)


def _mxfp4_entries(model: GptOssLM, entries: Iterable[Entry]) -> Iterator[Entry]:
    cfg = model.config
    widths = {"gate_up_proj": cfg.hidden_size, "down_proj": cfg.intermediate_size}  # in features
    pending: dict[str, Tensor] = {}  # a tensor's blocks or scales, until its pair arrives
    built: dict[int, dict[str, list[Weight]]] = {}  # layer -> projection -> its experts' operands
    for entry in entries:
        m = re.fullmatch(
            r"model\.layers\.(\d+)\.mlp\.experts\.(\w+_proj)_(blocks|scales)", entry[1]
        )
        if m is None:
            yield entry
            continue
        pending[entry[1]] = entry[2]()  # read now: the file closes once it has been walked
        base = entry[1].rsplit("_", 1)[0]
        if base + "_blocks" not in pending or base + "_scales" not in pending:
            continue
        blocks, scales = pending.pop(base + "_blocks"), pending.pop(base + "_scales")
        at, proj = int(m[1]), m[2]
        if proj not in widths or at >= len(model.decoder_layers):
            raise ValueError(f"MXFP4 tensor {entry[1]!r} has no place in the model")
        k = widths[proj]
        rows = 2 * cfg.intermediate_size if proj == "gate_up_proj" else cfg.hidden_size
        want = (cfg.num_experts, rows, k // 32)
        if tuple(blocks.shape) != (*want, 16) or tuple(scales.shape) != want:
            raise ValueError(
                f"{entry[0]}: {base}_blocks / _scales are {tuple(blocks.shape)} / "
                f"{tuple(scales.shape)}; the config implies {(*want, 16)} / {want}"
            )
        ops: list[Weight] = []
        for e in range(blocks.shape[0]):
            if proj == "gate_up_proj":  # rows 2i gate, 2i + 1 up
                parts = [_mxfp4(blocks[e, j::2], scales[e, j::2], k) for j in (0, 1)]
                ops.append(GGUFWeight.concat(parts))
            else:
                ops.append(_mxfp4(blocks[e], scales[e], k))
        built.setdefault(at, {})[proj] = ops
        del blocks, scales
    for i, layer in enumerate(model.decoder_layers):
        got = built.get(i, {})
        for proj in widths:
            if proj not in got:
                missing = f"model.layers.{i}.mlp.experts.{proj}"
                have = [n for n in pending if n.startswith(missing)]
                part = "scales" if have and have[0].endswith("_blocks") else "blocks"
                raise ValueError(f"the MXFP4 checkpoint lacks {missing}_{part}")
        moe = layer.mlp
        assert isinstance(moe, GptOssMoE)
        moe.blocks = (got["gate_up_proj"], got["down_proj"])
