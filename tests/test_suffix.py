"""Suffix-tree drafter tests (over 400 lines: each fast path beside its naive reference).

The tree against naive substring counts (incremental == rebuild, removal, compression), the
drafts against a naive scan, the per-tenant shared trees, and end to end on a tiny fp32 model:
greedy and seeded sampling identical to speculation off, sampled output keeps the target's
distribution, and a tenant never drafts from another tenant's outputs."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from second_token import assert_second_token_follows, plain_distribution, second_token_marginal

from quickdraft.cli import build_parser, spec_config
from quickdraft.config import SpeculativeConfig, parse_speculative_config
from quickdraft.engine import stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.drafters.suffix import Node, SuffixDrafter, SuffixTree
from quickdraft.speculation.factory import make_speculation
from quickdraft.speculation.state import Speculation

PARAMS = SamplingParams()
GEN = torch.Generator()


def propose(
    drafter: SuffixDrafter, tokens: list[int], k: int, state: object = None, tenant: str = ""
) -> list[int]:
    state = drafter.new_state(tokens, tenant) if state is None else state
    (draft,) = drafter.propose([DraftJob(state, tokens, k, PARAMS, GEN)])
    assert draft.p_draft is None  # suffix drafts are one-hot
    return draft.tokens


def build(seqs: Sequence[list[int]], depth: int) -> SuffixTree:
    tree = SuffixTree(depth)
    for seq in seqs:
        tree.extend(tree.cursor(seq))
    return tree


# --- naive references: scans of the raw tokens, written independently of the tree --------------


def naive_nodes(seqs: Sequence[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """The strings a path-compressed tree of every substring of <= depth tokens must have a node
    for (an inserted suffix ends there, or its continuations branch), with occurrence counts."""
    counts: dict[tuple[int, ...], int] = {}
    ends: set[tuple[int, ...]] = set()
    nexts: dict[tuple[int, ...], set[int]] = {}
    for seq in seqs:
        for s in range(len(seq)):
            end = min(s + depth, len(seq))
            ends.add(tuple(seq[s:end]))
            for j in range(s + 1, end + 1):
                string = tuple(seq[s:j])
                counts[string] = counts.get(string, 0) + 1
                if j < end:
                    nexts.setdefault(string, set()).add(seq[j])
    return {x: c for x, c in counts.items() if x in ends or len(nexts.get(x, ())) >= 2}


def naive_walk(
    seqs: Sequence[list[int]], string: list[int], limit: int, min_prob: float, depth: int
) -> tuple[list[int], float]:
    """SuffixDecoding's greedy path from `string`: at each step the token that most often
    followed it (the latest among equals; clock = position over all sequences in order)."""
    string, out = list(string), []
    prob, score = 1.0, 0.0
    while len(out) < limit and len(string) < depth:
        follow: dict[int, tuple[int, int]] = {}  # token -> (count, latest clock)
        base = 0
        for seq in seqs:
            n = len(string)
            for end in range(n, len(seq)):
                if seq[end - n : end] == string:
                    count, _ = follow.get(seq[end], (0, 0))
                    follow[seq[end]] = (count + 1, base + end)
            base += len(seq)
        if not follow:
            break
        token = max(follow, key=follow.__getitem__)
        prob *= follow[token][0] / sum(c for c, _ in follow.values())
        if prob < min_prob:
            break
        out.append(token)
        string.append(token)
        score += prob
    return out, score


def naive_best(
    seqs: Sequence[list[int]], context: list[int], k: int, drafter: SuffixDrafter
) -> tuple[list[int], float]:
    """The best-scoring draft over every match length (a tie to the longer match)."""
    best: list[int] = []
    best_score = 0.0
    for m in range(1, min(drafter.max_depth, len(context) + 1)):
        limit = min(k, int(m * drafter.max_spec_factor + 1e-6))
        draft, score = naive_walk(
            seqs, context[-m:], limit, drafter.min_token_prob, drafter.max_depth
        )
        if draft and score >= best_score:
            best, best_score = draft, score
    return best, best_score


def check_structure(tree: SuffixTree) -> int:
    """Parent links, keys and labels are consistent; returns the number of nodes."""
    nodes, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node and child.length >= 1 and child.seq[child.start] == key
            stack.append(child)
            nodes += 1
    return nodes


def all_nodes(tree: SuffixTree) -> list[Node]:
    out, stack = [], list(tree.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


# --- the tree ---------------------------------------------------------------------------------


def test_suffix_tree_counts_substring_occurrences() -> None:
    tree = build([[1, 2, 3, 1, 2, 4]], depth=3)
    got = tree.counts()
    assert got[(1, 2)] == 2  # a branch: followed by 3 and by 4
    assert got[(2,)] == 2 and got[(4,)] == 1
    assert got[(1, 2, 3)] == 1 and got[(1, 2, 4)] == 1  # depth 3: (1, 2, 3, 1) is cut
    assert (1,) not in got  # 1 is always followed by 2: no node of its own, part of an edge
    assert got == naive_nodes([[1, 2, 3, 1, 2, 4]], 3)


@pytest.mark.parametrize("depth", [2, 3, 5], ids=lambda d: f"depth{d}")
def test_suffix_tree_incremental_matches_naive_and_rebuild(depth: int) -> None:
    """Sequences grown a few tokens at a time, some removed again (any order): after every
    change the tree is exactly the naive node set of what is in it, and the same as a tree
    built from scratch from the sequences kept."""
    rng = random.Random(depth)
    for _ in range(300):
        vocab = rng.randint(1, 4)
        tree = SuffixTree(depth)
        kept: list[list[int]] = []
        for _ in range(rng.randint(1, 5)):
            seq: list[int] = []
            cursor = tree.cursor(seq)
            for _ in range(rng.randint(0, 4)):
                seq.extend(rng.randrange(vocab) for _ in range(rng.randint(0, 5)))
                tree.extend(cursor)
                check_structure(tree)
                assert tree.counts() == naive_nodes([*kept, seq], depth), (kept, seq)
            kept.append(seq)
            if rng.random() < 0.5:
                gone = kept.pop(rng.randrange(len(kept)))
                tree.remove(gone)
                check_structure(tree)
                assert all(node.seq is not gone for node in all_nodes(tree))
                gone[:] = [99] * len(gone)  # no label may still read it
                assert tree.counts() == naive_nodes(kept, depth) == build(kept, depth).counts()


def test_suffix_tree_is_path_compressed() -> None:
    """A block repeated four times at depth 64 has ~64 x 2000 substrings of <= 64 tokens but
    O(tokens) nodes: unique stretches and repeats are single edges."""
    rng = random.Random(1)
    block = [rng.randrange(1000) for _ in range(500)]
    tree = build([block * 4], depth=64)
    assert check_structure(tree) <= 2 * len(block) * 4 + 64
    assert tree.counts()[tuple(block[:64])] == 4


def test_suffix_tree_insertion_cost_is_incremental() -> None:
    """1000 one-token cycles through the drafter: the counts are exact (a rescan of the
    history would count its substrings again) and equal to a tree built in one go."""
    drafter = SuffixDrafter(max_depth=8)
    rng = random.Random(0)
    tokens: list[int] = []
    state = drafter.new_state(tokens)
    for _ in range(1000):  # one token per cycle, as in decode
        tokens = [*tokens, rng.randrange(6)]
        drafter.commit(state, tokens)
        drafter.propose([DraftJob(state, tokens, 4, PARAMS, GEN)])
    assert state.tree.counts() == naive_nodes([tokens], 8) == build([tokens], 8).counts()


# --- drafting -----------------------------------------------------------------------------------


def test_suffix_draft_length_follows_match_length() -> None:
    tokens = [10, 11, 12, 13, 14, 99, 10, 11, 12]
    # the context's last 3 tokens occurred before: at most floor(1.0 x 3) = 3 drafts, although
    # k = 5 and the earlier occurrence goes on longer
    assert propose(SuffixDrafter(), tokens, 5) == [13, 14, 99]
    assert propose(SuffixDrafter(max_spec_factor=2.0), tokens, 5) == [13, 14, 99, 10, 11]
    assert propose(SuffixDrafter(max_spec_factor=0.5), tokens, 5) == [13]
    assert propose(SuffixDrafter(), tokens, 2) == [13, 14]  # k caps it


def test_suffix_prefers_most_frequent_then_most_recent_continuation() -> None:
    # (1, 2) was followed by 5 twice and by 6 once (most recently): 5 wins, probability 2/3
    assert propose(SuffixDrafter(), [1, 2, 5, 1, 2, 5, 1, 2, 6, 1, 2], 1) == [5]
    assert propose(SuffixDrafter(min_token_prob=0.7), [1, 2, 5, 1, 2, 5, 1, 2, 6, 1, 2], 1) == []
    # equal counts: the most recently seen
    assert propose(SuffixDrafter(), [1, 2, 5, 1, 2, 6, 1, 2], 1) == [6]


def test_suffix_stops_where_path_probability_falls_below_floor() -> None:
    # after (3, 4) (no longer match: 1 is new): 7 always (p = 1), then 8 or 9 once each
    # (p = 1/2; 9 the most recent)
    tokens = [3, 4, 7, 8, 0, 3, 4, 7, 9, 1, 3, 4]
    assert propose(SuffixDrafter(min_token_prob=0.6, max_spec_factor=4), tokens, 3) == [7]
    assert propose(SuffixDrafter(min_token_prob=0.5, max_spec_factor=4), tokens, 3) == [7, 9, 1]


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param([], id="empty"),
        pytest.param([4], id="one_token"),
        pytest.param([1, 2, 3, 4, 5, 6], id="no_repeat"),
        pytest.param([5, 6, 7], id="never_matches_itself"),
    ],
)
def test_suffix_no_hit_proposes_nothing(tokens: list[int]) -> None:
    assert propose(SuffixDrafter(), tokens, 4) == []


@pytest.mark.parametrize(
    ("depth", "factor", "min_prob"),
    [
        pytest.param(4, 1.0, 0.1, id="depth4"),
        pytest.param(8, 1.0, 0.1, id="depth8"),
        pytest.param(6, 2.5, 0.3, id="factor2.5"),
        pytest.param(64, 1.0, 0.0, id="depth64-floor0"),
    ],
)
def test_suffix_drafts_match_naive_scan(depth: int, factor: float, min_prob: float) -> None:
    """Requests growing a few tokens per cycle, finished ones learned into the shared tree: every
    draft is the naive scan's best of the request's own tokens and of the kept outputs."""
    rng = random.Random(depth)
    drafter = SuffixDrafter(depth, factor, min_prob, shared_tokens=60)
    for _ in range(40):
        vocab = rng.randint(2, 5)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        state = drafter.new_state(tokens)
        for _ in range(rng.randint(3, 12)):
            tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
            if rng.random() < 0.5:
                drafter.commit(state, tokens)
            k = rng.randint(0, 7)
            own, own_score = naive_best([tokens], tokens, k, drafter)
            outputs = [out for _, out in drafter.learned]
            shared, shared_score = naive_best(outputs, tokens, k, drafter)
            want = shared if shared_score > own_score else own
            assert propose(drafter, tokens, k, state) == want, (tokens, k)
        drafter.commit(state, tokens)
        drafter.free(state)


def test_suffix_commit_of_shorter_tokens_rebuilds() -> None:
    drafter = SuffixDrafter(max_spec_factor=4)
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    state = drafter.new_state(tokens)
    assert propose(drafter, tokens, 1, state) == [4]
    drafter.commit(state, tokens[:5])  # [1, 2, 3, 1, 2]: the (1, 2) -> 4 occurrence is gone
    assert state.tree.counts() == naive_nodes([tokens[:5]], drafter.max_depth)
    assert propose(drafter, tokens[:5], 1, state) == [3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"max_depth": 1}, "max_depth", id="depth"),
        pytest.param({"max_spec_factor": 0.0}, "max_spec_factor", id="factor"),
        pytest.param({"min_token_prob": 1.5}, "min_token_prob", id="prob"),
        pytest.param({"shared_tokens": -1}, "shared_tokens", id="budget"),
    ],
)
def test_suffix_rejects_bad_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SuffixDrafter(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(method="suffix", **{f"suffix_{k}": v for k, v in kwargs.items()})  # type: ignore[arg-type]


def test_suffix_vllm_speculative_config_maps_to_ours() -> None:
    fields = parse_speculative_config(
        '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32,'
        ' "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.2}'
    )
    assert SpeculativeConfig(**fields) == SpeculativeConfig(  # type: ignore[arg-type]
        method="suffix",
        num_draft_tokens=8,
        suffix_max_depth=32,
        suffix_max_spec_factor=2.0,
        suffix_min_token_prob=0.2,
    )


@pytest.mark.parametrize(
    "command", [["serve", "m"], ["generate", "--model", "m"], ["bench", "--model", "m"]]
)
def test_suffix_cli_flags_mean_the_same_everywhere(command: list[str]) -> None:
    flags = ["--speculative-method", "suffix", "--suffix-max-depth", "32"]
    flags += ["--suffix-max-spec-factor", "1.5", "--suffix-min-token-prob", "0.25"]
    flags += ["--suffix-shared-tokens", "0"]
    cfg = spec_config(build_parser().parse_args([*command, *flags]))
    assert cfg == SpeculativeConfig(
        method="suffix",
        suffix_max_depth=32,
        suffix_max_spec_factor=1.5,
        suffix_min_token_prob=0.25,
        suffix_shared_tokens=0,
    )


# --- the shared trees ---------------------------------------------------------------------------


def finish(drafter: SuffixDrafter, prompt: list[int], output: list[int], tenant: str = "") -> None:
    """One request through the drafter: prompt, its committed output, then free."""
    state = drafter.new_state(prompt, tenant)
    drafter.commit(state, prompt + output)
    drafter.free(state)


def test_suffix_shared_tree_learns_finished_outputs() -> None:
    drafter = SuffixDrafter(max_spec_factor=2)
    finish(drafter, [50, 51, 52], [1, 2, 3, 4, 5])
    # a new request whose own tokens never saw (1, 2) drafts what followed it in that output
    assert propose(drafter, [7, 8, 1, 2], 4) == [3, 4, 5]
    # its own tokens, where they score higher: here (1, 2) was followed by 9 (2 matched tokens
    # and 2 drafts, the same length as the shared match: the request's own wins the tie)
    assert propose(drafter, [1, 2, 9, 8, 1, 2], 2) == [9, 8]
    # the prompt is not learned (only outputs), and substrings never span two outputs
    assert propose(drafter, [60, 50, 51], 2) == []
    finish(drafter, [50], [6, 7, 8])
    assert propose(drafter, [0, 4, 5], 2) == []  # (4, 5) ended an output: nothing followed
    assert propose(drafter, [0, 5, 6], 2) == [7, 8]  # 6 -> 7 8 within the second output only
    off = SuffixDrafter(shared_tokens=0)
    finish(off, [50, 51, 52], [1, 2, 3, 4, 5])
    assert propose(off, [7, 8, 1, 2], 4) == [] and off.shared_size == 0


def test_suffix_shared_tree_is_per_tenant() -> None:
    """A request drafts only from its own tenant's finished outputs."""
    drafter = SuffixDrafter(max_spec_factor=2)
    finish(drafter, [50, 51, 52], [1, 2, 3, 4, 5], tenant="a")
    assert propose(drafter, [7, 8, 1, 2], 4, tenant="b") == []
    assert propose(drafter, [7, 8, 1, 2], 4) == []  # "" is a tenant like any other
    assert propose(drafter, [7, 8, 1, 2], 4, tenant="a") == [3, 4, 5]
    finish(drafter, [50], [1, 2, 9, 9], tenant="b")
    assert propose(drafter, [7, 8, 1, 2], 4, tenant="b") == [9, 9]
    assert propose(drafter, [7, 8, 1, 2], 4, tenant="a") == [3, 4, 5]


