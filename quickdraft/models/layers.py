"""Building blocks shared by every model file: RMSNorm, RoPE tables, fused projections, the
conversion of a model's GEMM operands (panels, int8, int4), and a draft model's restricted
vocabulary (`VocabSubset`).

Contract: all functions take packed tokens `[num_tokens, ...]` (no batch dim). Math follows the
Hugging Face reference so that fp32 logits match it to < 1e-4 (tests/test_models.py). The ops
themselves (norms, RoPE, attention, GEMMs) live in quickdraft/kernels/, each beside its
reference.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from quickdraft.images import ImageRows
from quickdraft.kernels.build import extension
from quickdraft.kernels.gemm import Weight, dequantized_rows, panel_rows, project
from quickdraft.kernels.linear_bf16 import PANEL
from quickdraft.kernels.pointwise import add_rms_norm, rms_norm
from quickdraft.models.base import ForwardOutput


class OperandModule(nn.Module):
    """A module whose forward passes the GEMM operands named in `OPERANDS` to `project`;
    `FUSED` names the fused full-precision tensors those operands were made from (see
    `convert_operands_`)."""

    OPERANDS: ClassVar[tuple[str, ...]] = ()
    FUSED: ClassVar[tuple[str, ...]] = ()


class RMSNorm(nn.Module):
    """y = w * x / rms(x)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # One fused pass in fp32 (kernels/pointwise.py): matches HF's explicit fp32 upcast in
        # fp32 and is at least as accurate in bf16.
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """(x + delta, norm(x + delta)) in one pass: the residual add before a pre-norm."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class GGUFEmbedding(nn.Module):
    """An embedding table left in its GGUF format: a lookup dequantizes the rows it reads to
    the model dtype, by the extension's `gguf_rows` where it takes the format (the same bits
    as the gguf package's reference dequantization, which runs the others). `raw` [vocab, row
    bytes] may be a view of the mapped file. The last CACHED_ROWS rows read stay dequantized:
    the gguf package spent 0.1-0.4 ms on each one-token lookup (a decode step, each MTP head
    step), 2-4 % of a SmolLM2 or cut-MoE step."""

    CACHED_ROWS = 4096

    def __init__(self, raw: np.ndarray, qtype: str, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        from gguf import GGMLQuantizationType

        self.raw, self.dim, self.dtype = raw, dim, dtype
        self.qtype = GGMLQuantizationType[qtype]
        self._rows: OrderedDict[int, Tensor] = OrderedDict()  # id -> [dim], least recent first
        self._table: Tensor | None = None  # raw as a tensor, for the kernel

    def dequantize(self, ids: Sequence[int]) -> Tensor:
        """Rows `ids` [n, dim] in the model dtype, dequantized from the file."""
        from gguf.quants import dequantize

        ext = extension()
        if ext is not None and int(self.qtype) in ext.gguf_rows_formats():
            if self._table is None:
                with warnings.catch_warnings():  # a read-only mapping: the kernel only reads
                    warnings.simplefilter("ignore", UserWarning)
                    self._table = torch.from_numpy(self.raw)
            picked = torch.tensor(list(ids), dtype=torch.int64)
            return ext.gguf_rows(self._table, picked, int(self.qtype), self.dim).to(self.dtype)
        rows = self.raw[np.asarray(ids, dtype=np.int64)]
        w = np.asarray(dequantize(rows, self.qtype), dtype=np.float32).reshape(len(rows), self.dim)
        return torch.from_numpy(w).to(self.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        keys = ids.tolist()
        if len(keys) > self.CACHED_ROWS:  # a long prompt chunk: straight from the file
            return self.dequantize(keys)
        cache = self._rows
        missing = [i for i in dict.fromkeys(keys) if i not in cache]
        if missing:
            for i, row in zip(missing, self.dequantize(missing), strict=True):
                cache[i] = row
        for i in keys:
            cache.move_to_end(i)
        while len(cache) > self.CACHED_ROWS:
            cache.popitem(last=False)
        return torch.stack([cache[i] for i in keys])


class LinearView(nn.Module):
    """One HF-named projection whose weight (and bias) are views into a fused tensor, so the
    state_dict keeps HF names while the forward runs one GEMV over the fused weight."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        # nn.Parameter aliases the storage of its argument: copying into it fills the fused tensor.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def fused_projections(
    owner: nn.Module,
    in_features: int,
    outs: dict[str, int],
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, Tensor | None]:
    """Register `owner.<name>` LinearViews for each entry of `outs` and return the fused
    weight `[sum(outs), in_features]` (and bias). Build the model on its final device and
    dtype: `.to()` afterwards would re-allocate the views and break the aliasing."""
    total = sum(outs.values())
    weight = torch.empty(total, in_features, dtype=dtype, device=device)
    fused_bias = torch.zeros(total, dtype=dtype, device=device) if bias else None
    start = 0
    for name, size in outs.items():
        b = None if fused_bias is None else fused_bias[start : start + size]
        owner.add_module(name, LinearView(weight[start : start + size], b))
        start += size
    return weight, fused_bias


