"""MTP drafter: the target's own multi-token-prediction head proposes k tokens, chained.

Row i of the head pairs the target's hidden state h_i with the NEXT token t_{i+1} and runs at
position i; its logits guess t_{i+2}. Per request the state holds the head's KV cache (rows
that ran with the target's hidden) and the target hidden rows not yet run:
  commit(tokens, hidden)   queue the target's hidden rows of the newly committed positions
  propose(jobs)            ONE packed head forward over every job's queued rows (committed
                           into the head's KV; the last row's logits give d_1), then per draft
                           position j >= 2 one packed forward of the row (o_{j-1}, d_{j-1}),
                           where o is the previous row's output. These chained rows are rolled
                           back (a commit of the KV length) before propose returns, accepted or
                           not: their hidden was the head's own guess, and the next catch-up
                           re-runs the accepted positions with the target's true hidden.
Which hidden the head reads is one switch, `feed`: "post_norm" (the target's post-final-norm
hidden and the head's post-`norm` output; vLLM's choice) or "pre_norm" (the residual stream
before those norms; the target's is recovered exactly, up to the head's RMSNorm eps, as
post_norm / final-norm scale, because the head normalises it again with pre_fc_norm_hidden).
Real checkpoints settle it by acceptance (bench/hybrid.py reports it).
Where the head comes from: the target's own checkpoint (`mtp.*`), or a standalone head
directory (models/heads/mtp.py; `quickdraft train-drafter --kind mtp` trains one for a dense target,
with the post_norm feed) given as `--draft-model`. Prefix cache (`PrefixDrafter`): a block of tokens
[a, b) keeps the head's KV rows whose inputs lie in it, positions [a - 1, b - 1) (row i reads
t_{i+1}), and the target hidden row h_{b-1} (kept from `commit` once the block size is known): a hit
of n tokens restores rows [0, n - 1) and queues h_{n-1}, exactly where a request that ran the n
tokens itself would be.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import torch
from safetensors import safe_open
from torch import Tensor, nn

from quickdraft.config import PREFILL_CHUNK
from quickdraft.hub.convert import GGUF_LINK
from quickdraft.images import ImageLayout, ImageRows, pack_image_rows
from quickdraft.kernels.gemm import Weight, panels_apply
from quickdraft.models.base import LanguageModel, module_of
from quickdraft.models.caches.kv_cache import KVCache
from quickdraft.models.formats.gguf_loader import is_gguf_dir
from quickdraft.models.formats.gguf_qwen_loader import load_gguf_mtp_head
from quickdraft.models.formats.loader import load_weights
from quickdraft.models.heads.draft_vocab import check_declared, read_draft_vocabulary
from quickdraft.models.heads.mtp import MTPHead, standalone_head_config
from quickdraft.models.registry import mtp_parts, name_map
from quickdraft.speculation.cost import StepShape, settle
from quickdraft.speculation.drafters.base import Draft, DraftBlock, DraftJob, draft_position

HiddenFeed = Literal["post_norm", "pre_norm"]

log = logging.getLogger(__name__)


def mtp_tensor_names(path: str | Path) -> list[str]:
    """The `mtp.*` tensor names of checkpoint dir `path` (safetensors headers only; none for a
    directory without safetensors, e.g. a GGUF model)."""
    names: list[str] = []
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names += [n for n in f.keys() if n.startswith("mtp.")]  # noqa: SIM118
    return names


def load_mtp_head(model: LanguageModel, path: str | Path, quantization: str = "none") -> MTPHead:
    """The `mtp.*` tensors of checkpoint dir `path` as a head sharing the target's embedding
    and lm_head. A clear error if the checkpoint has no head (or a layout we cannot run).
    `quantization` "int8" / "int4" (CPU kernels): a head trained apart from the target
    (train-drafter) runs its own operands, and its draft vocabulary's rows, in that format
    (MTPHead `quantize_`); a head that ships with the target stays in the target's own form."""
    target = module_of(model)
    path = Path(path)
    if is_gguf_dir(path):  # a GGUF run on its own weights: the head is its nextn block
        return load_gguf_mtp_head(target, path / GGUF_LINK)
    files = sorted(path.glob("*.safetensors"))
    names = mtp_tensor_names(path)
    if not names:
        raise ValueError(
            f"{path} has no MTP head (no mtp.* tensors): --speculative-method mtp needs a "
            "checkpoint that ships one (Qwen3-Next, Qwen3.5/3.6; in a GGUF, the blk.N.nextn.* "
            "tensors of nextn_predict_layers), or for a dense model a head trained with "
            "`quickdraft train-drafter MODEL --kind mtp`, given as --draft-model DIR; "
            "use ngram or draft instead"
        )
    layers = {n.split(".")[2] for n in names if n.startswith("mtp.layers.")}
    cfg: Any = target.config
    own = standalone_head_config(path)  # a head trained apart from the target
    if own is not None:
        _check_fits(own, cfg, path)
    # the raw (text) config.json of either config class, or the standalone head's
    extra = cfg.extra if own is None else own
    declared = extra.get("mtp_num_hidden_layers", extra.get("num_nextn_predict_layers"))
    declared = len(layers) if declared is None else int(declared)
    if layers != {"0"} or declared != 1:
        raise ValueError(
            f"{path}: MTP head with layers {sorted(layers)} (config: {declared}); only "
            "single-layer heads (mtp.layers.0) are supported"
        )
    dtype, device = model.dtype, model.device
    parts = mtp_parts(cfg.model_type)(cfg, dtype, device)
    # the target's embedding and lm_head GEMM operand (packed, quantized or not): shared
    lm_head = cast(Weight, target.head)
    embed = target.get_submodule("model.embed_tokens")
    head = MTPHead(parts, cfg.hidden_size, embed, lm_head, dtype, device)
    family = name_map(cfg)
    load_weights(head, files, lambda n: family(n[4:]) if n.startswith("mtp.") else None)
    if own is not None and quantization in ("int8", "int4"):
        head.quantize_(quantization)
    elif panels_apply(dtype, device):  # as `loading.load` packs the target (a GGUF one too)
        head.pack_()
    vocab_ids = None if own is None else read_draft_vocabulary(files, cfg.vocab_size)
    if own is not None and vocab_ids is not None:  # a trained head's reduced vocabulary
        check_declared(path, own.get("draft_vocab_size"), vocab_ids)
        head.restrict_vocab_(vocab_ids)
    return head


