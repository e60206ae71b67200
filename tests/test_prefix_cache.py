"""engine/prefix_cache.py (over 400 lines: dense and hybrid targets x every drafter, eviction,
locks, tenants) on tiny random-weight fp32 models: greedy outputs with the prefix cache
equal those without it, for a dense and a hybrid (Gated DeltaNet) target, with speculation off,
n-gram, a draft model and MTP (hybrid), over multi-turn prompts, prompts that diverge inside a
cached block, repeats and requests cancelled while sharing blocks; a repeated prefix really
hits (cached tokens, fewer prefill rows, the drafter's own prefill skipped); eviction under a
tiny budget with several requests running: none fails, no block in use is freed, the budget
holds; the cache primitives (KV export/import, recurrent snapshots) against a cold run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from eagle3_heads import agreeing_head
from hybrid_models import (
    copying_head,
    one_thread,  # noqa: F401 (autouse fixture)
    random_hybrid,
    randomize,
    save_hybrid_dir,
)
from kernel_checks import needs_kernel
from test_mtp import DENSE_CONFIG

from quickdraft.cli import build_parser, prefix_cache_config
from quickdraft.config import ModelConfig, PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.engine.core import EngineCore
from quickdraft.engine.prefix_cache import Block, PrefixCache, PrefixCursor
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.engine.sequence import Sequence
from quickdraft.loading import LoadedModel, load
from quickdraft.models.base import SequenceCache
from quickdraft.models.caches.kv_cache import KVCache
from quickdraft.models.caches.state_cache import HybridCache
from quickdraft.models.families.llama import CausalLM
from quickdraft.models.graphs import GraphModel
from quickdraft.request import FinishReason, SamplingParams
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import Speculation

# 4 seats, prompt chunks of up to 48 rows (8 while others decode): prompts are admitted and
# prefilled while other requests decode, so hits and inserts interleave with running sequences
SMALL = SchedulerConfig(max_running=4, max_step_tokens=48, max_prefill_with_decodes=8)
# small blocks and, for the hybrid target, a snapshot every 2 blocks (16 tokens)
CACHE = PrefixCacheConfig(block_size=8, snapshot_every=2)
OFF = PrefixCacheConfig(enabled=False)
SYSTEM = "You are a careful assistant. Answer briefly and exactly.\n"  # 56 tokens (bytes)

Check = Callable[[EngineCore], None]


@pytest.fixture(scope="module")
def dense(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


@pytest.fixture(scope="module")
def static(dense: LoadedModel) -> LoadedModel:
    """The dense target as it runs on a GPU: KV in the slots of models/graphs.py's GraphModel
    (here, off CUDA, its forward runs eagerly)."""
    model = GraphModel(load(str(dense.path), "fp32", progress=False).model)
    return LoadedModel(dense.name, dense.path, "fp32", model, dense.tokenizer, dense.eos_ids)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """Its layers only nudge the residual stream and its MTP head copies the bigram guess:
    MTP drafts are accepted often but not always."""
    model = random_hybrid("qwen3_5", seed=1)
    randomize(model, seed=1, out_scale=0.03)
    path = save_hybrid_dir(model, "qwen3_5", tmp_path_factory.mktemp("hybrid"), copying_head(model))
    return load(str(path), "fp32", progress=False)


DRAFT_CONFIG = dict(DENSE_CONFIG, num_hidden_layers=2)  # a tiny Qwen3 draft model


@pytest.fixture(scope="module")
def hybrid_draft_dir(hybrid: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dense draft model for the hybrid target: the target's embedding, final norm and head
    around layers that add nothing, i.e. the bigram guess the target mostly makes."""
    draft = CausalLM(ModelConfig.from_dict(DRAFT_CONFIG), torch.float32)
    randomize(draft, seed=4, out_scale=0.0, offset=False)
    target = hybrid.model
    assert isinstance(target, torch.nn.Module)
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            draft.get_parameter(name).copy_(target.get_parameter(name))
        norm = target.get_parameter("model.norm.weight")
        draft.get_parameter("model.norm.weight").copy_(1 + norm)  # (1 + w) -> w
    directory = tmp_path_factory.mktemp("hybrid-draft")
    return save_hybrid_dir(draft, "dense", directory, config=DRAFT_CONFIG)