def test_suffix_shared_trees_keep_the_newest_outputs_within_budget() -> None:
    """Over random outputs, tenants and budgets: the newest outputs of all tenants together fit
    the one budget, and each tenant's tree is exactly a tree of its own kept outputs."""
    rng = random.Random(4)
    for budget in (6, 10, 25):
        drafter = SuffixDrafter(max_depth=4, shared_tokens=budget)
        learned: list[tuple[str, list[int]]] = []
        for _ in range(60):
            output = [rng.randrange(4) for _ in range(rng.randint(0, 9))]
            tenant = rng.choice("abc")
            finish(drafter, [9], output, tenant)
            if len(output) > 1:
                learned.append((tenant, output[-budget:]))
            kept = list(drafter.learned)
            assert kept == learned[len(learned) - len(kept) :]  # the newest, in order
            assert drafter.shared_size == sum(len(out) for _, out in kept) <= budget
            assert set(drafter.shared) == {t for t, _ in kept}  # no empty tenant is kept
            for name, scope in drafter.shared.items():
                mine = [out for t, out in kept if t == name]
                assert scope.size == sum(map(len, mine))
                assert scope.tree.counts() == naive_nodes(mine, 4)


# --- end to end (tiny fp32 model) -----------------------------------------------------------------

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(",
    "the cat sat on the mat. the cat sat on the",
    '{"name": "x", "id": 1}, {"name": "y", "id": 2}, {"name": ',
    "abcabcabcabc",
    "for i in range(10):\n    print(i)\nfor j in range(",
    "zzz yyy xxx zzz yyy",
]
SUFFIX = SpeculativeConfig(method="suffix", num_draft_tokens=4, adaptive=False)


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