def _check_fits(head: dict[str, Any], cfg: Any, path: Path) -> None:
    """A clear error when a standalone head was trained for another kind of target."""
    trained_for = head.get("quickdraft", {}).get("trained_for")
    for key in ("model_type", "hidden_size", "vocab_size"):
        if head.get(key) != getattr(cfg, key):
            raise ValueError(
                f"{path}: MTP head for {key} {head.get(key)!r} (trained for {trained_for}), "
                f"the target has {getattr(cfg, key)!r}"
            )


class ChainHead(Protocol):
    """What the drafter runs: an MTP head (models/heads/mtp.py) or an EAGLE-3 head
    (models/heads/eagle3.py)."""

    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device

    def new_cache(self, capacity: int) -> KVCache: ...

    def __call__(
        self,
        token_ids: Tensor,  # [N] t_{i+1} of each row
        hidden: Tensor,  # [N, H] the hidden each row reads
        caches: Sequence[KVCache],
        num_new: Sequence[int],
        logit_rows: Tensor,
        images: ImageRows | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """-> logits [len(logit_rows), vocab] fp32, output pre-norm [N, H], post-norm [N, H]."""
        ...


@dataclass(slots=True)
class MTPState:
    cache: KVCache  # head rows run with the target's hidden: row i at position i
    pending: list[Tensor] = field(default_factory=list)  # target hidden rows not run yet
    queued: int = 0  # rows in `pending`
    block: int = 0  # prefix-cache block size (0: none): keep the hidden rows of block ends
    block_ends: dict[int, Tensor] = field(default_factory=dict)  # position -> [hidden] row


class MTPDrafter:
    needs_hidden = True
    hidden_history = True
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, head: ChainHead, final_norm: nn.Module | None, feed: HiddenFeed = "post_norm"
    ) -> None:
        """`final_norm`: the target's, whose scale the pre_norm feed divides out of the target
        rows; None: the rows are fed as the target hands them (an EAGLE-3 head's taps)."""
        self.head, self.feed = head, feed
        self.forwards: list[StepShape] = []  # the forwards of the last propose (drafters/base.py)
        self.unnorm: Tensor | None = None
        if feed == "pre_norm" and final_norm is not None:
            # The target's final norm scales the unit-RMS direction of x per channel; dividing
            # by that scale recovers x up to a positive factor, which pre_fc_norm_hidden removes.
            ones = torch.ones(1, head.hidden_size, dtype=head.dtype, device=head.device)
            with torch.no_grad():
                scale = final_norm(ones)[0].float()
            if bool((scale.abs() < 1e-6).any()):
                raise ValueError("pre_norm feed: the target's final norm zeroes a channel")
            self.unnorm = 1.0 / scale

    def new_state(self, prompt_ids: list[int], tenant: str = "") -> MTPState:
        # nothing crosses requests: the tenant does not matter
        return MTPState(self.head.new_cache(len(prompt_ids) + 64))

    def commit(self, state: MTPState, tokens: list[int], hidden: Tensor | None) -> None:
        assert hidden is not None, "the MTP drafter needs the target's hidden states"
        start = len(tokens) - 1 - hidden.shape[0]  # position of the first new row
        assert start == state.cache.length + state.queued, (
            f"hidden rows from position {start}, expected {state.cache.length + state.queued}"
        )
        rows = hidden if self.unnorm is None else hidden.float() * self.unnorm
        state.pending.append(rows)
        state.queued += rows.shape[0]
        if state.block:  # positions p with p + 1 a multiple of the block: a block's last row
            first = start + (-(start + 1)) % state.block
            for p in range(first, start + rows.shape[0], state.block):
                state.block_ends[p] = rows[p - start].clone()

    def _run(
        self,
        states: list[MTPState],
        ids: list[list[int]],
        hidden: list[Tensor],
        layouts: Sequence[ImageLayout | None],
    ) -> tuple[Tensor, Tensor]:
        """One packed head forward; per state its rows `ids` (t_{i+1}) with `hidden` (h_i),
        committed into its KV. Returns the logits of each state's last row [B, vocab] and that
        row's output to feed back as the next row's hidden [B, H]. `layouts`: each state's
        request's images (a row whose t_{i+1} is an image row reads its image embedding)."""
        head = self.head
        counts = [len(r) for r in ids]
        ends = torch.tensor(counts, device=head.device).cumsum(0) - 1
        starts = [s.cache.length for s in states]
        images = pack_image_rows(layouts, starts, counts, head.hidden_size, head.device, shift=1)
        logits, pre, post = head(
            torch.tensor([t for r in ids for t in r], device=head.device),
            torch.cat(hidden),
            [s.cache for s in states],
            counts,
            ends,
            images,
        )
        for s, n in zip(states, counts, strict=True):
            s.cache.commit(s.cache.length + n)
        self.forwards.append(StepShape(sum(counts), len(counts), sum(n > 1 for n in counts)))
        back = pre if self.feed == "pre_norm" else post
        return logits, back[ends]

    def target_rows(self, rows: list[Tensor]) -> list[Tensor]:
        """Per job, its queued target rows as the head reads them (an MTP head: as they are)."""
        return rows

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        self.forwards = []
        states: list[MTPState] = [job.state for job in jobs]
        ids, hidden = [], []
        for s, job in zip(states, jobs, strict=True):
            assert s.queued > 0, "propose() without a commit() since the last one"
            start = s.cache.length
            rows = torch.cat(s.pending) if len(s.pending) > 1 else s.pending[0]
            ids.append(job.tokens[start + 1 : start + 1 + s.queued])
            hidden.append(rows)
            s.pending.clear()
            s.queued = 0
        hidden = self.target_rows(hidden)
        # Long catch-ups (a prompt, a long k = 0 phase) first, chunk by chunk, so the packed
        # forward below stays small.
        layouts = [job.images for job in jobs]
        for i, s in enumerate(states):
            while len(ids[i]) > PREFILL_CHUNK:
                chunk = [ids[i][:PREFILL_CHUNK]], [hidden[i][:PREFILL_CHUNK]]
                self._run([s], *chunk, layouts[i : i + 1])
                ids[i], hidden[i] = ids[i][PREFILL_CHUNK:], hidden[i][PREFILL_CHUNK:]
        logits, back = self._run(states, ids, hidden, layouts)
        committed = [s.cache.length for s in states]
        drafts: list[tuple[list[int], list[Tensor]]] = [([], []) for _ in jobs]
        chains = [1.0] * len(jobs)  # each draft's probability so far, by the head
        active = list(range(len(jobs)))  # jobs whose row is in `logits` / `back`
        while True:
            still = draft_position(logits, jobs, active, drafts, chains)
            if not still:
                break
            active = [active[r] for r in still]
            logits, back = self._run(
                [states[j] for j in active],
                [[drafts[j][0][-1]] for j in active],
                [back[r : r + 1] for r in still],
                [layouts[j] for j in active],
            )
        # The chained rows were committed so that later steps attend to them, but their hidden
        # was the head's own guess: roll the head's KV back to the rows with the target's hidden.
        for s, length in zip(states, committed, strict=True):
            s.cache.commit(length)
        return [Draft(d, torch.stack(p) if p else None) for d, p in drafts]

    def free(self, state: MTPState) -> None:
        state.pending.clear()
        state.queued = 0
        state.block_ends.clear()

    def export_block(self, state: MTPState, start: int, ids: Sequence[int]) -> DraftBlock | None:
        end = start + len(ids)
        hidden = state.block_ends.get(end - 1)
        if hidden is None or state.cache.length < end - 1:  # the head has not run them yet
            return None
        return DraftBlock(state.cache.export_kv(max(start - 1, 0), end - 1), hidden)

    def import_blocks(
        self, state: MTPState, tokens: list[int], blocks: Sequence[DraftBlock], block_size: int
    ) -> int:
        assert state.cache.length == 0 and not state.queued, "a new request's state"
        state.block = block_size
        if not blocks:
            return 0
        last = blocks[-1].hidden
        assert last is not None, "an MTP block carries its last target hidden row"
        state.cache.import_kv([b.kv for b in blocks])  # rows [0, n - 1)
        state.pending, state.queued = [last[None]], 1  # h_{n-1}: its row waits for t_n
        return state.cache.length + 1


