"""The device-agnostic half of the GPU path (models/graphs.py, loading.resolve_device), on the
CPU: the static-slot forward gives the model's own logits for prefill, packed decode, verify
and rollback; the pool's slots and growth keep every sequence's KV; the graph shapes pad as
documented; `--device` resolves or says why not. What needs a GPU is in test_cuda.py."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from parity import forced_draft, greedy_parity

from quickdraft.config import SpeculativeConfig
from quickdraft.loading import LoadedModel, load, resolve_device
from quickdraft.models import graphs
from quickdraft.models.caches.kv_cache import KVCache
from quickdraft.models.caches.slot_cache import SlotCache
from quickdraft.models.families.llama import CausalLM
from quickdraft.models.formats.loader import load_model
from quickdraft.models.graphs import GraphModel, Layout, for_device, graph_key
from quickdraft.request import SamplingParams


def model_of(directory: Path) -> CausalLM:
    model = load_model(directory, torch.float32)
    assert isinstance(model, CausalLM)
    return model


def run_both(
    plain: CausalLM,
    static: GraphModel,
    caches: tuple[list[KVCache], list[Any]],
    ids: list[list[int]],
    keep: list[int] | None = None,
    all_rows: bool = False,
) -> None:
    """One packed forward of `ids` (rows per sequence) through both; logits must agree; then
    each cache commits `keep` of its rows (all by default)."""
    flat = torch.tensor([t for r in ids for t in r])
    num_new = [len(r) for r in ids]
    rows = torch.arange(len(flat)) if all_rows else None
    a = plain(flat, caches[0], num_new, logit_rows=rows)
    b = static(flat, caches[1], num_new, logit_rows=rows)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    for i, n in enumerate(num_new):
        kept = n if keep is None else keep[i]
        for group in caches:
            group[i].commit(group[i].length + kept)


def test_static_forward_equals_the_model_through_prefill_decode_verify_rollback(
    tiny_hf: tuple[str, Path, Any],
) -> None:
    _, directory, _ = tiny_hf
    plain = model_of(directory)
    static = GraphModel(plain)
    assert not static.graphs  # graphs run on CUDA only: here the same forward runs eagerly
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, plain.config.vocab_size, (n,), generator=gen).tolist()

    caches: tuple[list[KVCache], list[Any]] = (
        [plain.new_cache(8) for _ in range(3)],
        [static.new_cache(8) for _ in range(3)],
    )
    run_both(plain, static, caches, [tokens(7), tokens(3), tokens(12)])  # packed prefill
    for _ in range(3):  # packed decode
        run_both(plain, static, caches, [tokens(1), tokens(1), tokens(1)])
    # verify of 5, 1 and 3 rows, keeping 2, 1 and 0 of them: the rest is rolled back
    run_both(plain, static, caches, [tokens(5), tokens(1), tokens(3)], [2, 1, 0], all_rows=True)
    run_both(plain, static, caches, [tokens(4), tokens(2), tokens(1)], all_rows=True)
    # one sequence alone, then the hidden states a drafter reads
    run_both(plain, static, ([caches[0][1]], [caches[1][1]]), [tokens(6)])
    flat = torch.tensor(tokens(3))
    a = plain(flat, [caches[0][0]], [3], return_hidden=True, hidden_layers=(0, 2))
    b = static(flat, [caches[1][0]], [3], return_hidden=True, hidden_layers=(0, 2))
    assert a.hidden is not None and b.hidden is not None
    assert a.layers is not None and b.layers is not None
    torch.testing.assert_close(b.hidden, a.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.layers, a.layers, atol=1e-5, rtol=1e-5)
    for x, y in zip(caches[0], caches[1], strict=True):
        assert x.length == y.length
        torch.testing.assert_close(y.export_kv(0, y.length).k, x.export_kv(0, x.length).k)


def test_pool_grows_in_slots_and_length_keeping_every_sequence(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(graphs, "FIRST_CAPACITY", 64)
    plain = model_of(tiny_model_dir)
    static = GraphModel(plain)
    pool = static.pool
    caches = [static.new_cache(4) for _ in range(graphs.FIRST_SLOTS)]
    for i, cache in enumerate(caches):
        static(torch.tensor([i + 1] * 5), [cache], [5])
        cache.commit(5)
    before = [c.export_kv(0, 5) for c in caches]
    generation = pool.generation
    extra = static.new_cache(4)  # past FIRST_SLOTS: the pool doubles its slots
    assert pool.slots == 2 * graphs.FIRST_SLOTS and pool.generation == generation + 1
    longer = pool.capacity + 1
    static(torch.tensor([7] * longer), [extra], [longer])  # past the slot length: it grows
    extra.commit(longer)
    assert pool.capacity >= longer and pool.generation == generation + 2
    for cache, kv in zip(caches, before, strict=True):
        torch.testing.assert_close(cache.export_kv(0, 5).k, kv.k)
        torch.testing.assert_close(cache.export_kv(0, 5).v, kv.v)
    # a cache nobody holds gives its slot back; the next one takes it
    slot = caches[0].slot
    del caches[0], before
    gc.collect()
    assert slot in pool.free
    assert static.new_cache(4).slot == slot


def test_slot_cache_exports_and_imports_blocks(tiny_model_dir: Path) -> None:
    plain = model_of(tiny_model_dir)
    static = GraphModel(plain)
    a = static.new_cache(16)
    ids = torch.arange(10, 22)
    static(ids, [a], [12])
    a.commit(12)
    b = static.new_cache(16)
    b.import_kv([a.export_kv(0, 5), a.export_kv(5, 12)])
    assert b.length == 12 and b.state_at(3) is None and not b.recurrent
    nxt = torch.tensor([3])
    torch.testing.assert_close(static(nxt, [b], [1]).logits, static(nxt, [a], [1]).logits)


def test_a_sequence_past_the_context_is_refused(tiny_model_dir: Path) -> None:
    static = GraphModel(model_of(tiny_model_dir))
    cache = static.new_cache(8)
    limit = static.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model context"):
        static(torch.zeros(limit + 1, dtype=torch.long), [cache], [limit + 1])
    assert cache.length == 0


def test_graph_shapes_pad_rows_batch_and_keys() -> None:
    assert graph_key([1], 10, 4096) == Layout(1, 1, graphs.MIN_KEYS)
    assert graph_key([6, 1, 3], 300, 4096) == Layout(4, 6, 512)
    assert graph_key([9], 5000, 4096) == Layout(1, 10, 4096)  # keys: at most the capacity
    assert graph_key([graphs.ROW_BUCKETS[-1] + 1], 10, 4096) is None  # a prompt chunk: eager
    assert graph_key([1] * (graphs.BATCH_BUCKETS[-1] + 1), 10, 4096) is None


def test_speculation_on_the_static_forward_equals_plain(
    tiny_model_dir: Path, near_draft_dir: Path
) -> None:
    """The engine and a draft model on slot caches: greedy output is speculation off's."""
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    lm = LoadedModel(
        lm.name, lm.path, lm.dtype_name, GraphModel(lm.model), lm.tokenizer, lm.eos_ids
    )
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(", "abcabcabcabc"]
    drafted, _ = greedy_parity(lm, prompts, params, forced_draft(near_draft_dir, 4))
    assert drafted > 0


def test_greedy_chain_is_the_steps_one_at_a_time(tiny_model_dir: Path) -> None:
    """GraphModel.greedy_chain (one captured graph on a GPU) feeds each step the argmax of the
    one before, at each sequence's own position: the picks and the KV it leaves are those of
    one-row forwards run one by one."""
    static = GraphModel(model_of(tiny_model_dir))
    prompts = [[5, 9, 11, 3], [7, 8], [40, 41, 42, 43, 44, 45]]
    chained, stepped = [], []
    for out in (chained, stepped):
        caches = [static.new_cache(64) for _ in prompts]
        flat = torch.tensor([t for p in prompts for t in p])
        logits = static(flat, caches, [len(p) for p in prompts]).logits
        for c, p in zip(caches, prompts, strict=True):
            c.commit(len(p))
        first = logits.argmax(-1)
        if out is chained:
            picks = static.greedy_chain(first, caches, 4)
            for c in caches:
                c.commit(c.length + 4)
        else:
            picks_list, ids = [], first
            for _ in range(4):
                ids = static(ids, caches, [1] * len(caches)).logits.argmax(-1)
                picks_list.append(ids)
                for c in caches:
                    c.commit(c.length + 1)
            picks = torch.stack(picks_list)
        after = static(picks[-1], caches, [1] * len(caches)).logits  # reads the chain's KV
        out.extend([picks, after])
    assert torch.equal(chained[0], stepped[0])
    # eagerly the chain attends over its last step's key count: equal up to fp32 summation
    torch.testing.assert_close(chained[1], stepped[1], atol=1e-5, rtol=1e-5)


def test_draft_chain_on_the_static_forward_drafts_what_the_loop_drafts(
    tiny_model_dir: Path,
) -> None:
    """A draft model behind GraphModel with the device chain: jobs of one k run as one
    greedy_chain, jobs of mixed k as the per-position loop; both draft, feed and commit what
    the token-by-token loop does."""
    from quickdraft.speculation.drafters.base import DraftJob
    from quickdraft.speculation.drafters.draft_model import DraftModelDrafter

    lm = load(str(tiny_model_dir), "fp32", progress=False)
    static = GraphModel(lm.model)
    calls = {"chain": 0}
    chain = static.greedy_chain

    def counted(*args: Any) -> Any:
        calls["chain"] += 1
        return chain(*args)

    static.greedy_chain = counted  # type: ignore[method-assign]
    runs = []
    for on in (True, False):
        drafter = DraftModelDrafter(static, static.config.vocab_size)
        drafter.device_chain = on
        seqs = [lm.tokenizer.encode(t) for t in ("hello world", "abcabc", "the cat sat")]
        states = [drafter.new_state(s) for s in seqs]
        seen = []
        for ks in ((3, 3, 3), (1, 4, 2), (5, 5, 5)):
            jobs = [
                DraftJob(st, seq, k, SamplingParams(), torch.Generator())
                for st, seq, k in zip(states, seqs, ks, strict=True)
            ]
            drafts = drafter.propose(jobs)
            seen.append(([d.tokens for d in drafts], list(drafter.forwards)))
            for st, seq, d in zip(states, seqs, drafts, strict=True):
                seq.extend([*d.tokens[:2], 7])  # the target kept two drafts, then its own
                drafter.commit(st, seq)
        seen.append([(st.fed, st.cache.length) for st in states])
        runs.append(seen)
    assert calls["chain"] == 2  # the rounds of one k
    assert runs[0] == runs[1]


def test_cpu_models_run_as_they_are(tiny_model_dir: Path) -> None:
    lm = load(str(tiny_model_dir), "fp32", device="cpu", progress=False)
    assert isinstance(lm.model, CausalLM) and for_device(lm.model) is lm.model
    assert isinstance(lm.model.new_cache(4), KVCache)
    assert not isinstance(lm.model.new_cache(4), SlotCache)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers of a host without GPU")
def test_device_resolves_or_says_why() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="choose one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_the_gpu_forward_launches_about_twenty_ops_per_layer(tiny_model_dir: Path) -> None:
    """At batch 1 a GPU step costs about a launch per op, whatever the op does: the static
    forward, traced on the "meta" device (the GPU's code path, no data), must keep its fused
    ops (one rms_norm, one four-op RoPE for q and k, a mask made once). The reference path
    counted 37 per layer (reshapes aside); this one 19. (The Triton kernels take fewer.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "_unsafe_view", "permute", "expand", "slice", "select", "t", "transpose"}
    views |= {"unsqueeze", "squeeze", "detach", "alias", "as_strided", "reshape", "unbind"}

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket.__name__ not in views:
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    def ops(layers: int) -> int:
        cfg = replace(model_of(tiny_model_dir).config, num_hidden_layers=layers, moe_layers=())
        static = GraphModel(CausalLM(cfg, torch.bfloat16, "meta"), fused=False)
        ids = torch.zeros(1, dtype=torch.long, device="meta")
        meta = torch.zeros(3, dtype=torch.long, device="meta")
        Count.ops = 0
        with torch.inference_mode(), Count():
            static._forward(ids, meta, Layout(1, 1, graphs.MIN_KEYS), set())
        return Count.ops

    per_layer = (ops(6) - ops(3)) / 3  # the forward's own ops (mask, tables) cancel
    assert per_layer <= 19, per_layer


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_hidden_state_drafters_on_the_static_forward_equal_plain(
    method: str, tmp_path: Path
) -> None:
    """MTP and DFlash read the target's hidden rows (post-norm, or tapped layers), which the
    static forward returns on its eager path: greedy output with either equals speculation
    off, with drafts accepted, on a dense target behind GraphModel."""
    from hybrid_models import copying_head, randomize, save_hybrid_dir
    from parity import greedy_parity
    from test_dflash import target_and_drafter
    from test_mtp import DENSE_CONFIG

    from quickdraft.config import ModelConfig

    if method == "mtp":
        model = CausalLM(ModelConfig.from_dict(DENSE_CONFIG), torch.float32)
        randomize(model, seed=3, out_scale=0.03, offset=False)
        head = copying_head(model)
        directory = save_hybrid_dir(model, "dense", tmp_path, head, config=DENSE_CONFIG)
        lm = load(str(directory), "fp32", progress=False)
        cfg = SpeculativeConfig(method="mtp", num_draft_tokens=3, adaptive=False)
    else:
        lm, checkpoint = target_and_drafter("dense", tmp_path, rigged=True)
        cfg = SpeculativeConfig(
            method="dflash", draft_model=str(checkpoint), num_draft_tokens=3, adaptive=False
        )
    assert isinstance(lm.model, CausalLM)
    static = LoadedModel(
        lm.name, lm.path, lm.dtype_name, GraphModel(lm.model), lm.tokenizer, lm.eos_ids
    )
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(", "abcabcabcabc", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    drafted, accepted = greedy_parity(static, prompts, params, cfg)
    assert drafted > 0 and accepted > 0
