"""Gemma 4 with images (models/families/vision_gemma4.py, images.py's Gemma 4 preprocessing and
layout, the decoder's image rows and two-way local attention) against transformers 5.x's
Gemma4ForConditionalGeneration in fp32, on tiny random-weight checkpoints in the family's two
layouts: "dense" as the 26B-A4B / 31B (an image's rows see each other both ways in the local layers:
`use_bidirectional_attention` "vision") and "e2b-moe" as E2B / E4B (per-layer inputs, KV sharing,
routed experts, causal image rows). Then the engine: speculation on image turns equals plain
decoding (n-gram, the assistant drafter; the C++ layers in bf16), chunked prefill never cuts an
image, the prefix cache over image blocks, a real server."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from conftest import write_tiny_tokenizer
from kernel_checks import needs_kernel
from PIL import Image
from test_gemma4 import text_config
from test_gemma4_assistant import echoing_assistant
from vision_models import assert_decode_steps_match, language_model_state, png

from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine import Engine, EngineCore, ServedModel, stream
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.hub.gguf_write import llama_cpp_tensors, write_gguf, write_mmproj
from quickdraft.images import ImageInput, ImageLayout, ImageProcessing, pack_image_rows, preprocess
from quickdraft.loading import LoadedModel, load
from quickdraft.models.families.gemma4 import Gemma4LM
from quickdraft.models.formats.gguf_vision import load_mmproj, placeholders
from quickdraft.request import Request, SamplingParams
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer
from quickdraft.speculation.factory import make_speculation

SPECIALS = ("<|image>", "<image|>", "<|image|>")  # ids 260..262: begin, end, image
BOI, EOI, IMAGE = 260, 261, 262
# ChatML turns; an image part is the image token alone, which the processor (and
# ImageLayout.build) turns into begin + one token per placeholder + end
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# tiny patches pooled 2 x 2 with the smallest budget transformers allows (70 placeholders)
PREPROCESSOR = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70, do_normalize=False)
TWO_WAY = {"dense": "vision", "e2b-moe": None}  # as the released checkpoints of each layout


def make_dir(directory: Path, shape: str, quiet: bool = False) -> tuple[Any, Path]:
    """(transformers' model, its checkpoint directory). `quiet`: the layers write a tenth of
    their random outputs into the residual stream, so the tied head mostly scores the current
    token highest: greedy output cycles and drafts get accepted."""
    import transformers

    text = dict(text_config(shape), use_bidirectional_attention=TWO_WAY[shape], pad_token_id=0)
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=64,
        standardize=True,
    )
    cfg = transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=IMAGE,
        boi_token_id=BOI,
        eoi_token_id=EOI,
    )
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # test_gemma4.hf_model's `calm` weights; the tower's table wide
        for name, p in hf.named_parameters():
            if "norm" in name or "scale" in name:
                p.uniform_(0.7, 1.3)
            elif "position_embedding_table" in name:
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.08)
            if "language_model" in name and ("q_norm" in name or "k_norm" in name):
                p.fill_(0.3)
            elif "router.proj" in name:
                p.normal_(0, 3.0)
            elif quiet and name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                p.mul_(0.1)
        tower = hf.model.vision_tower
        tower.std_bias.normal_(0, 0.1)
        tower.std_scale.uniform_(0.7, 1.3)
        for layer in hf.model.language_model.layers:
            layer.layer_scalar.fill_(0.9)
    hf.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    write_tiny_tokenizer(directory, SPECIALS, TEMPLATE)
    return hf, directory


@pytest.fixture(scope="module", params=sorted(TWO_WAY))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(transformers' model, ours in fp32) for each layout."""
    hf, directory = make_dir(tmp_path_factory.mktemp(f"g4v-{request.param}"), request.param)
    return hf, load(str(directory), dtype="fp32", progress=False)


def hf_processor(budget: int = 70) -> Any:
    """transformers' processor with the tiny patches and `budget` placeholders an image."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    kwargs = {k: v for k, v in PREPROCESSOR.items() if k != "do_normalize"}
    return Gemma4ImageProcessorPil(**kwargs | {"max_soft_tokens": budget})


def hf_pixels(images: list[bytes], budget: int = 70) -> dict[str, torch.Tensor]:
    """transformers' processor output for `images` (pixel_values, image_position_ids)."""
    pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    out = hf_processor(budget)(pil, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}


def chat_ids(lm: LoadedModel, text: str, images: int = 1) -> list[int]:
    parts = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return lm.tokenizer.encode_chat([{"role": "user", "content": parts}])


def expand(lm: LoadedModel, ids: list[int], images: list[ImageInput]) -> tuple[list[int], Any]:
    request = lm.new_request(list(ids), SamplingParams(max_tokens=1), images=images)
    return request.prompt_ids, request.images


def hf_inputs(ids: list[int], pngs: list[bytes], budget: int = 70) -> dict[str, Any]:
    ids_t = torch.tensor([ids])
    pixels = hf_pixels(pngs, budget)
    return dict(input_ids=ids_t, mm_token_type_ids=(ids_t == IMAGE).int(), **pixels)


def forward(lm: LoadedModel, ids: list[int], layout: Any, two_way: bool = True) -> Any:
    """Our forward over every row of `ids` (one sequence) with its images encoded, every row
    scored; `two_way` False drops the images' two-way rows (what the test shows matters)."""
    assert lm.vision is not None
    layout.embeds = [lm.vision.encode(s.image.pixels, s.image.grid) for s in layout.spans]
    rows = pack_image_rows([layout], [0], [len(ids)], 64, torch.device("cpu"))
    assert rows is not None
    if not two_way:
        rows = type(rows)(rows.rows, rows.embeds, rows.positions)
    cache = lm.model.new_cache(len(ids) + 16)
    logits = lm.model(
        torch.tensor(ids), [cache], [len(ids)], logit_rows=torch.arange(len(ids)), images=rows
    ).logits
    return logits, cache


@pytest.mark.parametrize("size", [(40, 56), (32, 32), (90, 7), (200, 3), (120, 200)], ids=str)
def test_preprocess_matches_transformers(size: tuple[int, int]) -> None:
    """The resize to the placeholder budget (a very long image keeps one placeholder row),
    rescaling and raster patches equal transformers' processor's, bit for bit."""
    width, height = size
    proc = ImageProcessing.from_config(PREPROCESSOR, ImageProcessing(kind="gemma4"))
    image = Image.open(io.BytesIO(png(3, width, height)))
    mine = preprocess(image, proc)
    theirs = hf_processor()(image, return_tensors="pt")
    n = mine.pixels.shape[0]
    assert torch.equal(mine.pixels, theirs["pixel_values"][0, :n])
    assert (theirs["image_position_ids"][0, n:] == -1).all()  # the rest is padding
    _, h, w = mine.grid
    positions = theirs["image_position_ids"][0, :n]
    assert positions[:, 0].max() + 1 == w and positions[:, 1].max() + 1 == h
    assert mine.num_tokens(2) == int(theirs["num_soft_tokens_per_image"][0])


def test_tower_matches_transformers(pair: Any) -> None:
    hf, lm = pair
    data = png(4, 40, 56)
    image = lm.load_image(data)
    mine = lm.vision.encode(image.pixels, image.grid)
    with torch.no_grad():
        ref = hf.model.get_image_features(**hf_pixels([data])).pooler_output[0]
    assert mine.shape == ref.shape == (image.num_tokens(2), 64)
    assert (mine - ref).abs().max().item() < 1e-5


def test_layout_wraps_each_image_and_keeps_plain_positions(pair: Any) -> None:
    _, lm = pair
    image = lm.load_image(png(5))
    ids, layout = expand(lm, chat_ids(lm, "hi", images=1), [image])
    span = layout.spans[0]
    assert ids[span.start - 1] == BOI and ids[span.start + span.length] == EOI
    assert ids[span.start : span.start + span.length] == [IMAGE] * image.num_tokens(2)
    assert torch.equal(layout.positions, torch.arange(len(ids)).expand(3, -1))
    assert layout.delta == 0
    shape = "e2b-moe" if lm.model.config.ple_size else "dense"
    assert layout.two_way == (TWO_WAY[shape] == "vision")


def test_logits_and_decode_match_transformers(pair: Any) -> None:
    """Every row of a prompt with two images and text (past the 6-key window inside each
    image), then 8 cached decode steps, against transformers' (1e-4). With two-way image
    rows, dropping them moves the logits: the test sees the difference."""
    hf, lm = pair
    pngs = [png(6, 40, 56), png(7)]
    ids, layout = expand(lm, chat_ids(lm, "what differs?", 2), [lm.load_image(d) for d in pngs])
    logits, cache = forward(lm, ids, layout)
    cache.commit(len(ids))
    with torch.no_grad():
        ref = hf(**hf_inputs(ids, pngs), use_cache=True)
    assert (logits - ref.logits[0]).abs().max().item() < 1e-4
    if layout.two_way:
        one_way, _ = forward(lm, ids, layout, two_way=False)
        assert (one_way - ref.logits[0]).abs().max().item() > 1e-3
    assert_decode_steps_match(hf, lm, ref, cache, layout)


def test_greedy_generation_matches_transformers(pair: Any) -> None:
    hf, lm = pair
    data = png(8, 56, 40)
    ids = chat_ids(lm, "describe it")
    req = run(lm, ids, [lm.load_image(data)], max_tokens=16)
    full, _ = expand(lm, ids, [lm.load_image(data)])
    with torch.no_grad():
        out = hf.generate(**hf_inputs(full, [data]), max_new_tokens=16, do_sample=False)
    assert req.output_ids == out[0, len(full) :].tolist()


def run(
    lm: LoadedModel,
    ids: list[int],
    images: list[ImageInput],
    cfg: SpeculativeConfig | None = None,
    max_tokens: int = 40,
    core: EngineCore | None = None,
) -> Request:
    req = lm.new_request(list(ids), SamplingParams(max_tokens=max_tokens), images=images)
    if core is None:
        for _ in stream(lm, req, make_speculation(lm, cfg or SpeculativeConfig())):
            pass
        return req
    core.add(req, make_speculation(lm, cfg or SpeculativeConfig()))
    while not req.finished:
        core.step()
    return req


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the quiet two-way "dense" checkpoint, an assistant for it that proposes the current
    token: its layers write nothing, its head is the target's table)."""
    root = tmp_path_factory.mktemp("g4v-quiet")
    hf, target = make_dir(root / "target", "dense", quiet=True)
    table = hf.model.language_model.embed_tokens.weight
    echoing_assistant(table).save_pretrained(root / "assistant")
    return target, root / "assistant"


@pytest.fixture(scope="module")
def quiet_lm(quiet: tuple[Path, Path]) -> dict[str, LoadedModel]:
    return {d: load(str(quiet[0]), dtype=d, progress=False) for d in ("fp32", "bf16")}


TURN = "the cat sat on the mat. the cat sat on the"


@pytest.mark.parametrize(
    ("dtype", "method"),
    [
        ("fp32", "ngram"),
        pytest.param("bf16", "ngram", marks=needs_kernel),
        pytest.param("bf16", "assistant", marks=needs_kernel),
    ],
)
def test_speculation_on_image_turns_equals_plain(
    quiet: tuple[Path, Path], quiet_lm: dict[str, LoadedModel], dtype: str, method: str
) -> None:
    """One image, then two: greedy output with speculation equals speculation off's, and
    drafts were accepted (bf16: the C++ layers with the two-way image rows)."""
    lm = quiet_lm[dtype]
    cfg = SpeculativeConfig(
        method=method,
        num_draft_tokens=4,
        adaptive=False,
        draft_model=str(quiet[1]) if method == "assistant" else None,
    )
    accepted = 0
    for seed, count in [(1, 1), (2, 2)]:
        images = [lm.load_image(png(seed + i)) for i in range(count)]
        ids = chat_ids(lm, TURN, images=count)
        plain = run(lm, ids, images, max_tokens=48)
        fast = run(lm, ids, images, cfg, max_tokens=48)
        assert fast.output_ids == plain.output_ids
        accepted += fast.spec.accepted
    assert accepted > 0


@needs_kernel
def test_c_layers_equal_python_layers_with_two_way_images(quiet_lm: dict[str, LoadedModel]) -> None:
    """bf16: the C++ layers (kernels/gemma4_layer.cpp) give the Python layers' bits on a
    prompt whose image rows see each other both ways."""
    lm = quiet_lm["bf16"]
    model = lm.model
    assert isinstance(model, Gemma4LM) and model._fused_layers() is not None
    ids, layout = expand(lm, chat_ids(lm, "two ways"), [lm.load_image(png(9))])
    fused, _ = forward(lm, ids, layout)
    saved, model._fused = model._fused, False
    try:
        python, _ = forward(lm, ids, layout)
    finally:
        model._fused = saved
    assert torch.equal(fused, python)


def test_chunked_prefill_never_cuts_an_image(quiet_lm: dict[str, LoadedModel]) -> None:
    """Prompt chunks of 16 rows around images of 63 and 16 placeholders: each image runs in
    one forward (the step takes it whole past the budget; a cut one would fail
    pack_image_rows' check) and the output equals one whole-prompt forward's."""
    lm = quiet_lm["fp32"]
    images = [lm.load_image(png(10, 40, 56)), lm.load_image(png(11, 16, 16))]
    ids = chat_ids(lm, "chunks " * 6, images=2)
    whole = run(lm, ids, images, max_tokens=16)
    small = SchedulerConfig(max_step_tokens=16, max_prefill_with_decodes=16)
    chunked = run(lm, ids, images, max_tokens=16, core=EngineCore(lm, small))
    assert chunked.output_ids == whole.output_ids
    layout = chunked.images
    assert layout is not None and layout.two_way
    first = layout.spans[0]
    assert 0 < first.start < 16 and layout.chunk(0, 16) == first.start  # stops before it
    assert layout.chunk(first.start, 16) == first.length  # or runs it whole
    assert layout.chunk(first.start + 8, 16) == first.length - 8  # from a cached part of it


def test_prefix_cache_resumes_inside_an_image(quiet_lm: dict[str, LoadedModel]) -> None:
    """The same image again hits cached blocks that end inside it (blocks of 8); the rest of
    the image runs whole and the output equals the cache off's."""
    lm = quiet_lm["fp32"]
    image = lm.load_image(png(12, 40, 56))
    ids = chat_ids(lm, "again")
    expected = run(lm, ids, [image], max_tokens=16).output_ids
    core = EngineCore(lm, prefix_cache=PrefixCacheConfig(enabled=True, block_size=8))
    assert run(lm, ids, [image], max_tokens=16, core=core).output_ids == expected
    other = chat_ids(lm, "again, with more words after the picture")
    req = lm.new_request(list(other), SamplingParams(max_tokens=16), images=[image])
    seq = core.add(req, None)
    while not req.finished:
        core.step()
    assert req.images is not None
    span = req.images.spans[0]
    assert span.start < seq.cached_tokens < span.start + span.length + 8
    assert req.output_ids == run(lm, other, [image], max_tokens=16).output_ids


def test_server_image_chat_equals_the_engine(quiet_lm: dict[str, LoadedModel]) -> None:
    """A real server on loopback and the real `openai` client: an image as a data: URL gets
    the engine's text, usage counts the image's rows with its begin and end."""
    lm = quiet_lm["fp32"]
    engine = Engine({"g4": ServedModel(lm)}, max_waiting=4)
    engine.start()
    try:
        with BackgroundServer(create_app(engine, ServerConfig())) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            url = "data:image/png;base64," + base64.b64encode(png(13)).decode()
            content = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what is it?"},
            ]
            r = client.chat.completions.create(
                model="g4",
                messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
                max_tokens=12,
                temperature=0,
            )
    finally:
        engine.stop()
    ids = lm.tokenizer.encode_chat(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    )
    image = lm.load_image(png(13))
    req = run(lm, ids, [image], max_tokens=12)
    assert r.choices[0].message.content == req.text
    assert r.usage is not None and r.usage.prompt_tokens == len(ids) + image.num_tokens(2) + 1


