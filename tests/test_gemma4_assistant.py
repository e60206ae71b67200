"""The Gemma 4 assistant drafter (models/heads/gemma4_assistant.py,
speculation/drafters/assistant.py): tiny random Gemma4AssistantForCausalLM checkpoints from
transformers for the tiny Gemma 4 targets of tests/test_gemma4.py. Checked: its drafts after a
prompt longer than the window equal transformers' own candidate generator's
(SinglePositionMultiTokenCandidateGenerator), with and without the centroid-masked head, and its
first logits equal; an assistant made for another target, or a target that is not Gemma 4, is
refused by name; through the engine (a target whose layers only nudge its embedding, so it mostly
repeats, and an assistant that proposes the last token again) greedy speculation as `mtp` (vLLM's
name for it) and as `assistant` equals plain decoding with drafts accepted, two requests drafting in
one call equal each alone, and sampled requests run."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_hf_model, write_tiny_tokenizer
from kernel_checks import needs_kernel
from test_gemma4 import VOCAB, WINDOW, hf_model
from torch import Tensor

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.engine.core import EngineCore
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.gemma4 import Gemma4LM
from quickdraft.models.formats.loader import load_model
from quickdraft.models.heads.gemma4_assistant import load_assistant
from quickdraft.request import SamplingParams
from quickdraft.speculation.drafters.assistant import AssistantState, assistant_drafter
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.factory import make_speculation

TYPES = ["sliding_attention", "full_attention", "sliding_attention"]  # the last made full


def hf_assistant(ordered: bool, hidden: int = 48, seed: int = 5, **text: Any) -> Any:
    import transformers

    tc = transformers.Gemma4TextConfig(
        **{
            **dict(
                vocab_size=VOCAB,
                hidden_size=hidden,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=32,
                global_head_dim=64,
                num_global_key_value_heads=1,
                attention_k_eq_v=True,
                sliding_window=WINDOW,
                layer_types=TYPES,
                hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=0,
                max_position_embeddings=512,
            ),
            **text,
        }
    )
    cfg = transformers.Gemma4AssistantConfig(
        text_config=tc,
        backbone_hidden_size=64,
        use_ordered_embeddings=ordered,
        num_centroids=8,
        centroid_intermediate_top_k=2,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4AssistantForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.7, 1.3)
            else:
                p.normal_(0, 0.1)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    return model


@pytest.mark.parametrize("ordered", [False, True], ids=["lm-head", "centroids"])
@pytest.mark.parametrize("shape", ["dense", "e2b-moe"])
def test_drafts_equal_transformers_candidates(shape: str, ordered: bool, tmp_path: Path) -> None:
    """After a 20-token prompt (past the 6-key window): 4 chained greedy drafts equal the ones
    transformers' candidate generator makes from the same target outputs, and the first
    step's logits equal its assistant's."""
    import transformers

    hf = hf_model(shape)
    hf.save_pretrained(tmp_path / "target")
    assistant = hf_assistant(ordered)
    assistant.save_pretrained(tmp_path / "assistant")
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True, return_shared_kv_states=True)
    first = int(out.logits[0, -1].argmax())
    tokens = [*ids.tolist(), first]
    assistant.generation_config.num_assistant_tokens = 4
    gen_cfg = copy.deepcopy(hf.generation_config)
    gen_cfg.max_length = 64
    generator = transformers.generation.candidate_generator
    theirs = generator.SinglePositionMultiTokenCandidateGenerator(
        assistant, hf.get_input_embeddings(), gen_cfg
    )
    candidates, candidate_logits = theirs.get_candidates(torch.tensor([tokens]), {}, out, False, 0)

    ours = load_model(tmp_path / "target", torch.float32)
    drafter = assistant_drafter(ours, tmp_path / "assistant")
    cache = ours.new_cache(32)
    hidden = ours(ids, [cache], [20], return_hidden=True).hidden
    cache.commit(20)
    state = AssistantState()
    drafter.commit(state, tokens, hidden)
    job = DraftJob(state, tokens, 4, SamplingParams(temperature=0), torch.Generator(), None)
    job.target_cache = cache
    assert drafter.propose([job])[0].tokens == candidates[0, 21:].tolist()
    assert len(drafter.forwards) == 4
    assert hidden is not None
    logits, _ = drafter.head(ours.embed(torch.tensor([first])), hidden[-1:], [cache], [20])
    torch.testing.assert_close(logits[0], candidate_logits[0, 0], atol=3e-4, rtol=1e-4)
    # int4 operands (the CPU default for drafters): the centroid mask still reads its rows
    small = assistant_drafter(ours, tmp_path / "assistant", "int4")
    assert type(small.head.pre_projection.op).__name__ == "Int4Weight"  # 128 wide
    small.commit(state, tokens, hidden)
    assert len(small.propose([job])[0].tokens) == 4


def test_an_assistant_for_another_target_is_refused(tmp_path: Path) -> None:
    hf_model("dense").save_pretrained(tmp_path / "target")
    target = load_model(tmp_path / "target", torch.float32)
    cases = {
        "head size 32 over 2 heads": dict(num_global_key_value_heads=2),  # global: 2 KV heads
        "sliding_window 8": dict(sliding_window=8),
    }
    for i, (words, text) in enumerate(cases.items()):
        path = tmp_path / f"assistant-{i}"
        hf_assistant(False, **text).save_pretrained(path)
        with pytest.raises(ValueError, match="another model") as err:
            assistant_drafter(target, path)
        assert words.split()[0] in str(err.value)
    path = tmp_path / "assistant-wide"
    hf_assistant(False).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["backbone_hidden_size"] = 96
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="backbone_hidden_size 96"):
        assistant_drafter(target, path)
    make_tiny_hf_model("qwen3", tmp_path / "qwen3")
    with pytest.raises(ValueError, match="Gemma 4 targets, not qwen3"):
        assistant_drafter(load_model(tmp_path / "qwen3", torch.float32), tmp_path / "assistant-0")


# -- through the engine: a target that mostly repeats, an assistant that repeats --------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Path]:
    """(the target loaded in bf16, the assistant dir). The target's layers write a tenth of
    their random outputs into the residual stream, so its head (tied to the table) mostly
    scores the last token highest; the assistant's layers write nothing, its input projection
    keeps the embedding and its head is the target's table: it proposes the last token."""
    root = tmp_path_factory.mktemp("gemma4-assistant")
    hf = hf_model("e2b-moe")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                p.mul_(0.1)
    hf.save_pretrained(root / "target")
    write_tiny_tokenizer(root / "target")
    echoing_assistant(hf.model.embed_tokens.weight).save_pretrained(root / "assistant")
    return load(str(root / "target"), "bf16", progress=False), root / "assistant"


