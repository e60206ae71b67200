"""Causal grouped-query attention of the new queries of one sequence over its KV cache.

Contract: `attend(q [n, H, d], k [Hkv, S, d], v [Hkv, S, d], start, scale, window=0)
-> [n, H * d]`: query i (at position p = start + i) of head h attends to keys 0 .. p of kv head
h / (H / Hkv); with `window` > 0 (a sliding-window layer) to keys max(0, p - window + 1) .. p
only, so a row's keys depend on its own position, never on the call's other rows.
Every call the C++ kernel accepts runs it (attention.cpp: fp32 math, and a row's
result depends only on its own query and keys, not on n or start's split: a row of a verify,
of a prompt chunk or of a whole prompt equals the same row of a decode step bit for bit); the
rest (head sizes not a multiple of 32, mixed dtypes, no extension) run `reference_attend`
(SDPA), which is not batch-invariant. k and v may also be `Paged`: a sequence whose first keys
are blocks the prefix cache shares, read where they lie (`attend_paged`: the kernel takes a row
pointer per key, so a row's arithmetic, and its bits, are those of the same keys in one tensor).
The kernel has two tiles (`TILES`, the extension's
`attend_isa` level): AVX2 everywhere, and AVX-512 where the CPU has AVX512_BF16 (bf16 scores
by vdpbf16ps, 16-lane fp32 elsewhere; attention_avx512.cpp), picked at run time. Each holds
the contract on its own; the two differ from each other by fp32 rounding, as any two
summation orders do, so one machine's outputs are reproducible on the same tile only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.kernels.build import extension, runnable

# The kernel's tiles by the extension's `attend_isa` level, and the CPU flags each needs.
TILES = {"avx2": 0, "avx512": 1}
TILE_FLAGS = {
    "avx2": frozenset(),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
}


def cpu_tiles() -> list[str]:
    """The tiles this CPU's flags allow, slowest first."""
    return runnable(TILE_FLAGS)


@dataclass(frozen=True)
class Paged:
    """One layer's keys (or values) of a sequence: its first `len(blocks) x block` in shared
    blocks, then its own rows. `blocks`: `[layers, kv_heads, block, head_dim]` tensors (rows
    contiguous, any layer and head strides: a block may be a token range of a larger tensor),
    read at `layer`, never written; `addresses`: their `page_table` (the tensors stay alive
    through `blocks`); `own`: `[kv_heads, S, d]`."""

    blocks: Sequence[Tensor]
    addresses: Tensor
    block: int
    layer: int
    own: Tensor

    @property
    def shared(self) -> int:
        return len(self.blocks) * self.block

    def dense(self) -> Tensor:
        """The same keys as one `[kv_heads, shared + S, d]` tensor (a copy)."""
        return torch.cat([b[self.layer] for b in self.blocks] + [self.own], dim=1)


def page_table(blocks: Sequence[Tensor]) -> Tensor:
    """The kernel's page table of `blocks`: int64 `[P, 3]`, per block its data address and its
    layer and head strides in elements."""
    return torch.tensor(
        [[b.data_ptr(), b.stride(0), b.stride(1)] for b in blocks], dtype=torch.int64
    ).view(len(blocks), 3)


def pageable(block: Tensor, head_dim: int) -> bool:
    """A block `[layers, kv_heads, tokens, head_dim]` the kernel reads in place: its rows of
    one layer and head lie `head_dim` elements apart."""
    return block.stride(3) == 1 and block.stride(2) == head_dim