def mtp_drafter(
    model: LanguageModel,
    path: str | Path,
    feed: HiddenFeed = "post_norm",
    quantization: str = "none",
    keep: int = 0,
    extra: Sequence[int] = (),
) -> MTPDrafter:
    """The drafter for target `model` loaded from checkpoint dir `path` (its `mtp.*` head;
    `quantization` as in load_mtp_head). `keep` > 0 (`--draft-vocab`): the head scores only
    ids [0, keep) and `extra` (FR-Spec's cut, SGLang's --speculative-token-map), unless it
    was trained with a draft vocabulary of its own."""
    head = load_mtp_head(model, path, quantization)
    if 0 < keep < head.vocab_size:
        if head.vocab is None:
            head.keep_first_(keep, extra)
        else:
            log.warning("%s: --draft-vocab ignored: the MTP head has its own vocabulary", path)
    return MTPDrafter(head, module_of(model).get_submodule("model.norm"), feed)


def head_step_seconds(head: ChainHead, context: int = 16, reps: int = 3) -> float:
    """Seconds of one single-row head forward after `context` rows (best of reps)."""
    cache = head.new_cache(context + 2)
    size = head.hidden_size
    vocab = head.vocab_size
    ids = torch.randint(0, vocab, (context + 1,), device=head.device)
    hidden = torch.randn(context + 1, size, dtype=head.dtype, device=head.device)
    head(ids[:context], hidden[:context], [cache], [context], torch.tensor([context - 1]))
    cache.commit(context)
    best = float("inf")
    for _ in range(reps + 1):
        t = time.perf_counter()
        head(ids[context:], hidden[context:], [cache], [1], torch.tensor([0]))
        settle(head.device)
        best = min(best, time.perf_counter() - t)
    return best
