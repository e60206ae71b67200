# ~420 lines on purpose: the padded forward, its two op paths and the graphs that replay it
# share one layout contract; split apart, each part would restate the others' shapes.
"""A dense model on a GPU: every sequence's KV in one slot of a static pool, and the forwards of
decode, verify and draft steps replayed as CUDA graphs.

At batch 1 a small model on a GPU is launch-bound: a 1.5B forward is hundreds of kernels, and
eager PyTorch spends more time issuing them than the GPU spends running them. A CUDA graph
issues them all at once, but replays fixed addresses and shapes. So `GraphModel` keeps the KV
of every sequence in one pool `[layers, slots + 1, kv_heads, capacity, head_dim]` (the last
slot is scratch), and a forward takes its varying parts as tensors: the new tokens, each row's
slot and position, each sequence's slot.

A call is padded to a captured shape (`graph_key`): sequences to a power of two, rows per
sequence to the next entry of `ROW_BUCKETS`, keys to a power of two (not with the Triton
kernels, whose attention reads each row's key count on the device). Padded rows write their
KV into the scratch slot. Each shape is captured the first time it runs. Prompt chunks and
hidden-state reads run the same forward eagerly, unpadded; off CUDA it always runs eagerly,
which is what the CPU tests check against the model's own forward. Where triton runs
(kernels/triton_ops.py) a layer is ~10 launches; with torch's ops, 19.

The pool (models/caches/slot_cache.py) grows by reallocation; captured graphs hold its old
addresses, so growth drops them and the shapes are captured again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.kernels import triton_gguf, triton_ops
from quickdraft.kernels.gemm import project
from quickdraft.kernels.pointwise import rope_rows, signed_sin
from quickdraft.kernels.triton_gguf import DeviceGGUFWeight
from quickdraft.models.base import ForwardOutput, ImageRows, refuse_images
from quickdraft.models.caches.slot_cache import SlotCache, SlotPool
from quickdraft.models.families.llama import MLP, Attention, CausalLM, DecoderLayer
from quickdraft.models.layers import RMSNorm, tapped_layers

# rows per sequence a captured forward takes (a call is padded up to the next one): decode 1,
# a verify of k drafts k + 1, a draft model's catch-up 2-3
ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 17, 20, 24, 32)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_KEYS = 256  # the smallest key-count bucket
FIRST_SLOTS = 4  # the pool's first size (it doubles as sequences arrive)
FIRST_CAPACITY = 4096


def _bucket(n: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def key_bucket(need: int, capacity: int) -> int:
    """Keys a captured forward attends to: the power of two >= `need` (>= MIN_KEYS), at most
    the slot capacity."""
    size = MIN_KEYS
    while size < need:
        size *= 2
    return min(size, capacity)


@dataclass(frozen=True, slots=True)
class Layout:
    """A forward's padded shape: `batch` sequences of `rows` rows each, attending to the first
    `keys` positions of their slots."""

    batch: int
    rows: int
    keys: int


@dataclass(slots=True)
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    ids: Tensor  # [batch * rows] static inputs ...
    meta: Tensor  # [2 * batch * rows + batch]: row slots, row positions, sequence slots
    logits: Tensor  # ... and the static output [batch * rows, vocab] (a chain's: picks)


def graph_key(num_new: Sequence[int], need: int, capacity: int) -> Layout | None:
    """The captured shape a call of `num_new` rows per sequence, attending to `need` keys at
    most, is padded to; None where none fits (it then runs eagerly)."""
    batch = _bucket(len(num_new), BATCH_BUCKETS)
    rows = _bucket(max(num_new), ROW_BUCKETS)
    if batch is None or rows is None:
        return None
    return Layout(batch, rows, key_bucket(need, capacity))


class GraphModel:
    """A CausalLM behind the LanguageModel contract with its KV in a SlotPool and its fixed
    shapes replayed as CUDA graphs (module docstring). Everything else (config, dtype, the
    drafters' extras) is the wrapped model's."""

    def __init__(self, model: CausalLM, graphs: bool = True, fused: bool | None = None) -> None:
        self.inner = model
        self.config, self.dtype, self.device = model.config, model.dtype, model.device
        # graphs only on CUDA; elsewhere (the CPU tests), or with QUICKDRAFT_NO_GRAPHS=1 (to
        # bisect), the same forward runs eagerly
        off = os.environ.get("QUICKDRAFT_NO_GRAPHS", "") not in ("", "0")
        self.graphs = graphs and self.device.type == "cuda" and not off
        # the Triton kernels (kernels/triton_ops.py) where they run; `fused` forces the choice
        # (tests run them in Triton's interpreter on the CPU)
        probe = torch.empty(0, device=self.device)
        d = model.config.head_dim
        runs = triton_ops.available(probe) and d & (d - 1) == 0  # power-of-two heads only
        self.fused = runs if fused is None else fused
        cfg = model.config
        self.limit = cfg.max_position_embeddings
        self.pool = SlotPool(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            FIRST_SLOTS,
            min(FIRST_CAPACITY, self.limit),
            self.dtype,
            self.device,
        )
        self._captured: dict[Layout, _Captured] = {}
        self._chains: dict[tuple[Layout, int], _Captured] = {}  # greedy_chain's, by steps
        self._generation = -1
        self._mempool: Any = None
        self.replays = 0  # graph replays so far (tests, telemetry)
        self._tables(self.pool.capacity)

    def __getattr__(self, name: str) -> Any:
        # only for names this class does not define: the wrapped model's
        return getattr(self.__dict__["inner"], name)

    def _tables(self, capacity: int) -> None:
        self.cos, self.sin = self.inner.rope.full(capacity, self.dtype)  # [capacity, d] fp32
        self.key_positions = torch.arange(capacity, device=self.device)

    # -- the LanguageModel contract ----------------------------------------------------------

    def new_cache(self, capacity: int) -> SlotCache:
        cache = SlotCache(self.pool, self.limit)
        cache.reserve(capacity)
        return cache

    def pack_(self) -> None:
        self.inner.pack_()
        self._drop()

    def quantize_(self, fmt: str) -> None:
        self.inner.quantize_(fmt)
        self._drop()

    def restrict_vocab_(self, keep: int, extra: Sequence[int] = ()) -> None:
        self.inner.restrict_vocab_(keep, extra)
        self._drop()

    @property
    def vocab_kept(self) -> int | None:
        return self.inner.vocab_kept

    def use_kernels(self, fused: bool) -> None:
        """Run the Triton kernels (True) or torch's ops (False) from now on; the graphs captured
        with the other choice are dropped (benchmarks A/B the two in one process)."""
        if fused != self.fused:
            self.fused = fused
            self._drop()

    def _drop(self) -> None:
        """Forget every captured graph, and their memory pool with them: once no graph holds
        it, the allocator frees the pool, and capturing into its stale handle fails."""
        self._captured.clear()
        self._chains.clear()
        self._mempool = None

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: Tensor,
        caches: Sequence[Any],
        num_new: Sequence[int],
        logit_rows: Tensor | None = None,
        return_hidden: bool = False,
        hidden_layers: Sequence[int] = (),
        images: ImageRows | None = None,  # refused: no vision path
    ) -> ForwardOutput:
        assert input_ids.dim() == 1 and sum(num_new) == input_ids.shape[0]
        refuse_images(self, images)
        need = self._reserve(caches, num_new)
        graphed = None
        if self.graphs and not return_hidden and not hidden_layers:
            # the Triton attention reads each row's key count on the device: one graph per
            # (batch, rows) serves every length, and one more past SPLIT_KEYS
            graphed = graph_key(num_new, self._key_need(need), self.pool.capacity)
        layout = graphed or Layout(len(caches), max(num_new), need)
        ids, meta, dest = self._inputs(input_ids, caches, num_new, layout)
        if logit_rows is None:
            logit_rows = torch.tensor(list(num_new), device=self.device).cumsum(0) - 1
        rows = dest[logit_rows.to(self.device)]  # the padded rows to score
        if graphed is not None:
            return ForwardOutput(self._replay(graphed, ids, meta).index_select(0, rows))
        hidden, taps = self._forward(ids, meta, layout, set(hidden_layers))
        layers = tapped_layers(
            {i: t.index_select(0, dest) for i, t in taps.items()},
            hidden_layers,
            len(self.inner.decoder_layers),
            self.inner.model.norm,
        )
        logits = self.inner._logits(hidden.index_select(0, rows))
        return ForwardOutput(
            logits, hidden.index_select(0, dest) if return_hidden else None, layers
        )

    @torch.inference_mode()
    def greedy_chain(self, first: Tensor, caches: Sequence[SlotCache], steps: int) -> Tensor:
        """`steps` one-row forwards of every sequence, each fed the argmax of the one before:
        `first` [B] (device ids) is fed at each cache's length, then the picks. Returns the
        picks [steps, B] (the argmax after each step); each cache then holds the KV of the fed
        tokens, uncommitted. On a GPU the whole chain is one captured graph (a draft model's k
        steps: one replay, no host work between them)."""
        assert first.dim() == 1 and len(caches) == first.shape[0] and steps >= 1
        need = self._reserve(caches, [steps] * len(caches))
        ones = [1] * len(caches)
        graphed = graph_key(ones, self._key_need(need), self.pool.capacity) if self.graphs else None
        layout = graphed or Layout(len(caches), 1, need)
        padded, meta, _ = self._inputs(first, caches, ones, layout)
        if graphed is None:
            return self._chain(padded, meta, layout, steps)[:, : len(caches)]
        key = (graphed, steps)
        captured = self._chains.get(key)
        if captured is None:
            ids_in = torch.zeros_like(padded)
            meta_in = self._scratch_meta(graphed)
            graph, out = self._graph(lambda: self._chain(ids_in, meta_in, graphed, steps))
            captured = self._chains[key] = _Captured(graph, ids_in, meta_in, out)
        captured.ids.copy_(padded)
        captured.meta.copy_(meta)
        captured.graph.replay()
        self.replays += 1
        return captured.logits[:, : len(caches)]

    def _reserve(self, caches: Sequence[Any], num_new: Sequence[int]) -> int:
        """Room in each cache for its `num_new` rows (a sequence past the context is refused),
        the tables and graphs renewed if that moved the pool; returns the most keys a row
        attends to."""
        assert all(isinstance(c, SlotCache) and c.pool is self.pool for c in caches), (
            "caches of this model's new_cache"
        )
        for cache, n in zip(caches, num_new, strict=True):
            if cache.length + n > self.limit:
                raise ValueError(
                    f"sequence of {cache.length + n} tokens exceeds the model context "
                    f"({self.limit})"
                )
            cache.reserve(n)
        if self.pool.generation != self._generation:  # the pool moved: new tables, new graphs
            self._generation = self.pool.generation
            self._drop()
            self._tables(self.pool.capacity)
        return max(c.length + n for c, n in zip(caches, num_new, strict=True))

    def _key_need(self, need: int) -> int:
        """The key count a captured shape is keyed by: the torch path's mask spans `need`; the
        Triton attention reads lengths on the device, and only splits its keys past
        SPLIT_KEYS (`_attention`), so short calls share one shape and long ones another."""
        if not self.fused:
            return need
        return 1 if need <= triton_ops.SPLIT_KEYS else self.pool.capacity

    def _chain(self, ids: Tensor, meta: Tensor, at: Layout, steps: int) -> Tensor:
        """`greedy_chain`'s forwards, capturable: step i's rows sit i positions past meta's."""
        picks = []
        shift = torch.zeros_like(meta)
        shift[at.batch : 2 * at.batch] = 1  # the row positions (rows = 1)
        for i in range(steps):
            hidden, _ = self._forward(ids, meta + i * shift, at, set())
            ids = self.inner._logits(hidden).argmax(-1)
            picks.append(ids)
        return torch.stack(picks)

    # -- the static forward --------------------------------------------------------------------

    def _inputs(
        self, input_ids: Tensor, caches: Sequence[SlotCache], num_new: Sequence[int], at: Layout
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The padded inputs of a call: ids `[batch * rows]`, meta (row slots, row positions,
        sequence slots) and, for each packed row, its padded row."""
        scratch = self.pool.scratch
        padded = at.batch * at.rows
        row_slot = [scratch] * padded
        row_pos = [0] * padded
        seq_slot = [scratch] * at.batch
        dest: list[int] = []
        for b, (cache, n) in enumerate(zip(caches, num_new, strict=True)):
            seq_slot[b] = cache.slot
            for i in range(n):
                r = b * at.rows + i
                row_slot[r], row_pos[r] = cache.slot, cache.length + i
                dest.append(r)
        host = torch.tensor(row_slot + row_pos + seq_slot + dest, dtype=torch.long)
        packed = host.to(self.device, non_blocking=True)
        meta, dest_t = packed[: 2 * padded + at.batch], packed[2 * padded + at.batch :]
        ids = torch.zeros(padded, dtype=torch.long, device=self.device)
        ids.index_copy_(0, dest_t, input_ids.to(self.device))
        return ids, meta, dest_t

    def _forward(
        self, ids: Tensor, meta: Tensor, at: Layout, wanted: set[int]
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """The padded forward -> (post-final-norm hidden `[batch * rows, hidden]`, the outputs
        of the `wanted` layers). Only tensor ops on tensors whose shapes `at` fixes: capturable."""
        padded = at.batch * at.rows
        row_slot, row_pos = meta[:padded], meta[padded : 2 * padded]
        seq_slot = meta[2 * padded :]
        cos, sin = self.cos.index_select(0, row_pos), self.sin.index_select(0, row_pos)
        # [N, d] fp32; the torch path's RoPE takes the sin with its first half negated
        rope = (cos, sin) if self.fused else (cos, signed_sin(sin))
        mask = None if self.fused else self._mask(row_pos, at)
        model = self.inner
        h = model.model.embed_tokens(ids)
        residual: Tensor | None = None
        taps: dict[int, Tensor] = {}
        for i, layer in enumerate(model.decoder_layers):
            h, residual = self._layer(
                layer, h, residual, rope, (row_slot, row_pos, seq_slot), mask, at
            )
            if i in wanted:
                taps[i] = residual + h
        assert residual is not None
        return self._add_norm(model.model.norm, residual, h)[1], taps

    def _mask(self, row_pos: Tensor, at: Layout) -> Tensor:
        """SDPA's mask over the gathered keys `[batch, 1, groups * rows, keys]`: row (b, g, i)
        of a sequence's folded queries sees its keys 0 .. its position. Additive, in the model
        dtype, made once: SDPA would turn a boolean one into this in every layer."""
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        qpos = row_pos.view(at.batch, 1, at.rows).expand(at.batch, groups, at.rows)
        seen = self.key_positions[: at.keys] <= qpos.reshape(at.batch, 1, -1, 1)
        mask = torch.zeros(seen.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~seen, float("-inf"))

    def _add_norm(self, norm: RMSNorm, residual: Tensor | None, h: Tensor) -> tuple[Tensor, Tensor]:
        """(residual + h, norm of it); layer 0 (no residual yet): (h, norm(h))."""
        if residual is None:
            return (
                triton_ops.add_rms_norm(h, None, norm.weight, norm.eps)
                if self.fused
                else (h, norm(h))
            )
        if self.fused:
            return triton_ops.add_rms_norm(residual, h, norm.weight, norm.eps)
        return norm.add_forward(residual, h)

    def _layer(
        self,
        layer: DecoderLayer,
        h: Tensor,
        residual: Tensor | None,
        rope: tuple[Tensor, Tensor],
        where: tuple[Tensor, Tensor, Tensor],
        mask: Tensor | None,
        at: Layout,
    ) -> tuple[Tensor, Tensor]:
        """DecoderLayer.forward_residual with attention over the pool."""
        residual, x = self._add_norm(layer.input_layernorm, residual, h)
        attn = self._attention(layer.self_attn, x, rope, where, mask, at)
        residual, x = self._add_norm(layer.post_attention_layernorm, residual, attn)
        mlp = layer.mlp
        if not self.fused or not isinstance(mlp, MLP):
            return mlp(x), residual
        if isinstance(mlp.gate_up, DeviceGGUFWeight):  # the GEMM and silu * up: one launch
            return project(triton_gguf.swiglu(x, mlp.gate_up), mlp.down), residual
        return project(triton_ops.silu_mul(project(x, mlp.gate_up)), mlp.down), residual

    def _rotated_qkv(
        self,
        attn: Attention,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        where: tuple[Tensor, Tensor, Tensor],
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """q `[N, H, d]` and k, v `[N, Hkv, d]` rotated (Attention.rotated_qkv), q and k in one
        `rope_rows`; with the Triton kernels, q alone: k and v are already in the pool."""
        cos, sin = rope  # torch path: sin is signed_sin(sin), which is its own inverse
        if attn.q_norm is not None:  # Qwen3's q/k norms come between: the model's own
            plain = sin if self.fused else signed_sin(sin)
            return attn.rotated_qkv(x, (cos[:, None], plain[:, None]))
        n, d = x.shape[0], attn.head_dim
        heads, kv_heads = attn.num_heads, attn.num_kv_heads
        qkv = project(x, attn.qkv, attn.qkv_bias)  # [N, (H + 2 Hkv) * d]
        if self.fused:
            row_slot, row_pos, _ = where
            layer = attn.layer_idx
            pool_k, pool_v = self.pool.k[layer], self.pool.v[layer]
            q = triton_ops.rope_store(
                qkv, cos, sin, heads, kv_heads, pool_k, pool_v, row_slot, row_pos
            )
            return q, None, None
        qk = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
        qk = rope_rows(qk, cos, sin)
        v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        return qk[:, :heads], qk[:, heads:], v

    def _attention(
        self,
        attn: Attention,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        where: tuple[Tensor, Tensor, Tensor],
        mask: Tensor | None,
        at: Layout,
    ) -> Tensor:
        row_slot, row_pos, seq_slot = where
        q, k, v = self._rotated_qkv(attn, x, rope, where)  # [B * n, H, d], [B * n, Hkv, d]
        pool_k, pool_v = self.pool.k[attn.layer_idx], self.pool.v[attn.layer_idx]
        if k is not None and v is not None:  # not yet in the pool
            pool_k[row_slot, :, row_pos] = k
            pool_v[row_slot, :, row_pos] = v
        if mask is None:  # the Triton kernel reads the slots in place
            # keys split over programs past SPLIT_KEYS (rows that short get the same bits)
            split = at.keys > triton_ops.SPLIT_KEYS
            out = triton_ops.slot_attention(
                q, pool_k, pool_v, seq_slot, row_pos, at.rows, attn.scale, split
            )
            return project(out, attn.o)
        keys = pool_k[:, :, : at.keys].index_select(0, seq_slot)  # [B, Hkv, keys, d]
        values = pool_v[:, :, : at.keys].index_select(0, seq_slot)
        heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        groups = heads // kv_heads
        # the query heads sharing a kv head folded into the row dimension (as reference_attend)
        qg = q.view(at.batch, at.rows, kv_heads, groups, d).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(at.batch, kv_heads, groups * at.rows, d)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=attn.scale)
        out = out.view(at.batch, kv_heads, groups, at.rows, d).permute(0, 3, 1, 2, 4)
        return project(out.reshape(at.batch * at.rows, heads * d), attn.o)

    # -- CUDA graphs ---------------------------------------------------------------------------

    def _replay(self, at: Layout, ids: Tensor, meta: Tensor) -> Tensor:
        captured = self._captured.get(at)
        if captured is None:
            captured = self._capture(at)
            self._captured[at] = captured
        captured.ids.copy_(ids)
        captured.meta.copy_(meta)
        captured.graph.replay()
        self.replays += 1
        return captured.logits

    def _scratch_meta(self, at: Layout) -> Tensor:
        """Capture-time meta: every row and sequence on the scratch slot at position 0, so the
        warm-up runs write nothing real."""
        padded = at.batch * at.rows
        meta = torch.full(
            (2 * padded + at.batch,), self.pool.scratch, dtype=torch.long, device=self.device
        )
        meta[padded : 2 * padded] = 0
        return meta

    def _capture(self, at: Layout) -> _Captured:
        ids = torch.zeros(at.batch * at.rows, dtype=torch.long, device=self.device)
        meta = self._scratch_meta(at)

        def step() -> Tensor:
            hidden, _ = self._forward(ids, meta, at, set())
            return self.inner._logits(hidden)

        graph, logits = self._graph(step)
        return _Captured(graph, ids, meta, logits)

    def _graph(self, fn: Callable[[], Tensor]) -> tuple[Any, Tensor]:
        """`fn` captured as a CUDA graph (after two warm-up runs on a side stream: cuBLAS
        handles, workspaces, lazy inits) into the shared memory pool -> (graph, its output)."""
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            out = fn()
        return graph, out


def for_device(model: Any) -> Any:
    """`model` as it should run on its device: a dense CausalLM on a GPU behind GraphModel;
    anything else (CPU, hybrid and MoE models, Gemma 3) as it is."""
    if model.device.type != "cuda" or type(model) is not CausalLM:
        return model
    if model.config.moe_layers and any(model.config.moe_layers):
        return model  # routed experts pick their rows on the host: not capturable
    return GraphModel(model)