def paged_kernel(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `attend` reads `Paged` keys of this shape in place (else it gathers them)."""
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and head_dim % 32 == 0
        and extension() is not None
    )


def attend(
    q: Tensor,
    k: Tensor | Paged,
    v: Tensor | Paged,
    start: int,
    scale: float,
    window: int = 0,
    sinks: Tensor | None = None,
    ends: Tensor | None = None,
) -> Tensor:
    """Causal grouped-query attention of n new queries at positions [start, start + n).

    q `[n, heads, head_dim]`; k, v `[kv_heads, start + n, head_dim]` -> `[n, heads * head_dim]`:
    query i sees keys 0 .. start + i (window 0), or the last `window` of them. `sinks` (fp32
    `[heads]`, gpt-oss): each head's softmax also counts a key of score sinks[h] and value 0,
    which every query sees whatever the window (HF's `s_aux`). `ends` (int64 `[n]`, each in
    [start + i + 1, start + n]): query i sees keys up to ends[i] - 1, past its own position
    (Gemma 4's image rows, which see their whole image); the window's start stays its
    position's. The C++
    kernel (kernels/attention.cpp: fp32 math, rows independent of n) when it accepts the
    inputs, else `reference_attend` (SDPA). Prompt chunks take the kernel too: it is
    batch-invariant and, measured with bench-sized shapes (12 heads over 2 kv heads, d 128,
    bf16, this 2-core host), 2x faster than SDPA at 64-1024 causal queries.
    """
    ext = extension() if q.is_cpu else None
    if isinstance(k, Paged) or isinstance(v, Paged):
        assert isinstance(k, Paged) and isinstance(v, Paged), "keys and values alike"
        if ext is not None and ext.attend_eligible(q, k.own, v.own, start, k.shared):
            pages = (k.addresses, v.addresses, k.block, k.layer)
            paged: Tensor = ext.attend_paged(
                q, k.own, v.own, *pages, start, scale, window, sinks, ends
            )
            return paged
        return reference_attend(q, k.dense(), v.dense(), start, scale, window, sinks, ends)
    if ext is not None and ext.attend_eligible(q, k, v, start):
        out: Tensor = ext.attend(q, k, v, start, scale, window, sinks, ends)
        return out
    return reference_attend(q, k, v, start, scale, window, sinks, ends)


def reference_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: int,
    scale: float,
    window: int = 0,
    sinks: Tensor | None = None,
    ends: Tensor | None = None,
) -> Tensor:
    """`attend` by torch's SDPA. The query heads sharing a kv head are folded into the
    query-row dimension (`[1, kv_heads, group * n, d]`): SDPA then takes its fast fused CPU
    kernel in bf16 as well (its enable_gqa and per-head bmm paths are 4-20x slower here) and the
    cache is never repeated. With `sinks` the softmax is spelled out instead (`_sink_attend`)."""
    if sinks is not None:
        return _sink_attend(q, k, v, start, scale, window, sinks, ends)
    n, heads, d = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    qg = q.view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, d)
    mask = None
    if n > 1 or (window and k.shape[1] > window):
        # row (g, i) is query i at absolute position start + i: it sees keys 0..start + i
        # (the last `window` of them in a sliding-window layer)
        mask = _mask(n, k.shape[1], start, window, ends, q.device).repeat(group, 1)
    out = F.scaled_dot_product_attention(qg, k[None], v[None], attn_mask=mask, scale=scale)
    return out[0].view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)


def _mask(
    n: int, keys: int, start: int, window: int, ends: Tensor | None, device: torch.device
) -> Tensor:
    """`[n, keys]`: which keys query i (position start + i) sees (`attend`'s contract)."""
    rows = torch.arange(n, device=device)[:, None] + start
    cols = torch.arange(keys, device=device)[None, :]
    last = rows if ends is None else ends.to(device)[:, None] - 1
    mask = cols <= last
    if window:
        mask &= cols > rows - window
    return mask


def _sink_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: int,
    scale: float,
    window: int,
    sinks: Tensor,
    ends: Tensor | None = None,
) -> Tensor:
    """`attend` with sinks spelled out in fp32: scores, the sink as one more column, softmax,
    the sink's column dropped (transformers' eager gpt-oss attention)."""
    n, heads, d = q.shape
    group = heads // k.shape[0]
    kf = k.float().repeat_interleave(group, dim=0)  # [heads, S, d]
    vf = v.float().repeat_interleave(group, dim=0)
    scores = torch.einsum("nhd,hsd->hns", q.float(), kf) * scale  # [heads, n, S]
    mask = _mask(n, k.shape[1], start, window, ends, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(heads, 1, 1).expand(heads, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("hns,hsd->nhd", probs, vf)
    return out.reshape(n, heads * d).to(q.dtype)