@pytest.fixture(scope="module")
def hybrid_eagle3_dir(hybrid: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE-3 head that copies the hybrid target's bigram guess (tests/eagle3_heads.py)."""
    target = hybrid.model
    assert isinstance(target, torch.nn.Module)
    norm = 1 + target.get_parameter("model.norm.weight")  # (1 + w) -> the Llama convention
    return agreeing_head(tmp_path_factory.mktemp("hybrid-eagle3"), norm)


def speculation(lm: LoadedModel, method: str, draft_dir: Path) -> Speculation | None:
    cfg = {
        "off": SpeculativeConfig(),
        # no shared index: what it learns across requests depends on the order they finish in
        "ngram": SpeculativeConfig(
            method="ngram", num_draft_tokens=4, ngram_shared_tokens=0, adaptive=False
        ),
        "draft": SpeculativeConfig(
            method="draft", num_draft_tokens=3, draft_model=str(draft_dir), adaptive=False
        ),
        "mtp": SpeculativeConfig(method="mtp", num_draft_tokens=3, adaptive=False),
        "eagle3": SpeculativeConfig(
            method="eagle3", num_draft_tokens=3, draft_model=str(draft_dir), adaptive=False
        ),
    }[method]
    return make_speculation(lm, cfg)


def run(
    core: EngineCore,
    lm: LoadedModel,
    spec: Speculation | None,
    prompts: list[list[int]],
    max_tokens: int = 16,
    check: Check | None = None,
    cancel: Callable[[int, list[Sequence]], None] | None = None,
) -> list[Sequence]:
    """Submit `prompts` together and step until all are done; `check(core)` after each step,
    `cancel(step, seqs)` before it."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [core.add(lm.new_request(p, params), spec) for p in prompts]
    step = 0
    while core.has_work:
        if cancel is not None:
            cancel(step, seqs)
        core.step()
        step += 1
        if check is not None:
            check(core)
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    return seqs


def conversation(
    lm: LoadedModel,
    spec: Speculation | None,
    prefix: PrefixCacheConfig,
    check: Check | None = None,
) -> tuple[list[list[int]], list[Sequence], EngineCore]:
    """Two rounds on one core. Round 1: two prompts sharing a system prompt, submitted
    together. Round 2 (after round 1): the first conversation's next turn (its prompt + answer
    + a new question), a prompt that leaves the system prompt in the middle of a block, a
    repeat of round 1's second prompt, a prompt shorter than a block. All outputs, in order."""
    enc = lm.tokenizer.encode
    core = EngineCore(lm, SMALL, prefix)
    first = [enc(SYSTEM + "What is 2 + 2?"), enc(SYSTEM + "Name a colour of the sea.")]
    r1 = run(core, lm, spec, first, check=check)
    turn2 = first[0] + r1[0].request.output_ids + enc("\nAnd 3 + 3?")
    split = enc(SYSTEM)[: 5 * CACHE.block_size + 3] + enc("zebra crossing")
    r2 = run(core, lm, spec, [turn2, split, first[1], enc("hi")], check=check)
    seqs = r1 + r2
    return [s.request.output_ids for s in seqs], seqs, core


def nodes(cache: PrefixCache) -> list[Block]:
    out, stack = [], [node for roots in cache.roots.values() for node in roots.values()]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def held_bytes(tree: list[Block]) -> int:
    """The memory the tree's blocks hold: every tensor storage they reference, each once (the
    blocks of one piece share one)."""
    storages: dict[int, int] = {}
    for n in tree:
        tensors = [n.kv.k, n.kv.v]
        if n.state is not None:
            tensors += [n.state.conv, n.state.ssm]
        for part in n.drafts.values():
            tensors += [part.kv.k, part.kv.v] + ([] if part.hidden is None else [part.hidden])
        for t in tensors:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def invariants(core: EngineCore) -> None:
    """The tree's accounting (its bytes are the memory its blocks hold), the budget, and the
    paths of running sequences: every block a running sequence holds is still in the tree, and
    the locks are exactly those paths' ends."""
    cache = core.prefix
    assert cache is not None
    tree = nodes(cache)
    assert cache.stats.bytes == held_bytes(tree) <= cache.stats.budget_bytes
    assert cache.stats.blocks == len(tree)
    assert all(n.live for n in tree)
    paths = [s.prefix.path for s in core.scheduler.running if s.prefix is not None]
    assert all(n.live for path in paths for n in path)
    locks: dict[int, int] = {}
    for path in paths:
        if path:
            locks[id(path[-1])] = locks.get(id(path[-1]), 0) + 1
    assert {id(n): n.refs for n in tree if n.refs} == locks


