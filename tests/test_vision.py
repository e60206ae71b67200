"""Vision-language targets (over 400 lines: the whole image path against one reference model)
(models/families/vision.py, images.py, the engine's image rows) against transformers 5.x in fp32 on
a tiny random-weight Qwen3.5 checkpoint: preprocessing, the vision tower, M-RoPE positions, logits
over image + text prompts and the decode steps after them, greedy generation; then speculation on
image turns (lossless with every drafter), the image-keyed prefix cache and the encoder cache."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)
from PIL import Image
from vision_models import (
    IMAGE_PAD,
    PREPROCESSOR,
    add_copying_mtp_head,
    assert_forward_and_decode_match,
    hf_generate,
    hf_image_forward,
    image_forward,
    make_bigram_draft,
    make_vlm_dir,
    png,
)

from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine import EngineCore, stream
from quickdraft.images import (
    ImageError,
    ImageInput,
    ImageLayout,
    ImageProcessing,
    ImageRows,
    decode_image,
    pack_image_rows,
    preprocess,
)
from quickdraft.loading import LoadedModel, load
from quickdraft.request import Request, SamplingParams
from quickdraft.speculation.drafters.ngram import NgramDrafter
from quickdraft.speculation.drafters.suffix import SuffixDrafter
from quickdraft.speculation.factory import make_speculation


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    """(transformers' model, ours loaded from its checkpoint in fp32)."""
    hf, directory = make_vlm_dir(tmp_path_factory.mktemp("vlm"), out_scale=0.1)
    add_copying_mtp_head(directory)
    return hf, load(str(directory), dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def draft_dir(vlm: tuple[Any, LoadedModel], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bigram_draft(vlm[0], tmp_path_factory.mktemp("vlm-draft"))


def hf_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(**PREPROCESSOR)


def chat_ids(lm: LoadedModel, text: str, images: int = 1) -> list[int]:
    parts = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return lm.tokenizer.encode_chat([{"role": "user", "content": parts}])


def run(
    lm: LoadedModel,
    ids: list[int],
    images: list[ImageInput],
    cfg: SpeculativeConfig | None = None,
    max_tokens: int = 48,
) -> Request:
    spec = make_speculation(lm, cfg or SpeculativeConfig())
    req = lm.new_request(list(ids), SamplingParams(max_tokens=max_tokens), images=images)
    for _ in stream(lm, req, spec):
        pass
    return req


TURN = "the cat sat on the mat. the cat sat on the"


def speculate_turns(
    lm: LoadedModel, cfg: SpeculativeConfig, turns: list[tuple[int, int]], max_tokens: int
) -> list[Request]:
    """Image turns (seed, image count; TURN as the text): speculation's greedy output equals
    speculation off's on each; returns the speculative requests."""
    out = []
    for seed, count in turns:
        images = [lm.load_image(png(seed + i)) for i in range(count)]
        ids = chat_ids(lm, TURN, images=count)
        plain = run(lm, ids, images, max_tokens=max_tokens)
        spec = run(lm, ids, images, cfg, max_tokens=max_tokens)
        assert spec.output_ids == plain.output_ids
        out.append(spec)
    return out


@pytest.mark.parametrize("size", [(32, 32), (27, 45), (7, 90), (200, 120)], ids=str)
def test_vision_preprocess_matches_transformers(size: tuple[int, int]) -> None:
    """Resize (both smart_resize bounds), rescale, normalize and patch order as transformers'
    PIL processor."""
    height, width = size
    image = decode_image(png(3, width, height))
    ours = preprocess(image, ImageProcessing.from_config(PREPROCESSOR))
    ref = hf_processor()(images=[image], return_tensors="pt")
    assert list(ours.grid) == ref["image_grid_thw"][0].tolist()
    assert (ours.pixels - ref["pixel_values"]).abs().max().item() < 1e-6


def test_vision_tower_matches_transformers(vlm: tuple[Any, LoadedModel]) -> None:
    hf, lm = vlm
    assert lm.vision is not None
    for seed, (w, h) in enumerate([(32, 32), (48, 24), (20, 40)]):
        image = lm.load_image(png(seed, w, h))
        with torch.no_grad():
            ref = hf.model.get_image_features(
                image.pixels, torch.tensor([image.grid]), return_dict=True
            ).pooler_output[0]
        ours = lm.vision.encode(image.pixels, image.grid)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-5


def test_vision_positions_match_transformers(vlm: tuple[Any, LoadedModel]) -> None:
    """M-RoPE positions of text, two images of different grids and text again, and the
    offset of the rows after the prompt."""
    hf, lm = vlm
    images = [lm.load_image(png(1, 32, 32)), lm.load_image(png(2, 48, 24))]
    ids, layout = ImageLayout.build(chat_ids(lm, "two pictures", images=2), images, IMAGE_PAD, 2)
    ids_t = torch.tensor([ids])
    grids = torch.tensor([im.grid for im in images])
    expected, delta = hf.model.get_rope_index(ids_t, (ids_t == IMAGE_PAD).int(), grids)
    assert torch.equal(layout.positions, expected[:, 0])
    assert layout.delta == int(delta)
    assert [s.length for s in layout.spans] == [16, 18]  # 8 x 8 and 6 x 12 patches
    after = layout.rows(len(ids) - 2, 5)  # two prompt rows, then three past the prompt
    assert torch.equal(after[:, :2], expected[:, 0, -2:])
    assert after[:, 2:].tolist() == [[len(ids) + i + layout.delta for i in range(3)]] * 3


def test_vision_logits_and_decode_match_transformers(vlm: tuple[Any, LoadedModel]) -> None:
    """Every prompt row's logits over image + text, then 8 cached decode steps."""
    hf, lm = vlm
    assert_forward_and_decode_match(hf, lm, chat_ids(lm, "describe it"), lm.load_image(png(5)))


def test_vision_greedy_generation_matches_transformers(vlm: tuple[Any, LoadedModel]) -> None:
    hf, lm = vlm
    image = lm.load_image(png(6))
    req = run(lm, chat_ids(lm, "what is in the picture?"), [image], max_tokens=32)
    assert req.output_ids == hf_generate(hf, req.prompt_ids, image, 32)


def test_vision_output_depends_on_the_image(vlm: tuple[Any, LoadedModel]) -> None:
    _, lm = vlm
    ids = chat_ids(lm, "what is in the picture?")
    first = run(lm, ids, [lm.load_image(png(1))])
    second = run(lm, ids, [lm.load_image(png(2))])
    assert first.output_ids != second.output_ids


@pytest.fixture(scope="module")
def dflash_dir(vlm: tuple[Any, LoadedModel], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DFlash drafter for the VLM (test_dflash's rigged one: every block row drafts the
    target's guess after the last committed token), tapping target layers 0 and 2."""
    from test_dflash import dflash_config, rigged_tensors, write_dflash

    lm = vlm[1]
    norm = lm.model.get_parameter("model.norm.weight").detach() + 1.0  # type: ignore[attr-defined]
    cfg = dflash_config(4, [0, 2], block=4)
    return write_dflash(tmp_path_factory.mktemp("vlm-dflash"), cfg, rigged_tensors(cfg, norm))


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "mtp", "dflash"])
def test_vision_speculation_greedy_equals_plain(
    vlm: tuple[Any, LoadedModel], draft_dir: Path, dflash_dir: Path, method: str
) -> None:
    """Image turns (one image, then two) with each drafter: the output equals speculation
    off's, and drafts were accepted. The draft model is a text-only one that sees the image
    rows as their placeholder ids; DFlash reads the target's taps, which carry the image."""
    _, lm = vlm
    cfg = SpeculativeConfig(
        method=method,
        num_draft_tokens=4,
        adaptive=False,
        draft_model={"draft": str(draft_dir), "dflash": str(dflash_dir)}.get(method),
        draft_quantization="none",
    )
    reqs = speculate_turns(lm, cfg, [(1, 1), (2, 2), (3, 1)], max_tokens=64)
    assert sum(r.spec.accepted for r in reqs) > 0


@pytest.mark.parametrize("cls", [NgramDrafter, SuffixDrafter])
def test_lookup_drafters_never_match_or_draft_inside_an_image(cls: type) -> None:
    """Two images behind the same placeholder ids. Without the barrier the second image's
    rows match the first's (and what followed it is drafted), and text that an image followed
    before drafts placeholders; with it neither happens, and text after text still drafts."""
    pad = IMAGE_PAD
    image = [pad] * 4
    tokens = [1, 2, *image, 7, 8, 9, 3, 4, *image]
    before = [*tokens, 5, 1, 2]  # "1 2" was followed by an image
    text = [*tokens, 5, 7, 8]  # "7 8" was followed by text
    plain = cls()
    assert plain.lookup(plain.new_state(tokens), tokens, 4).tokens[:1] == [7]
    assert plain.lookup(plain.new_state(before), before, 4).tokens[:1] == [pad]
    fenced = cls(barrier=frozenset({pad}))
    assert fenced.lookup(fenced.new_state(tokens), tokens, 4).tokens == []
    assert pad not in fenced.lookup(fenced.new_state(before), before, 4).tokens
    assert fenced.lookup(fenced.new_state(text), text, 4).tokens[:2] == [9, 3]


def test_vision_prefix_cache_keys_blocks_by_image(vlm: tuple[Any, LoadedModel]) -> None:
    """The same text behind another image never hits the first image's blocks; the same image
    again hits; outputs with the cache equal outputs without it."""
    _, lm = vlm
    ids = chat_ids(lm, "a long question about the picture, " * 3)
    first, other = lm.load_image(png(11)), lm.load_image(png(12))
    expected = {d: run(lm, ids, [im]).output_ids for d, im in [("a", first), ("b", other)]}
    prefix = PrefixCacheConfig(enabled=True, block_size=8, snapshot_every=1)
    core = EngineCore(lm, prefix_cache=prefix)

    def serve(image: ImageInput) -> tuple[list[int], int]:
        req = lm.new_request(list(ids), SamplingParams(max_tokens=48), images=[image])
        seq = core.add(req, None)
        while not req.finished:
            core.step()
        return req.output_ids, seq.cached_tokens

    out, cached = serve(first)
    assert out == expected["a"] and cached == 0
    out, cached = serve(other)  # same ids, other pixels: only the text before the image hits
    image_start = ids.index(IMAGE_PAD)
    assert out == expected["b"] and cached <= image_start
    out, cached = serve(first)  # the same image again: past its rows
    assert out == expected["a"] and cached > image_start + 16
    assert core.encoder is not None and core.encoder.stats.encoded == 2


def test_vision_encoder_caches_by_content(vlm: tuple[Any, LoadedModel]) -> None:
    """One image sent twice (as PNG and as BMP: the same pixels) is encoded once."""
    _, lm = vlm
    core = EngineCore(lm)
    assert core.encoder is not None
    bmp = io.BytesIO()
    Image.open(io.BytesIO(png(21))).save(bmp, format="BMP")
    outputs = []
    for data in (png(21), bmp.getvalue()):
        image = lm.load_image(data)
        req = lm.new_request(chat_ids(lm, "hi"), SamplingParams(max_tokens=8), images=[image])
        core.add(req, None)
        while not req.finished:
            core.step()
        outputs.append(req.output_ids)
    assert outputs[0] == outputs[1]
    assert (core.encoder.stats.images, core.encoder.stats.encoded) == (2, 1)


def test_text_model_refuses_images(tiny_model_dir: Path) -> None:
    lm = load(str(tiny_model_dir), dtype="fp32", progress=False)
    with pytest.raises(ImageError, match="takes no image input"):
        lm.load_image(png(1))


def test_image_placeholders_must_match_the_images(vlm: tuple[Any, LoadedModel]) -> None:
    _, lm = vlm
    image = lm.load_image(png(1))
    with pytest.raises(ImageError, match="2 image placeholders for 1 images"):
        lm.new_request(chat_ids(lm, "x", images=2), SamplingParams(), images=[image])


def test_decode_image_refuses_bad_input() -> None:
    with pytest.raises(ImageError, match="not a readable image"):
        decode_image(b"definitely not an image")
    with pytest.raises(ImageError, match="over the limit"):
        decode_image(png(1, 64, 64), max_pixels=64 * 63)
    # a decompression bomb: a tiny PNG that claims 20000 x 20000 pixels
    bomb = io.BytesIO()
    Image.new("1", (20000, 20000)).save(bomb, format="PNG")
    assert len(bomb.getvalue()) < 100_000
    with pytest.raises(ImageError):
        decode_image(bomb.getvalue())
    with pytest.raises(ImageError, match="aspect ratio"):
        preprocess(Image.fromarray(np.zeros((2, 500, 3), dtype=np.uint8)), ImageProcessing())


def test_mtp_head_reads_image_embeddings_one_row_early(vlm: tuple[Any, LoadedModel]) -> None:
    """Row i of the MTP head pairs h_i with t_{i+1}: where t_{i+1} is an image row it reads
    that row's image embedding (pack_image_rows with shift 1). Against a reference whose
    embedding lookup returns the fused embeddings row by row."""
    _, lm = vlm
    assert lm.vision is not None
    drafter = make_speculation(lm, SpeculativeConfig(method="mtp"))
    assert drafter is not None
    head = drafter.drafter.head  # type: ignore[union-attr]
    image = lm.load_image(png(4))
    ids, layout = ImageLayout.build(chat_ids(lm, "look"), [image], IMAGE_PAD, 2)
    layout.embeds = [lm.vision.encode(image.pixels, image.grid)]
    n = len(ids) - 1  # rows 0 .. n-1 read t_1 .. t_n
    hidden = torch.randn(n, head.hidden_size, generator=torch.Generator().manual_seed(0))
    packed = pack_image_rows([layout], [0], [n], head.hidden_size, head.device, shift=1)
    assert packed is not None and packed.rows.numel() == layout.spans[0].length
    fast = head(torch.tensor(ids[1:]), hidden, [head.new_cache(n)], [n], torch.arange(n), packed)
    span = layout.spans[0]
    table = head.embed(torch.tensor(ids[1:]))  # token embeddings, then the image's rows
    fused = table.clone()
    for row in range(n):
        token = row + 1
        if span.start <= token < span.start + span.length:
            fused[row] = layout.embeds[0][token - span.start]
    reference = copy.copy(head)
    reference.embed = lambda _ids: fused
    no_rows = ImageRows(torch.zeros(0, dtype=torch.long), fused[:0], packed.positions)
    slow = reference(
        torch.tensor(ids[1:]), hidden, [head.new_cache(n)], [n], torch.arange(n), no_rows
    )
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[2], slow[2])
    assert not torch.equal(table, fused)


@pytest.fixture(scope="module")
def vlm_bf16(vlm: tuple[Any, LoadedModel]) -> LoadedModel:
    return load(str(vlm[1].path), dtype="bf16", progress=False)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_vision_bf16_speculation_equals_plain(vlm_bf16: LoadedModel, method: str) -> None:
    """bf16 weights (the CPU panel kernels, batch-invariant): with images in the prompt the
    output with speculation equals the output without it, token for token."""
    lm = vlm_bf16
    assert lm.vision is not None and lm.vision.dtype == torch.bfloat16
    cfg = SpeculativeConfig(method=method, num_draft_tokens=4, adaptive=False)
    reqs = speculate_turns(lm, cfg, [(1, 1), (2, 1)], max_tokens=64)
    assert sum(r.spec.accepted for r in reqs) > 0


def test_vision_moe_logits_match_transformers(tmp_path: Path) -> None:
    """Qwen3.5-MoE's composite checkpoint: the same tower and M-RoPE over its sparse-MoE
    hybrid language model, logits over an image prompt as transformers'."""
    hf, directory = make_vlm_dir(tmp_path / "moe", family="qwen3_5_moe")
    lm = load(str(directory), dtype="fp32", progress=False)
    image = lm.load_image(png(8, 48, 32))
    out, ids, _, _ = image_forward(lm, chat_ids(lm, "moe"), image)
    ref = hf_image_forward(hf, ids, image)
    assert (out.logits - ref.logits[0]).abs().max().item() < 1e-4


def test_vision_packed_requests_equal_alone(vlm: tuple[Any, LoadedModel]) -> None:
    """Three requests in one engine core, two with images (of other sizes) and one text-only,
    their prompts and decode steps packed into shared forwards: each output equals the same
    request run alone, with n-gram speculation on."""
    _, lm = vlm
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    cases = [
        (chat_ids(lm, "the cat sat on the mat. the cat"), [lm.load_image(png(31))]),
        (
            chat_ids(lm, "one two", images=2),
            [lm.load_image(png(32, 48, 24)), lm.load_image(png(33))],
        ),
        (chat_ids(lm, "plain text, no picture", images=0), []),
    ]
    alone = [run(lm, ids, images, cfg).output_ids for ids, images in cases]
    core = EngineCore(lm)
    reqs = []
    for ids, images in cases:
        req = lm.new_request(list(ids), SamplingParams(max_tokens=48), images=images)
        core.add(req, make_speculation(lm, cfg))
        reqs.append(req)
    while not all(r.finished for r in reqs):
        core.step()
    assert core.stats.max_batch == 3
    assert [r.output_ids for r in reqs] == alone


@pytest.mark.parametrize("interleaved", [True, False], ids=["qwen3.5", "qwen2-vl"])
def test_mrope_tables_match_transformers(interleaved: bool) -> None:
    """cos / sin of random (t, h, w) positions as transformers' rotary embeddings give them:
    Qwen3.5's interleaved sections and Qwen2-VL's contiguous ones; equal streams give the
    plain table's bits."""
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from quickdraft.models.layers import Rope

    positions = torch.randint(0, 300, (3, 1, 40), generator=torch.Generator().manual_seed(0))
    if interleaved:  # rotary dim 64 of head 256 (partial 0.25): 32 frequencies, 11 11 10
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
        rope["mrope_section"], rotary = [11, 11, 10], 64
        cfg = transformers.Qwen3_5TextConfig(head_dim=256, rope_parameters=rope)
        ref: Any = Qwen3_5TextRotaryEmbedding(cfg)
    else:  # head 128, all of it rotary: 64 frequencies, 16 24 24
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
        cfg = transformers.Qwen2_5_VLTextConfig(
            hidden_size=512, num_attention_heads=4, rope_parameters=rope
        )
        ref, rotary = Qwen2_5_VLRotaryEmbedding(cfg), 128
    cos_ref, sin_ref = ref(torch.zeros(1, dtype=torch.float32), positions)
    ours = Rope(rotary, rope["rope_theta"], torch.device("cpu"))
    cos, sin = ours.mrope_tables(positions[:, 0], rope["mrope_section"], torch.float32, interleaved)
    assert torch.allclose(cos[:, 0], cos_ref[0], atol=1e-6)
    assert torch.allclose(sin[:, 0], sin_ref[0], atol=1e-6)
    equal = positions[:1, 0].expand(3, -1)
    plain = ours.tables(equal[0], torch.float32)
    mixed = ours.mrope_tables(equal, rope["mrope_section"], torch.float32, interleaved)
    assert torch.equal(plain[0], mixed[0]) and torch.equal(plain[1], mixed[1])


@pytest.fixture(scope="module")
def vl_draft(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """Another random Qwen3.5 vision-language checkpoint (the same tokenizer): a recurrent
    draft model with its own tower."""
    return make_vlm_dir(tmp_path_factory.mktemp("vlm-vl-draft"), seed=9, out_scale=0.1)


def test_vision_hybrid_draft_model_gets_the_image(
    vlm: tuple[Any, LoadedModel], vl_draft: tuple[Any, Path]
) -> None:
    """A Qwen3.5 draft model (recurrent) encodes the image with its own tower: its first draft
    after an image prompt is its own greedy token over image + text, as transformers' gives
    it, and each later draft position equals its greedy decode (the uncommitted chain)."""
    from quickdraft.speculation.drafters.base import DraftJob
    from quickdraft.speculation.drafters.draft_model import DraftModelDrafter

    hf_draft, directory = vl_draft
    _, lm = vlm
    cfg = SpeculativeConfig(
        method="draft", draft_model=str(directory), draft_quantization="none", adaptive=False
    )
    drafter = make_speculation(lm, cfg).drafter
    assert isinstance(drafter, DraftModelDrafter) and drafter.recurrent
    image = lm.load_image(png(4, 48, 24))
    req = lm.new_request(chat_ids(lm, "draft it"), SamplingParams(), images=[image])
    state = drafter.new_state(req.prompt_ids)
    job = DraftJob(state, req.prompt_ids, 4, req.params, torch.Generator(), images=req.images)
    (draft,) = drafter.propose([job])
    assert draft.tokens == hf_generate(hf_draft, req.prompt_ids, image, 4)
    assert state.cache.length == len(req.prompt_ids) and state.pending == draft.tokens[:-1]


@pytest.mark.parametrize("draft", ["other", "self"])
def test_vision_hybrid_draft_model_greedy_equals_plain(
    vlm: tuple[Any, LoadedModel], vl_draft: tuple[Any, Path], draft: str
) -> None:
    """A recurrent draft model on image and text turns: a random other Qwen3.5 VLM (drafts
    mostly rejected: the rollback out of the uncommitted chain) and the target itself (every
    draft accepted: the last draft never ran, the next propose feeds it). Outputs equal
    speculation off's."""
    _, lm = vlm
    directory = vl_draft[1] if draft == "other" else lm.path
    cfg = SpeculativeConfig(
        method="draft",
        num_draft_tokens=4,
        adaptive=False,
        draft_model=str(directory),
        draft_quantization="none",
    )
    for spec in speculate_turns(lm, cfg, [(1, 1), (2, 2), (3, 0)], max_tokens=40):
        if draft == "self":
            assert spec.spec.accepted == spec.spec.drafted > 0