def run(lm: LoadedModel, prompt: str, params: SamplingParams, spec: Speculation | None) -> Request:
    req = lm.new_request(lm.tokenizer.encode(prompt), params)
    for _ in stream(lm, req, spec):
        pass
    return req


def test_suffix_factory_passes_the_settings(target: LoadedModel) -> None:
    cfg = SpeculativeConfig(
        method="suffix",
        suffix_max_depth=32,
        suffix_max_spec_factor=1.5,
        suffix_min_token_prob=0.25,
        suffix_shared_tokens=100,
    )
    spec = make_speculation(target, cfg)
    assert spec is not None and spec.draft_cost is None  # a lookup: free, no cost table
    drafter = spec.drafter
    assert isinstance(drafter, SuffixDrafter) and drafter.forwards == []
    assert (drafter.max_depth, drafter.max_spec_factor) == (32, 1.5)
    assert (drafter.min_token_prob, drafter.shared_tokens) == (0.25, 100)


def test_suffix_greedy_equals_plain_across_requests(target: LoadedModel) -> None:
    """One suffix Speculation serves every prompt twice: outputs token-identical to
    speculation off, drafts accepted and rejected, and the second pass (its shared tree holding
    each prompt's earlier output) accepts more."""
    spec = make_speculation(target, SUFFIX)
    assert spec is not None and isinstance(spec.drafter, SuffixDrafter)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = [run(target, p, params, None).output_ids for p in PROMPTS]
    accepted, drafted = [], 0
    for _ in range(2):
        total = 0
        for prompt, want in zip(PROMPTS, plain, strict=True):
            req = run(target, prompt, params, spec)
            assert req.output_ids == want, prompt
            total += req.spec.accepted
            drafted += req.spec.drafted
        accepted.append(total)
        assert spec.drafter.shared_size > 0
    assert accepted[0] > 0 and sum(accepted) < drafted  # kept and rejected drafts: rollback ran
    assert accepted[1] > accepted[0] + len(PROMPTS) * 4, accepted