# ------------------------------------------------------------------ parity, every method


PARITY = [
    ("dense", "off"),
    ("dense", "ngram"),
    ("dense", "draft"),
    ("hybrid", "off"),
    ("hybrid", "ngram"),
    ("hybrid", "draft"),
    ("hybrid", "mtp"),
    ("hybrid", "eagle3"),
    ("static", "off"),
    ("static", "draft"),
]


@pytest.mark.parametrize(("target", "method"), PARITY, ids=[f"{t}-{m}" for t, m in PARITY])
def test_prefix_cache_greedy_equals_cache_off(
    target: str,
    method: str,
    dense: LoadedModel,
    hybrid: LoadedModel,
    static: LoadedModel,
    near_draft_dir: Path,
    hybrid_draft_dir: Path,
    hybrid_eagle3_dir: Path,
) -> None:
    lm = {"dense": dense, "hybrid": hybrid, "static": static}[target]
    draft_dir = hybrid_draft_dir if target == "hybrid" else near_draft_dir
    if method == "eagle3":
        draft_dir = hybrid_eagle3_dir
    expected, cold, _ = conversation(lm, speculation(lm, method, draft_dir), OFF)
    got, seqs, core = conversation(lm, speculation(lm, method, draft_dir), CACHE, invariants)
    assert got == expected
    # a restored drafter state is the one a cold run builds: the same drafts, accepted alike
    drafts = [(s.request.spec.drafted, s.request.spec.accepted) for s in seqs]
    assert drafts == [(s.request.spec.drafted, s.request.spec.accepted) for s in cold]
    turn2, split, repeat, short = seqs[2:]
    assert turn2.cached_tokens >= (len(seqs[0].request.prompt_ids) // 16) * 16 > 0
    if target != "hybrid":  # block-granular: the split prompt reuses its 5 whole blocks
        assert split.cached_tokens == 5 * CACHE.block_size
        assert repeat.cached_tokens == (len(repeat.request.prompt_ids) - 1) // 8 * 8
    else:  # from the deepest snapshot (every 16 tokens) at or before the match
        assert split.cached_tokens == 32
        assert repeat.cached_tokens == (len(repeat.request.prompt_ids) - 1) // 16 * 16
    assert short.cached_tokens == 0
    stats = core.stats.prefix_cache
    assert stats is not None
    assert stats.hits == sum(s.cached_tokens for s in seqs) > 0
    assert stats.queries == sum(len(s.request.prompt_ids) for s in seqs)
    assert core.prefix is not None and all(n.refs == 0 for n in nodes(core.prefix))
    if method != "off":  # verify and rollback both ran with the cache on
        drafted = sum(s.request.spec.drafted for s in seqs)
        accepted = sum(s.request.spec.accepted for s in seqs)
        assert 0 < accepted < drafted
    if method in ("draft", "mtp", "eagle3"):  # the drafter's blocks were cached and restored
        assert any(n.drafts for n in nodes(core.prefix))


@needs_kernel
def test_prefix_cache_bf16_greedy_equals_cache_off(
    bf16_pair: tuple[Path, Path], kernels_enabled: None
) -> None:
    """bf16 on the batch-invariant kernels: a block's KV has the same bits whichever chunk and
    batch computed it, so outputs stay identical with the cache (draft model included)."""
    target, draft = bf16_pair
    lm = load(str(target), "bf16", progress=False)
    expected, cold, _ = conversation(lm, speculation(lm, "draft", draft), OFF)
    got, seqs, _ = conversation(lm, speculation(lm, "draft", draft), CACHE, invariants)
    assert got == expected and sum(s.cached_tokens for s in seqs) > 0
    drafts = [(s.request.spec.drafted, s.request.spec.accepted) for s in seqs]
    assert drafts == [(s.request.spec.drafted, s.request.spec.accepted) for s in cold]


def test_prefix_cache_hit_skips_prefill_rows(dense: LoadedModel) -> None:
    enc = dense.tokenizer.encode
    prompt = enc(SYSTEM * 3 + "first")
    for prefix in (OFF, CACHE):
        core = EngineCore(dense, SMALL, prefix)
        run(core, dense, None, [prompt])
        cold = core.stats.prefill_rows
        second = run(core, dense, None, [enc(SYSTEM * 3 + "second question")])[0]
        rows = core.stats.prefill_rows - cold
        if prefix.enabled:
            assert second.cached_tokens == len(enc(SYSTEM * 3)) // 8 * 8 > 100
            assert rows == len(second.request.prompt_ids) - second.cached_tokens
        else:
            assert second.cached_tokens == 0 and rows == len(second.request.prompt_ids)


def test_requests_arriving_together_prefill_a_shared_prompt_once(dense: LoadedModel) -> None:
    """n choices of one request (or a burst with one system prompt), submitted together: one
    prefills, the others wait for it and copy its blocks; outputs equal the cache off."""
    enc = dense.tokenizer.encode
    prompts = [enc(SYSTEM * 3 + "same question")] * 3 + [enc(SYSTEM * 3 + "other")]
    outputs = {}
    for prefix in (OFF, CACHE):
        core = EngineCore(dense, SMALL, prefix)
        seqs = run(core, dense, None, prompts)
        outputs[prefix.enabled] = [s.request.output_ids for s in seqs]
        if prefix.enabled:
            cached = [s.cached_tokens for s in seqs]
            assert cached[0] == 0 and all(c >= len(enc(SYSTEM * 3)) // 8 * 8 for c in cached[1:])
            assert core.stats.prefill_rows == sum(len(p) for p in prompts) - sum(cached)
    assert outputs[True] == outputs[False]


def test_prefix_cache_hit_skips_the_draft_models_prefill(
    dense: LoadedModel, near_draft_dir: Path
) -> None:
    """A hit restores the draft model's KV as well: its first catch-up feeds only the rest."""
    spec = speculation(dense, "draft", near_draft_dir)
    assert spec is not None
    enc = dense.tokenizer.encode
    core = EngineCore(dense, SMALL, CACHE)
    run(core, dense, spec, [enc(SYSTEM * 3 + "first")])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    seq = core.add(dense.new_request(enc(SYSTEM * 3 + "second"), params), spec)
    while not seq.request.output_ids:  # prefill
        core.step()
    assert seq.spec is not None and seq.cached_tokens > 100
    assert seq.spec.draft_state.cache.length == seq.cached_tokens == seq.spec.synced
    tokens = len(seq.request.all_ids)
    core.step()  # the first propose: the draft model feeds the rest of the prompt, not all
    fed = sum(shape.rows for shape in spec.drafter.forwards)
    assert fed == tokens - seq.cached_tokens + 2  # + d_1, d_2 (k = 3)
    while core.has_work:
        core.step()


# ------------------------------------------------------------------ cancel, evict


def test_prefix_cache_cancel_while_sharing_blocks(dense: LoadedModel, near_draft_dir: Path) -> None:
    """Four requests share a system prompt and hit blocks a first request left; two are
    cancelled mid-decode (one right after admission): the others' outputs are unchanged and
    every lock is released."""
    spec = speculation(dense, "draft", near_draft_dir)
    enc = dense.tokenizer.encode
    prompts = [
        enc(SYSTEM + f"Question {i}: how many legs has a {w}?")
        for i, w in enumerate(["cat", "bird", "spider", "snake"])
    ]

    def cancel(step: int, seqs: list[Sequence]) -> None:
        if step == 2:
            core.abort(seqs[1])
        if step == 12:
            core.abort(seqs[2])

    expected = []
    for p in prompts:
        alone = EngineCore(dense, SMALL, OFF)
        expected.append(run(alone, dense, spec, [p], max_tokens=20)[0].request.output_ids)
    core = EngineCore(dense, SMALL, CACHE)
    run(core, dense, spec, [enc(SYSTEM + "warm up")], check=invariants)
    seqs = run(core, dense, spec, prompts, max_tokens=20, check=invariants, cancel=cancel)
    assert [s.request.finish_reason for s in seqs] == [
        FinishReason.LENGTH,
        FinishReason.ABORT,
        FinishReason.ABORT,
        FinishReason.LENGTH,
    ]
    assert all(s.cached_tokens > 0 for s in seqs)
    assert seqs[0].request.output_ids == expected[0]
    assert seqs[3].request.output_ids == expected[3]
    for got, want in zip(seqs[1:3], expected[1:3], strict=True):
        assert got.request.output_ids == want[: len(got.request.output_ids)]
    assert core.prefix is not None and all(n.refs == 0 for n in nodes(core.prefix))
    # the cancelled requests' blocks stay usable: a repeat of one hits them
    again = run(core, dense, spec, [prompts[2]], max_tokens=20)[0]
    assert again.cached_tokens > len(enc(SYSTEM)) and again.request.output_ids == expected[2]


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_prefix_cache_eviction_under_a_tiny_budget(
    target: str, dense: LoadedModel, hybrid: LoadedModel
) -> None:
    """A budget of a few blocks and 8 requests (4 at a time) whose prompts overlap: blocks are
    evicted and inserts refused, yet no request fails, outputs equal the cache-off run, no
    block a running sequence holds is freed, and the bytes never pass the budget."""
    lm = dense if target == "dense" else hybrid
    enc = lm.tokenizer.encode
    probe = EngineCore(lm, SMALL, CACHE)
    run(probe, lm, None, [enc("x" * 9)], max_tokens=1)
    assert probe.prefix is not None
    block_bytes = max(n.nbytes for n in nodes(probe.prefix))
    tiny = PrefixCacheConfig(block_size=8, snapshot_every=2, max_gb=6 * block_bytes / 1e9)
    topics = ["ships", "trains", "ships", "planes", "trains", "ships", "bikes", "cars"]
    prompts = [enc(SYSTEM[: 17 + 5 * i] + f" Tell me about {t}.") for i, t in enumerate(topics)]
    expected = [s.request.output_ids for s in run(EngineCore(lm, SMALL, OFF), lm, None, prompts)]
    core = EngineCore(lm, SMALL, tiny)
    seqs = run(core, lm, None, prompts, check=invariants)
    assert [s.request.output_ids for s in seqs] == expected
    assert all(s.request.finish_reason == FinishReason.LENGTH for s in seqs)
    stats = core.stats.prefix_cache
    assert stats is not None and stats.evicted > 0 and stats.refused > 0
    assert core.stats.failed == 0


def test_prefix_cache_never_evicts_a_block_in_use(dense: LoadedModel) -> None:
    """Budget: 3 blocks. A leaves 3 blocks (one piece: one commit made them whole); B hits all
    3 and holds them while it prefills; C's inserts find nothing unlocked to evict and are
    refused (B's path intact); once B has left, D's inserts evict the least recently used
    blocks instead: all 3 of A's, leaf first, as the piece's memory goes with its last block."""
    model = dense.model
    block = model.new_cache(8)
    model(torch.arange(8), [block], [8])
    block.commit(8)
    size = block.export_kv(0, 8).nbytes
    cache = PrefixCache(PrefixCacheConfig(block_size=8, max_gb=3 * size / 1e9), model.device)

    def prefill(tokens: list[int]) -> tuple[PrefixCursor, SequenceCache]:
        seq_cache = model.new_cache(len(tokens))
        cur = cache.admit(tokens, seq_cache, None)
        rest = tokens[seq_cache.length :]
        model(torch.tensor(rest), [seq_cache], [len(rest)])
        seq_cache.commit(len(tokens))
        cache.extend(cur, tokens, seq_cache, None)
        return cur, seq_cache

    a = list(range(10, 34))  # 3 blocks
    cur_a, _ = prefill(a)
    cache.leave(cur_a, None, failed=False)
    cur_b, _ = prefill([*a, *range(50, 58)])  # 32 tokens: hits 3 blocks, may insert a 4th
    assert cur_b.cached_tokens == 24 and len(cur_b.path) == 3 and cache.stats.refused == 1
    cur_c, _ = prefill(list(range(100, 116)))  # 2 blocks: no room, nothing evictable
    assert cur_c.path == [] and cache.stats.evicted == 0 and cache.stats.refused == 2
    assert all(n.live for n in cur_b.path) and cache.stats.blocks == 3
    cache.leave(cur_b, None, failed=False)
    cache.leave(cur_c, None, failed=False)
    cur_d, _ = prefill(list(range(100, 116)))
    assert len(cur_d.path) == 2 and cache.stats.evicted == 3
    assert sorted(n.tokens[0] for n in nodes(cache)) == [100, 108]
    assert cache.stats.bytes == 2 * size == held_bytes(nodes(cache))


def test_prefix_cache_evicting_a_tenants_last_block(dense: LoadedModel) -> None:
    """Budget: 1 block. A tenant's only block is evicted to make room for its next request's
    first block: the new block is in the tree (not in a dropped root map), and evicting it in
    turn works."""
    model = dense.model
    probe = model.new_cache(8)
    model(torch.arange(8), [probe], [8])
    probe.commit(8)
    size = probe.export_kv(0, 8).nbytes
    cache = PrefixCache(PrefixCacheConfig(block_size=8, max_gb=size / 1e9), model.device)
    for first in (10, 50, 90):
        tokens = list(range(first, first + 9))
        seq_cache = model.new_cache(len(tokens))
        cur = cache.admit(tokens, seq_cache, None, tenant="t")
        model(torch.tensor(tokens), [seq_cache], [len(tokens)])
        seq_cache.commit(len(tokens))
        cache.extend(cur, tokens, seq_cache, None)
        cache.leave(cur, None, failed=False)
        assert [n.tokens[0] for n in nodes(cache)] == [first]
        assert cache.stats.blocks == 1 and cache.stats.bytes == size
    assert cache.stats.evicted == 2


# ------------------------------------------------------------------ engine, config, CLI


def test_engine_reports_cached_tokens(dense: LoadedModel) -> None:
    engine = Engine({"tiny": ServedModel(dense)}, prefix_cache=CACHE)
    engine.start()
    try:
        ids = dense.tokenizer.encode(SYSTEM * 2 + "hello")
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        first = list(engine.submit("tiny", ids, params))
        second = list(engine.submit("tiny", ids, params))
    finally:
        engine.stop()
    assert {o.cached_tokens for o in first} == {0}
    assert {o.cached_tokens for o in second} == {(len(ids) - 1) // 8 * 8}
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    stats = engine.step_stats["tiny"].prefix_cache
    assert stats is not None and stats.hits == (len(ids) - 1) // 8 * 8


def test_prefix_cache_config_and_flags() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixCacheConfig(block_size=0)
    with pytest.raises(ValueError, match="budget"):
        PrefixCacheConfig(max_gb=-1.0)
    parser = build_parser()
    assert prefix_cache_config(parser.parse_args(["serve"])) == PrefixCacheConfig()
    args = parser.parse_args(["serve", "--prefix-cache-gb", "2.5", "--prefix-block-size", "32"])
    assert prefix_cache_config(args) == PrefixCacheConfig(max_gb=2.5, block_size=32)
    off = prefix_cache_config(parser.parse_args(["serve", "--no-prefix-cache"]))
    assert not off.enabled


# ------------------------------------------------------------------ cache primitives


def test_kv_export_import_round_trip(dense: LoadedModel) -> None:
    model = dense.model
    cache = model.new_cache(8)
    ids = torch.arange(3, 40)
    model(ids, [cache], [len(ids)])
    cache.commit(len(ids))
    blocks = [cache.export_kv(0, 16), cache.export_kv(16, 32)]
    fresh = model.new_cache(4)  # grows to take them
    fresh.import_kv(blocks)
    assert fresh.length == 32
    assert torch.equal(fresh.export_kv(0, 32).k, cache.export_kv(0, 32).k)
    assert torch.equal(fresh.export_kv(0, 32).v, cache.export_kv(0, 32).v)
    # a cached block is a copy: rolling the source back into it and writing over it leaves
    # the block as it was (copy-on-write is implicit)
    before = blocks[1].k.clone()
    cache.commit(20)
    model(torch.arange(200, 220), [cache], [20])
    cache.commit(40)
    assert not torch.equal(cache.export_kv(16, 32).k, before)
    assert torch.equal(blocks[1].k, before)


@needs_kernel
def test_kv_import_reads_shared_blocks_in_place(
    bf16_pair: tuple[Path, Path], kernels_enabled: None
) -> None:
    """Where the attention kernel reads blocks in place (head_dim 32, on the CPU), an import
    keeps the blocks themselves: no copy, the sequence's own rows start after them, a forward
    over them (the C++ layers included) gives a cold cache's bits, a rollback and a rewrite
    leave them as they were, and exporting a shared block hands back the block."""
    model = load(str(bf16_pair[0]), "bf16", progress=False).model
    ids = torch.arange(3, 60)
    cold = model.new_cache(80)
    model(ids[:32], [cold], [32])
    cold.commit(32)
    blocks = [cold.export_kv(0, 16), cold.export_kv(16, 32)]
    fresh = model.new_cache(80)
    fresh.import_kv(blocks)
    assert isinstance(fresh, KVCache) and fresh.length == fresh.base == 32
    assert all(a is b for a, b in zip(fresh.shared, blocks, strict=True))
    assert fresh.export_kv(16, 32) is blocks[1]
    assert fresh.nbytes() < cold.nbytes()  # its own rows only
    before = [b.k.clone() for b in blocks]
    rows = torch.arange(len(ids) - 32)
    for cache in (cold, fresh):  # the rest as one chunk: every row's logits
        cache.reserve(len(rows))
    want = model(ids[32:], [cold], [len(rows)], logit_rows=rows).logits
    got = model(ids[32:], [fresh], [len(rows)], logit_rows=rows).logits
    assert torch.equal(got, want)
    for cache in (cold, fresh):  # keep 3 of them, then a different verify over the rest
        cache.commit(35)
        model(torch.arange(200, 206), [cache], [6])
        cache.commit(41)
    assert torch.equal(fresh.export_kv(0, 41).k, cold.export_kv(0, 41).k)
    assert torch.equal(fresh.export_kv(8, 40).v, cold.export_kv(8, 40).v)
    assert all(torch.equal(b.k, k) for b, k in zip(blocks, before, strict=True))


def test_hybrid_snapshot_equals_a_cold_prefill(hybrid: LoadedModel) -> None:
    """The state after position p taken from a verify-sized forward's checkpoints (p inside
    it) and from a long prompt forward equals, bit for bit, a fresh cache's state after
    prefilling exactly p tokens; a cache resumed from it continues identically."""
    model = hybrid.model
    ids = torch.arange(5, 69) % 250
    cold = model.new_cache(80)
    model(ids[:45], [cold], [45])  # long forward: only the final state is kept
    cold.commit(45)
    warm = model.new_cache(80)
    model(ids[:40], [warm], [40])
    warm.commit(40)
    model(ids[40:48], [warm], [8])  # a short forward (a verify of 7 drafts)
    warm.commit(47)  # 7 kept
    assert isinstance(cold, HybridCache) and isinstance(warm, HybridCache)
    snap, ref = warm.state_at(45), cold.state_at(45)
    assert snap is not None and ref is not None
    assert torch.equal(snap.conv, ref.conv) and torch.equal(snap.ssm, ref.ssm)
    assert warm.state_at(39) is None and warm.state_at(48) is None
    resumed = model.new_cache(8)
    resumed.import_kv([cold.export_kv(0, 45)], snap)
    out_a = model(ids[45:60], [resumed], [15]).logits
    out_b = model(ids[45:60], [cold], [15]).logits
    assert torch.equal(out_a, out_b)


def test_prefix_cache_is_per_tenant(dense: LoadedModel) -> None:
    """A hit shows (cached_tokens, TTFT): one tenant's prompts never serve another's."""
    core = EngineCore(dense, SMALL, CACHE)
    prompt = dense.tokenizer.encode(SYSTEM * 2 + "hello")
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def send(tenant: str) -> int:
        seq = core.add(dense.new_request(prompt, params, tenant=tenant), None)
        while core.has_work:
            core.step()
        return seq.cached_tokens

    assert send("key0") == 0
    assert send("key1") == 0
    assert send("key0") == send("key1") == (len(prompt) - 1) // 8 * 8
    assert core.prefix is not None and set(core.prefix.roots) == {"key0", "key1"}