def yarn_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any], device: torch.device
) -> tuple[Tensor, float]:
    """YaRN's inverse frequencies and cos / sin factor (transformers' "yarn" rope type, as
    gpt-oss uses it): frequencies with fewer than beta_slow rotations over the original context
    interpolated by `factor`, more than beta_fast kept, a linear ramp between; the factor
    0.1 ln(factor) + 1 unless `attention_factor` (or mscale / mscale_all_dim) says otherwise."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction(scaling.get("beta_fast") or 32)
    high = correction(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(device)  # 1: extrapolate (the original frequency), 0: interpolate
    pos = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep, float(attention)


class Rope:
    """Rotary embedding tables (fp32, HF "default" rope, or "yarn" with `scaling`), grown on
    demand."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        device: torch.device,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        self.attention = 1.0  # cos and sin multiplied by it (YaRN)
        if scaling is not None:
            self.inv_freq, self.attention = yarn_frequencies(head_dim, theta, scaling, device)
        else:
            exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
            self.inv_freq = 1.0 / (theta ** (exps / head_dim))
        # per dtype asked for: cos, sin [size, head_dim] fp32 rounded to it (`_rounded`), grown
        # on demand; rounding is per element, so their gathered rows are the rows rounded, and a
        # model keeps one table, not an unrounded one beside it
        self._tables: dict[torch.dtype, tuple[Tensor, Tensor]] = {}

    def _table(self, need: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        have = self._tables.get(dtype)
        if have is None or have[0].shape[0] < need:
            size = max(need, 256 if have is None else 2 * have[0].shape[0])
            have = self._tables[dtype] = self._rounded(*self._angles(size), dtype)
        return have

    def tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin `[num_tokens, 1, head_dim]` fp32 for `positions` `[num_tokens]`."""
        cos, sin = self._table(int(positions.max()) + 1, dtype)
        return cos[positions, None], sin[positions, None]

    def mrope_tables(
        self,
        positions: Tensor,
        section: Sequence[int],
        dtype: torch.dtype,
        interleaved: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Multimodal RoPE: `positions` `[3, num_tokens]` are the (t, h, w) streams. Qwen3.5's
        interleaved M-RoPE: frequency i reads the h stream where i % 3 == 1 and
        i < 3 section[1], the w stream where i % 3 == 2 and i < 3 section[2], else t; Qwen2-VL's
        (`interleaved=False`): the frequencies in contiguous chunks of `section`, chunk j
        reading stream j % 3. cos, sin `[num_tokens, 1, head_dim]`; a row whose three streams
        are equal gets `tables`' bits."""
        table_cos, table_sin = self._table(int(positions.max()) + 1, dtype)
        half = self.inv_freq.shape[0]
        stream = torch.zeros(half, dtype=torch.long, device=positions.device)
        if interleaved:
            for s, offset in ((1, 1), (2, 2)):
                stream[offset : 3 * section[s] : 3] = s
        else:
            start = 0
            for j, size in enumerate(section):
                stream[start : start + size] = j % 3
                start += size
        cols = torch.arange(half, device=positions.device)
        at = positions[stream].T  # [num_tokens, half]: each frequency's position
        cos, sin = table_cos[at, cols], table_sin[at, cols]
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos[:, None], sin[:, None]

    def with_images(
        self,
        x: Tensor,  # [N, hidden] the rows' token embeddings
        positions: Tensor,  # [N] their plain positions
        images: ImageRows | None,
        section: Sequence[int],  # the model's M-RoPE sections (() = it takes no images)
        dtype: torch.dtype,
        interleaved: bool = True,  # Qwen3.5's M-RoPE layout; False: Qwen2.5-VL's
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """The input of a forward: `x` with the image rows' embeddings in place and the rope
        tables, M-RoPE ones from every row's (t, h, w) position where `images` are given, else
        `tables(positions)` (a text-only forward is the plain one)."""
        if images is None:
            return x, self.tables(positions, dtype)
        if not section:
            raise ValueError("this model takes no image input")
        assert images.positions.shape == (3, x.shape[0])
        x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        return x, self.mrope_tables(images.positions, section, dtype, interleaved)

    def full(self, size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin `[size, head_dim]` fp32 of positions 0 .. size - 1, as `tables` gives them
        (without reading the positions on the host: models/graphs.py builds them once)."""
        return self._rounded(*self._angles(size), dtype)

    def _angles(self, size: int) -> tuple[Tensor, Tensor]:
        t = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention != 1.0:
            return emb.cos() * self.attention, emb.sin() * self.attention
        return emb.cos(), emb.sin()

    @staticmethod
    def _rounded(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # Rounded to the model dtype as HF does, then held in fp32: the fused rope op computes
        # in fp32 and would otherwise convert the tables again in every layer.
        if dtype != torch.float32:
            cos, sin = cos.to(dtype).float(), sin.to(dtype).float()
        return cos, sin


def tapped_layers(
    taps: dict[int, Tensor],  # layer -> its output [N, hidden], for (at least) `order`
    order: Sequence[int],
    num_layers: int,
    final_norm: Callable[[Tensor], Tensor],
) -> Tensor | None:
    """The outputs of the layers `order` lists, stacked `[N, len(order), hidden]` (None for
    none): Hugging Face's output_hidden_states[i + 1], so the last layer's is taken after the
    final norm, as drafters trained on those hidden states saw it."""
    if not order:
        return None
    assert set(order) <= taps.keys(), f"hidden_layers {sorted(order)} past the model's layers"
    last = num_layers - 1
    return torch.stack([final_norm(taps[i]) if i == last else taps[i] for i in order], 1)


def convert_operands_(model: nn.Module, convert: Callable[[Weight], Weight]) -> None:
    """Replace every GEMM operand of `model` in place by `convert(operand)` and free the
    nn.Linear-layout copies. Operands are the attributes each module names in its `OPERANDS`
    (what its forward passes to `project`); once any operand changed, the HF-named LinearView
    weights and the fused tensors a module names in `FUSED` are emptied, so the state_dict is
    not usable afterwards (a tied lm_head's storage lives on in the embedding, which lookups
    read). A convert that changes nothing leaves the model as it was."""
    changed = False
    owners = [m for m in model.modules() if isinstance(m, OperandModule)]
    for module in owners:
        for name in module.OPERANDS:
            old = getattr(module, name)
            new = convert(old)
            changed = changed or new is not old
            setattr(module, name, new)
    if changed:
        release_fused_(model)


def release_fused_(model: nn.Module) -> None:
    """Empty the HF-named LinearView weights and the fused tensors each module names in
    `FUSED`, once the operands the forward reads live elsewhere (packed, quantized, or loaded
    from a GGUF file straight into their own form)."""
    for module in model.modules():
        if isinstance(module, OperandModule):
            for name in module.FUSED:
                setattr(module, name, torch.empty(0))
        if isinstance(module, LinearView):
            module.weight.data = module.weight.new_empty(0)


@dataclass(frozen=True, slots=True)
class VocabSubset:
    """The token ids a restricted head scores: ids [0, keep) (whole 16-row panels of the
    head operand) and `extra_ids` past them (rows in `extra`, model dtype); every other id of
    the `vocab` gets a -inf logit."""

    keep: int
    vocab: int
    extra_ids: Tensor | None  # [E] int64
    extra: Tensor | None  # [E, hidden]

    @property
    def kept(self) -> int:
        return self.keep + (0 if self.extra_ids is None else len(self.extra_ids))

    def logits(self, x: Tensor, head: Weight) -> Tensor:
        """[n, hidden] final-norm rows -> [n, vocab] fp32; `head` holds the first `keep` rows."""
        part = project(x, head).float()
        full = part.new_full((x.shape[0], self.vocab), float("-inf"))
        full[:, : self.keep] = part
        if self.extra_ids is not None and self.extra is not None:
            full[:, self.extra_ids] = project(x, self.extra).float()
        return full


def restrict_head(
    head: Weight, keep: int, extra: Sequence[int], dtype: torch.dtype, copy: bool = True
) -> tuple[Weight, VocabSubset]:
    """A head operand cut to its first `keep` rows (rounded up to a whole panel, in its own
    format, exactly) and the rows of the `extra` ids past them (dequantized to `dtype`); the
    kept panels a copy, or views of `head` (`copy=False`) where the caller keeps it."""
    vocab = head.shape[0]
    keep = min(vocab, -(-keep // PANEL) * PANEL)
    ids = sorted({i for i in extra if keep <= i < vocab})
    rows = dequantized_rows(head, ids).to(dtype) if ids else None
    extra_ids = torch.tensor(ids, device=rows.device) if rows is not None else None
    return panel_rows(head, 0, keep // PANEL, copy), VocabSubset(keep, vocab, extra_ids, rows)


class HeadLogits:
    """The head half of a model class (mixed into CausalLM, HybridLM, Gemma3LM): logits from
    the `head` operand, and the draft models' restricted vocabulary. The class sets `head`,
    `vocab = None` and `dtype`."""

    head: Weight
    vocab: VocabSubset | None
    dtype: torch.dtype

    def restrict_vocab_(self, keep: int, extra: Sequence[int] = ()) -> None:
        """Score only the first `keep` token ids (rounded up to whole 16-row panels) and the ids
        in `extra`; every other id gets a -inf logit. For a draft model: it never proposes those
        ids, which cannot change the output (the target verifies every token, and a draft's
        distribution restricted to a subset is still a valid proposal for rejection sampling),
        and its head shrinks. Call it last: after `pack_` / `quantize_`."""
        self.head, self.vocab = restrict_head(self.head, keep, extra, self.dtype)

    @property
    def vocab_kept(self) -> int | None:
        """Token ids the head scores when restricted (`restrict_vocab_`), else None."""
        return None if self.vocab is None else self.vocab.kept

    def head_outputs(
        self,
        h: Tensor,  # [N, hidden] the last layer's output
        norm: Callable[[Tensor], Tensor],  # the final norm
        num_new: Sequence[int],
        logit_rows: Tensor | None,  # rows of N to score; None: the last row of each sequence
        return_hidden: bool,
        layers: Tensor | None,  # tapped_layers' stack
    ) -> ForwardOutput:
        """The end of a forward whose last layer hands over its output: the final norm (of the
        scored rows only, unless the post-norm hidden of every row is asked for) and logits."""
        if logit_rows is None and any(n != 1 for n in num_new):
            logit_rows = torch.tensor(list(num_new), device=h.device).cumsum(0) - 1
        # still None: one row per sequence, each its last (a decode step), so no gather
        if return_hidden:
            hidden = norm(h)  # [N, hidden] post-norm
            scored = hidden if logit_rows is None else hidden[logit_rows]
            return ForwardOutput(self._logits(scored), hidden, layers)
        return ForwardOutput(
            self._logits(norm(h if logit_rows is None else h[logit_rows])), None, layers
        )

    def _logits(self, x: Tensor) -> Tensor:
        """[n, hidden] final-norm rows -> [n, vocab] fp32 logits."""
        if self.vocab is None:
            return project(x, self.head).float()
        return self.vocab.logits(x, self.head)