def echoing_assistant(table: Tensor) -> Any:
    """An assistant (64 wide) for a target of embedding `table` that proposes the last token:
    its layers write nothing, its input projection keeps the embedding, its head is the
    target's table."""
    assistant = hf_assistant(False, hidden=64)
    with torch.no_grad():
        for name, p in assistant.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
        assistant.model.embed_tokens.weight.copy_(table)
        eye = torch.eye(64)
        assistant.pre_projection.weight.copy_(torch.cat([eye, torch.zeros(64, 64)], 1))
        assistant.post_projection.weight.copy_(eye)
    return assistant


def assistant_spec(lm: LoadedModel, path: Path, method: str = "assistant", k: int = 3) -> Any:
    """Forced-k speculation with the assistant at `path` (`method`: "assistant" or vLLM's
    "mtp")."""
    config = SpeculativeConfig(
        method=method, num_draft_tokens=k, draft_model=str(path), adaptive=False
    )
    return make_speculation(lm, config)


def generate(lm: LoadedModel, ids: list[int], params: SamplingParams, spec: Any = None) -> Any:
    req = lm.new_request(ids, params)
    for _ in stream(lm, req, spec):
        pass
    return req


PROMPTS = ("the cat sat on the mat. the cat sat on", "Hello world, this is a test.")


@needs_kernel
@pytest.mark.parametrize("method", ["mtp", "assistant"])
def test_greedy_speculation_equals_plain_decoding(
    pair: tuple[LoadedModel, Path], method: str
) -> None:
    lm, assistant = pair
    spec = assistant_spec(lm, assistant, method, 4)
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    drafted = accepted = 0
    for prompt in PROMPTS:
        ids = lm.tokenizer.encode(prompt)
        fast = generate(lm, ids, greedy, spec)
        assert fast.output_ids == generate(lm, ids, greedy).output_ids
        drafted, accepted = drafted + fast.spec.drafted, accepted + fast.spec.accepted
    assert accepted > 0 and drafted > accepted  # accepted, and rejected (rollback) too


@needs_kernel
def test_assistant_layers_run_as_one_c_call_each(pair: tuple[LoadedModel, Path]) -> None:
    """The int4 assistant's query-only layers run as C++ Gemma4Layers over the target's KV
    (its source layers' slots) with the Python layers' bits: logits and the chained hidden of
    two sequences at other lengths."""
    lm, path = pair
    target = lm.model
    assert isinstance(target, Gemma4LM)
    assistant = load_assistant(target, path, "int4")
    caches, rows = [target.new_cache(32), target.new_cache(32)], [9, 5]
    for cache, n in zip(caches, rows, strict=True):
        target(torch.arange(n) * 3 % target.config.vocab_size, [cache], [n])
        cache.commit(n)
    g = torch.Generator().manual_seed(3)
    embeds = target.embed(torch.tensor([4, 7]))
    hidden = torch.randn(2, embeds.shape[1], generator=g).to(embeds.dtype)

    def run(fused: bool) -> tuple[Tensor, Tensor]:
        assistant._fused = None if fused else False
        out: tuple[Tensor, Tensor] = assistant(embeds, hidden, caches, rows)
        return out

    fast = run(True)
    assert assistant._fused_layers(caches[0]) is not None
    slow = run(False)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