def test_a_text_only_gemma4_refuses_images(tmp_path: Path) -> None:
    """Gemma4ForCausalLM's checkpoint (no tower): an image is refused with a clear error."""
    from test_gemma4 import hf_model

    from quickdraft.images import ImageError

    hf_model("dense").save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, SPECIALS, TEMPLATE)
    lm = load(str(tmp_path), dtype="fp32", progress=False)
    with pytest.raises(ImageError, match="takes no image input"):
        lm.load_image(png(1))


def test_images_are_pixels_in_zero_one() -> None:
    """Gemma 4 rescales only: the patches are the resized pixels / 255 (the tower maps them to
    [-1, 1] itself)."""
    proc = ImageProcessing.from_config(PREPROCESSOR, ImageProcessing(kind="gemma4"))
    flat = Image.fromarray(np.full((32, 32, 3), 51, dtype=np.uint8))
    image = preprocess(flat, proc)
    assert torch.allclose(image.pixels, torch.full_like(image.pixels, 0.2))
    ids, _ = ImageLayout.build([1, IMAGE, 2], [image], IMAGE, 2, around=(BOI, EOI), mrope=False)
    assert ids == [1, BOI] + [IMAGE] * image.num_tokens(2) + [EOI, 2]


# the GGUF tokenizer's specials from id 257: Gemma 4's image tokens land on the checkpoint's
GGUF_SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|image>", "<image|>", "<|image|>", "<|im_end|>")


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_mmproj_tower_equals_the_checkpoints(pair: Any, qtype: str, tmp_path: Path) -> None:
    """llama.cpp's `gemma4v` mmproj as its converter writes it (the patch embedding as a
    Conv2d, the clamps' scalars as tensors): the F32 file's tower gives the checkpoint's bits,
    a Q8_0 file's is close; the ids and preprocessing are Gemma 4's."""
    hf, lm = pair
    config = json.loads((lm.path / "config.json").read_text())
    path = write_mmproj(tmp_path / "mmproj.gguf", config, PREPROCESSOR, hf.state_dict(), qtype)
    assert placeholders(path) == SPECIALS[::-1][:1] + SPECIALS[:2]
    tower, proc = load_mmproj(path, (IMAGE, BOI, EOI), torch.float32)
    assert (proc.kind, proc.merge_size, proc.max_soft_tokens) == ("gemma4", 2, 280)
    image = lm.load_image(png(14, 40, 56))
    mine, theirs = (
        tower.encode(image.pixels, image.grid),
        lm.vision.encode(image.pixels, image.grid),
    )
    if qtype == "F32":
        assert torch.equal(mine, theirs)
    else:
        assert (mine - theirs).abs().max().item() < 0.05 * theirs.abs().max().item()