def test_suffix_seeded_sampling_equals_speculation_off(target: LoadedModel) -> None:
    """A seeded sampled request emits the same tokens with suffix drafts as without: one-hot
    drafts are verified against the per-position draws plain sampling makes, so neither the
    drafts nor the shared tree (filled by the first pass) change a token."""
    spec = make_speculation(target, SUFFIX)
    drafted = accepted = 0
    for rep in range(2):
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(
                max_tokens=40, temperature=0.5, top_p=0.95, seed=100 + i, ignore_eos=True
            )
            plain = run(target, prompt, params, None)
            req = run(target, prompt, params, spec)
            assert req.output_ids == plain.output_ids, (rep, prompt)
            drafted += req.spec.drafted
            accepted += req.spec.accepted
    assert 0 < accepted < drafted, (accepted, drafted)


def test_suffix_sampled_matches_target_distribution(target: LoadedModel) -> None:
    """Second emitted token under suffix speculation (unseeded draws) vs its exact marginal.
    It is drafted from the first token's earlier continuations: in the prompt (it repeats "ab")
    or in the outputs before (the shared tree learns every one), so the drafts vary. Three
    tokens: with two, nothing would be drafted (no room for a bonus token)."""
    cfg = SpeculativeConfig(method="suffix", num_draft_tokens=2, adaptive=False)
    spec = make_speculation(target, cfg)
    prompt = target.tokenizer.encode("abababab")
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, ignore_eos=True)
    marginal = second_token_marginal(plain_distribution(target, params), prompt)
    reqs = assert_second_token_follows(target, spec, prompt, lambda _: params, marginal, 3000)
    drafted = sum(r.spec.drafted for r in reqs)
    accepted = sum(r.spec.accepted for r in reqs)
    assert 0 < accepted < drafted, (accepted, drafted)  # the drafts were judged, both ways


def test_suffix_tenant_never_drafts_from_another_tenants_output(target: LoadedModel) -> None:
    """Tenant "a" serves a prompt; a repeat by tenant "b" drafts and accepts exactly what a
    never-seen tenant's does (its own tokens only), the repeat by "a" drafts more."""
    spec = make_speculation(target, SUFFIX)
    assert spec is not None
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    ids = target.tokenizer.encode(PROMPTS[1])

    def serve(tenant: str) -> tuple[list[int], int, int]:
        req = target.new_request(ids, params, tenant=tenant)
        for _ in stream(target, req, spec):
            pass
        return req.output_ids, req.spec.drafted, req.spec.accepted

    first = serve("a")
    fresh = make_speculation(target, SUFFIX)
    assert fresh is not None
    req = target.new_request(ids, params)
    for _ in stream(target, req, fresh):
        pass
    alone = (req.output_ids, req.spec.drafted, req.spec.accepted)
    assert serve("b") == alone == first  # the first request of "a" knew nothing either
    again = serve("a")
    assert again[0] == first[0] and again[2] > first[2]
    assert set(spec.drafter.shared) == {"a", "b"}  # type: ignore[attr-defined]