@needs_kernel
def test_requests_drafting_together_equal_each_alone(pair: tuple[LoadedModel, Path]) -> None:
    """Two requests at different positions draft in one propose call per step (one assistant
    step per position over both targets' caches) and get the tokens each gets alone;
    sampled requests run on the same path."""
    lm, assistant = pair
    spec = assistant_spec(lm, assistant, "mtp")
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    alone = [generate(lm, ids, greedy).output_ids for ids in prompts]
    core = EngineCore(lm, SchedulerConfig(max_running=2))
    reqs = [lm.new_request(ids, greedy) for ids in prompts]
    for req in reqs:
        core.add(req, spec)
    while core.has_work:
        core.step()
    assert core.stats.max_batch == 2 and [r.output_ids for r in reqs] == alone
    sampled = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3)
    out = generate(lm, prompts[0], sampled, spec)
    assert len(out.output_ids) == 24 and out.spec.drafted > 0


def write_assistant_gguf(assistant: Any, path: Path, qtype: str = "F32") -> Path:
    """The assistant as llama.cpp's converter writes it (`gemma4-assistant`)."""
    from quickdraft.hub.gguf_gemma4 import ASSISTANT_ARCH, assistant_tensors
    from quickdraft.hub.gguf_write import write_gguf

    text = assistant.config.text_config.to_dict()
    cfg = {**text, "backbone_hidden_size": assistant.config.backbone_hidden_size}
    tensors = assistant_tensors(assistant.state_dict(), text)
    return write_gguf(path, ASSISTANT_ARCH, cfg, tensors, qtype, chat_template=None)


def test_an_assistant_gguf_drafts_as_its_checkpoint(tmp_path: Path) -> None:
    """llama.cpp's gemma4-assistant GGUF (file, or a directory holding it) loads as the
    checkpoint it was written from: F32 gives the same first logits and drafts, Q8_0 runs in
    its draft format; serving it as a model says it is a drafter."""
    from quickdraft.hub.convert import convert_gguf
    from quickdraft.hub.errors import HubError

    hf_model("e2b-moe").save_pretrained(tmp_path / "target")
    target = load_model(tmp_path / "target", torch.float32)
    assistant = hf_assistant(False)
    assistant.save_pretrained(tmp_path / "assistant")
    (tmp_path / "gguf").mkdir()
    file = write_assistant_gguf(assistant, tmp_path / "gguf" / "assistant.gguf")
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2))
    cache = target.new_cache(32)
    hidden = target(ids, [cache], [20], return_hidden=True).hidden
    cache.commit(20)
    assert hidden is not None
    tokens = [*ids.tolist(), 5]

    def drafts(path: Path, quantization: str = "none") -> tuple[list[int], Tensor]:
        drafter = assistant_drafter(target, path, quantization)
        state = AssistantState()
        drafter.commit(state, tokens, hidden)
        job = DraftJob(state, tokens, 4, SamplingParams(temperature=0), torch.Generator(), None)
        job.target_cache = cache
        first, _ = drafter.head(target.embed(torch.tensor([5])), hidden[-1:], [cache], [20])
        return drafter.propose([job])[0].tokens, first

    want, logits = drafts(tmp_path / "assistant")
    for path in (file, tmp_path / "gguf"):
        got, got_logits = drafts(path)
        assert got == want and torch.equal(got_logits, logits)
    q8 = write_assistant_gguf(assistant, tmp_path / "assistant-q8.gguf", "Q8_0")
    got, got_logits = drafts(q8)
    torch.testing.assert_close(got_logits, logits, atol=0.1, rtol=0.05)  # |logits| <= ~2
    assert len(drafts(q8, "int8")[0]) == 4
    with pytest.raises(HubError, match="drafts for its target"):
        convert_gguf(file, tmp_path / "served", "gguf")


@needs_kernel
def test_a_prefix_cache_hit_is_used_while_the_assistant_drafts(
    pair: tuple[LoadedModel, Path],
) -> None:
    """The assistant reads only the target's KV and its newest hidden row, so a request whose
    prompt is cached skips those blocks' prefill and drafts from the copied-in KV: greedy
    outputs with the cache equal those without it, drafts accepted."""
    from quickdraft.config import PrefixCacheConfig

    lm, assistant = pair
    spec = assistant_spec(lm, assistant)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    shared = lm.tokenizer.encode(PROMPTS[0] * 3)
    prompts = [shared + lm.tokenizer.encode(tail) for tail in (" one", " two and three")]
    expected = [generate(lm, ids, greedy).output_ids for ids in prompts]
    core = EngineCore(lm, SchedulerConfig(max_running=1), PrefixCacheConfig(block_size=8))
    reqs = [lm.new_request(ids, greedy) for ids in prompts]
    seqs = []
    for req in reqs:  # one after the other: the second finds the first's blocks
        seqs.append(core.add(req, spec))
        while core.has_work:
            core.step()
    assert [r.output_ids for r in reqs] == expected
    assert seqs[1].cached_tokens >= len(shared) // 8 * 8 > 0
    assert reqs[1].spec.accepted > 0