def test_gguf_target_with_mmproj_equals_transformers(tmp_path: Path, home: Path) -> None:
    """The two-way layout as llama.cpp users bring it: the language model's GGUF (its
    two-way image rows read from the missing per-layer embeddings) and the mmproj. Logits over
    an image prompt equal transformers'; n-gram speculation equals plain decoding."""
    hf, directory = make_dir(tmp_path / "hf", "dense")
    config = json.loads((directory / "config.json").read_text())
    text = hf.config.text_config.to_dict()
    state = language_model_state(hf)
    gguf = write_gguf(
        tmp_path / "g4.gguf",
        "gemma4",
        text,
        llama_cpp_tensors(state, "gemma4", text),
        specials=GGUF_SPECIALS,
    )
    mmproj = write_mmproj(tmp_path / "mmproj.gguf", config, PREPROCESSOR, hf.state_dict())
    lm = load(str(gguf), dtype="fp32", progress=False, mmproj=str(mmproj))
    assert lm.vision is not None and lm.model.config.two_way_images
    data = png(15, 40, 56)
    ids = [5, 17, IMAGE, 99, 3]
    full, layout = expand(lm, ids, [lm.load_image(data)])
    assert layout.two_way and full[2] == BOI
    logits, _ = forward(lm, full, layout)
    with torch.no_grad():
        ref = hf(**hf_inputs(full, [data], budget=280)).logits[0]  # the mmproj's default
    assert (logits - ref).abs().max().item() < 1e-4
    image = lm.load_image(data)
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    assert run(lm, ids, [image], cfg, 24).output_ids == run(lm, ids, [image], None, 24).output_ids
    # the projector beside a target whose tokenizer lacks Gemma 4's image tokens: named
    plain = write_gguf(
        tmp_path / "plain.gguf", "gemma4", text, llama_cpp_tensors(state, "gemma4", text)
    )
    with pytest.raises(ValueError, match=r"lacks .*<\|image\|>"):
        load(str(plain), dtype="fp32", progress=False, mmproj=str(mmproj))


def test_packed_image_rows_sit_after_the_sequences_before_them() -> None:
    """A text-only sequence packed before a two-way image sequence: the image rows and their
    key ends are the second sequence's, offset by the first one's rows; text rows keep their
    causal ends."""
    image = ImageInput(torch.zeros(16, 48), (1, 4, 4), "d")  # 4 placeholders at merge 2
    ids, layout = ImageLayout.build([1, 2, IMAGE, 3], [image], IMAGE, 2, (BOI, EOI), False, True)
    layout.embeds = [torch.ones(4, 8)]
    packed = pack_image_rows([None, layout], [7, 0], [5, len(ids)], 8, torch.device("cpu"))
    assert packed is not None and packed.ends is not None
    assert packed.rows.tolist() == [5 + 3 + j for j in range(4)]  # after the 5 text rows
    assert packed.ends[:5].tolist() == [8, 9, 10, 11, 12]
    assert packed.ends[5:].tolist() == [1, 2, 3, 7, 7, 7, 7, 8, 9]
