"""Qwen2.5-VL, the dense vision-language family (models/families/vision_qwen25.py, CausalLM with
M-RoPE) against transformers 5.x in fp32 on a tiny random-weight checkpoint: preprocessing, the
windowed tower, positions, logits and decode steps, greedy generation; speculation on image turns
with the lookups, a text-only draft model and a draft model that is itself a Qwen2.5-VL (its own
tower encodes the image), in fp32 and bf16."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file
from test_vision import chat_ids, run, speculate_turns
from vision_models import (
    IMAGE_PAD,
    QWEN25_PREPROCESSOR,
    assert_forward_and_decode_match,
    hf_generate,
    hf_image_forward,
    make_qwen25_vl_dir,
    png,
)

from quickdraft.config import SpeculativeConfig
from quickdraft.images import ImageLayout, ImageProcessing, decode_image, preprocess
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.vision_qwen25 import Qwen25VisionTower, window_order
from quickdraft.request import SamplingParams
from quickdraft.speculation.drafters.base import DraftJob
from quickdraft.speculation.drafters.draft_model import DraftModelDrafter
from quickdraft.speculation.factory import make_speculation


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    """(transformers' model, ours loaded from its checkpoint in fp32)."""
    hf, directory = make_qwen25_vl_dir(tmp_path_factory.mktemp("qwen25vl"), out_scale=0.1)
    return hf, load(str(directory), dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def vl_draft(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A smaller Qwen2.5-VL of the same tokenizer (2 layers, its own tower): a draft model
    that gets the image."""
    return make_qwen25_vl_dir(tmp_path_factory.mktemp("qwen25vl-draft"), seed=7, layers=2)


@pytest.fixture(scope="module")
def text_draft(vl: tuple[Any, LoadedModel], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text-only Qwen2 draft of the target's embedding and head (it sees placeholder ids)."""
    from conftest import make_tiny_hf_model, write_tiny_tokenizer
    from vision_models import VISION_SPECIALS, VLM_TEMPLATE

    target = vl[0]
    directory = tmp_path_factory.mktemp("qwen25vl-text-draft")
    draft = make_tiny_hf_model(
        "qwen2", directory, seed=2, tie_word_embeddings=False, rms_norm_eps=1e-6
    )
    lm = target.model.language_model
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(lm.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.model.norm.weight.copy_(lm.norm.weight)
        for layer in draft.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft.save_pretrained(directory)
    write_tiny_tokenizer(directory, VISION_SPECIALS, VLM_TEMPLATE)
    return directory


@pytest.mark.parametrize("size", [(32, 32), (27, 45), (7, 90), (200, 120)], ids=str)
def test_qwen25_preprocess_matches_transformers(size: tuple[int, int]) -> None:
    """The release's preprocessor keys (min_pixels / max_pixels) and CLIP's mean / std."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    height, width = size
    image = decode_image(png(3, width, height))
    proc = ImageProcessing.from_config(QWEN25_PREPROCESSOR)
    assert proc.image_mean[0] == pytest.approx(0.48145466)
    ours = preprocess(image, proc)
    raw = dict(QWEN25_PREPROCESSOR)
    size_keys = {"shortest_edge": raw.pop("min_pixels"), "longest_edge": raw.pop("max_pixels")}
    ref = Qwen2VLImageProcessorPil(**raw, size=size_keys)(images=[image], return_tensors="pt")
    assert list(ours.grid) == ref["image_grid_thw"][0].tolist()
    assert (ours.pixels - ref["pixel_values"]).abs().max().item() < 1e-6


def test_window_order_matches_transformers() -> None:
    """Window order and lengths as transformers' `get_vision_window_index`, on grids that
    leave partial windows at the right and bottom edges."""
    from transformers.vision_utils import get_vision_window_index

    for gh, gw in [(4, 4), (3, 5), (6, 7), (1, 1)]:
        index, cu = get_vision_window_index(
            torch.tensor([[1, 2 * gh, 2 * gw]]), spatial_merge_size=2, window_size=32, patch_size=4
        )
        order, windows = window_order(gh, gw, 4, 2, torch.device("cpu"))
        assert torch.equal(order[::4] // 4, index)
        lengths = sorted(int(b - a) for a, b in itertools.pairwise(cu))
        assert sorted(w.shape[1] for w in windows for _ in range(w.shape[0])) == lengths
        rows = torch.cat([w.reshape(-1) for w in windows]).sort().values
        assert torch.equal(rows, torch.arange(4 * gh * gw))


def test_qwen25_tower_matches_transformers(vl: tuple[Any, LoadedModel]) -> None:
    """Square, wide and tall images: whole windows, edge windows, one window."""
    hf, lm = vl
    assert isinstance(lm.vision, Qwen25VisionTower)
    for seed, (w, h) in enumerate([(32, 32), (48, 24), (20, 40), (16, 16)]):
        image = lm.load_image(png(seed, w, h))
        with torch.no_grad():
            ref = hf.model.get_image_features(
                image.pixels, torch.tensor([image.grid]), return_dict=True
            ).pooler_output[0]
        ours = lm.vision.encode(image.pixels, image.grid)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-5


def test_qwen25_positions_match_transformers(vl: tuple[Any, LoadedModel]) -> None:
    hf, lm = vl
    images = [lm.load_image(png(1, 32, 32)), lm.load_image(png(2, 48, 24))]
    ids, layout = ImageLayout.build(chat_ids(lm, "two pictures", images=2), images, IMAGE_PAD, 2)
    ids_t = torch.tensor([ids])
    grids = torch.tensor([im.grid for im in images])
    expected, delta = hf.model.get_rope_index(ids_t, (ids_t == IMAGE_PAD).int(), grids)
    assert torch.equal(layout.positions, expected[:, 0])
    assert layout.delta == int(delta)


def test_qwen25_logits_and_decode_match_transformers(vl: tuple[Any, LoadedModel]) -> None:
    """Every prompt row's logits over image + text, then 8 cached decode steps (the dense
    model's contiguous M-RoPE sections past the prompt); then greedy generation."""
    hf, lm = vl
    image = lm.load_image(png(5, 40, 24))
    assert_forward_and_decode_match(hf, lm, chat_ids(lm, "describe it"), image)
    image = lm.load_image(png(6))
    req = run(lm, chat_ids(lm, "what is in the picture?"), [image], max_tokens=24)
    assert req.output_ids == hf_generate(hf, req.prompt_ids, image, 24)
    other = run(lm, chat_ids(lm, "what is in the picture?"), [lm.load_image(png(7))])
    assert other.output_ids[:24] != req.output_ids


def test_qwen25_transformers4_layout_loads_the_same(
    vl: tuple[Any, LoadedModel], tmp_path: Path
) -> None:
    """The layout transformers 5 reads through its conversion map (`model.language_model.`,
    `model.visual.`, the language model in `text_config`) and the release's (flat config,
    `model.layers.`, `visual.`) load into the same weights."""
    _, lm = vl
    src = lm.path
    state = load_file(str(next(src.glob("*.safetensors"))))
    renamed = {}
    for name, t in state.items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        renamed[name] = t
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    flat = {**raw.pop("text_config"), **raw}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": [4, 6, 6]}
    flat.pop("rope_parameters")
    flat["rope_theta"] = 10000.0
    (tmp_path / "config.json").write_text(json.dumps(flat))
    other = load(str(tmp_path), dtype="fp32", progress=False)
    assert other.model.config.mrope_section == (4, 6, 6)
    assert other.vision is not None
    for (name, a), (_, b) in zip(
        lm.model.state_dict().items(), other.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(
        lm.vision.state_dict().items(), other.vision.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_qwen25_vl_draft_model_gets_the_image(
    vl: tuple[Any, LoadedModel], vl_draft: tuple[Any, Path]
) -> None:
    """The vision-language draft model encodes the image with its own tower and its first
    draft after the prompt is its own greedy next token over image + text, as transformers'
    draft model gives it."""
    hf_draft, directory = vl_draft
    _, lm = vl
    spec = make_speculation(
        lm,
        SpeculativeConfig(
            method="draft", draft_model=str(directory), draft_quantization="none", adaptive=False
        ),
    )
    drafter = spec.drafter
    assert isinstance(drafter, DraftModelDrafter) and drafter.encoder is not None
    for seed in (3, 4):
        image = lm.load_image(png(seed, 40, 24))
        req = lm.new_request(chat_ids(lm, "draft it"), SamplingParams(), images=[image])
        assert req.images is not None
        state = drafter.new_state(req.prompt_ids)
        job = DraftJob(state, req.prompt_ids, 1, req.params, torch.Generator(), images=req.images)
        (draft,) = drafter.propose([job])
        ref = hf_image_forward(hf_draft, req.prompt_ids, image).logits[0, -1]
        assert draft.tokens == [int(ref.argmax())]
        assert state.layout is not None and state.layout.embeds[0] is not None
    assert drafter.encoder.stats.encoded == 2


@pytest.fixture(scope="module")
def eagle3_head(vl: tuple[Any, LoadedModel], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE-3 head copying the target's bigram guess (tests/eagle3_heads.py); an image
    row's draft reads the image's embedding."""
    from eagle3_heads import agreeing_head

    model: Any = vl[1].model
    norm = model.get_parameter("model.norm.weight")
    return agreeing_head(tmp_path_factory.mktemp("qwen25vl-eagle3"), norm, taps=[1, 2, 2])


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "vl-draft", "eagle3"])
def test_qwen25_speculation_greedy_equals_plain(
    vl: tuple[Any, LoadedModel],
    text_draft: Path,
    vl_draft: tuple[Any, Path],
    eagle3_head: Path,
    method: str,
) -> None:
    """Image turns (one image, then two) with each drafter: the output equals speculation
    off's, and drafts were accepted (but for the random vision-language draft model)."""
    _, lm = vl
    cfg = SpeculativeConfig(
        method="draft" if method == "vl-draft" else method,
        num_draft_tokens=4,
        adaptive=False,
        draft_model={
            "draft": str(text_draft),
            "vl-draft": str(vl_draft[1]),
            "eagle3": str(eagle3_head),
        }.get(method),
        draft_quantization="none",
    )
    reqs = speculate_turns(lm, cfg, [(1, 1), (2, 2)], max_tokens=48)
    assert sum(r.spec.accepted for r in reqs) > 0 or method == "vl-draft"


def test_qwen25_bf16_speculation_equals_plain(vl: tuple[Any, LoadedModel]) -> None:
    """bf16 weights (the CPU panel kernels and the C++ dense layers): with an image in the
    prompt, n-gram speculation's output equals plain decoding's token for token."""
    lm = load(str(vl[1].path), dtype="bf16", progress=False)
    assert lm.vision is not None and lm.vision.dtype == torch.bfloat16
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    reqs = speculate_turns(lm, cfg, [(1, 1), (2, 1)], max_tokens=48)
    assert sum(r.spec.accepted for r in reqs) > 0


def test_vl_draft_with_other_preprocessing_is_refused(
    vl: tuple[Any, LoadedModel], vl_draft: tuple[Any, Path], tmp_path: Path
) -> None:
    _, lm = vl
    directory = vl_draft[1]
    for f in directory.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    other = dict(QWEN25_PREPROCESSOR, max_pixels=32 * 32)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(other))
    cfg = SpeculativeConfig(method="draft", draft_model=str(tmp_path), draft_quantization="none")
    with pytest.raises(ValueError, match="preprocesses images unlike the target"):
        make_speculation(lm, cfg)


def test_qwen25_server_with_a_vl_draft_equals_plain_decoding(
    vl: tuple[Any, LoadedModel], vl_draft: tuple[Any, Path]
) -> None:
    """A real server on loopback serving the Qwen2.5-VL target with the Qwen2.5-VL draft
    model, the real `openai` client: image turns (streaming and not, two images in one
    message) answer the text plain greedy decoding gives; usage counts the image rows."""
    import base64

    import openai

    from quickdraft.engine import Engine, ServedModel, stream
    from quickdraft.server import ServerConfig, create_app
    from quickdraft.server.main import BackgroundServer

    _, lm = vl
    spec = SpeculativeConfig(
        method="draft", draft_model=str(vl_draft[1]), draft_quantization="none", adaptive=False
    )
    engine = Engine({"vl": ServedModel(lm, spec, make_speculation(lm, spec))}, max_waiting=8)
    engine.start()

    def url(data: bytes) -> dict[str, Any]:
        b64 = base64.b64encode(data).decode()
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}}

    try:
        with BackgroundServer(create_app(engine, ServerConfig(max_concurrency=2))) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            for pictures in ([png(1)], [png(2, 40, 24), png(3)]):
                parts = [url(p) for p in pictures] + [{"type": "text", "text": "the cat sat"}]
                template = [{"type": "image"}] * len(pictures)
                template += [{"type": "text", "text": "the cat sat"}]
                ids = lm.tokenizer.encode_chat([{"role": "user", "content": template}])
                images = [lm.load_image(p) for p in pictures]
                req = lm.new_request(ids, SamplingParams(max_tokens=24), images=images)
                for _ in stream(lm, req, None):
                    pass
                messages: Any = [{"role": "user", "content": parts}]
                r = client.chat.completions.create(
                    model="vl", messages=messages, max_tokens=24, temperature=0
                )
                assert r.choices[0].message.content == req.text
                assert r.usage is not None and r.usage.prompt_tokens == len(req.prompt_ids)
                chunks = client.chat.completions.create(
                    model="vl", messages=messages, max_tokens=24, temperature=0, stream=True
                )
                assert "".join(c.choices[0].delta.content or "" for c in chunks) == req.text
    finally:
        engine.stop()


@pytest.mark.parametrize("draft", ["text", "vl"])
def test_qwen25_prefix_cache_keeps_draft_blocks_of_image_prompts(
    vl: tuple[Any, LoadedModel], text_draft: Path, vl_draft: tuple[Any, Path], draft: str
) -> None:
    """With a draft model the prefix cache keeps the drafter's blocks beside the target's; over
    an image prompt the blocks are keyed by the image (negative keys) while the draft state
    holds the placeholder ids. The same image again hits past its rows, another image does
    not, and every output equals plain decoding."""
    from quickdraft.config import PrefixCacheConfig
    from quickdraft.engine import EngineCore

    _, lm = vl
    spec = SpeculativeConfig(
        method="draft",
        draft_model=str(text_draft if draft == "text" else vl_draft[1]),
        draft_quantization="none",
        adaptive=False,
    )
    ids = chat_ids(lm, "the cat sat on the mat. " * 3)
    first, other = lm.load_image(png(11)), lm.load_image(png(12))
    expected = {im.digest: run(lm, ids, [im]).output_ids for im in (first, other)}
    core = EngineCore(lm, prefix_cache=PrefixCacheConfig(enabled=True, block_size=8))
    image_end = ids.index(IMAGE_PAD) + 16
    for image, hits_past_image in ((first, False), (other, False), (first, True)):
        req = lm.new_request(list(ids), SamplingParams(max_tokens=48), images=[image])
        seq = core.add(req, make_speculation(lm, spec))
        while not req.finished:
            core.step()
        assert req.output_ids == expected[image.digest]
        assert (seq.cached_tokens > image_end) == hits_past_image
