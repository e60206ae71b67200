"""Gemma 4 with video (videos.py: decoding, frame sampling, the per-frame prompt; each frame an
image to the layout, the tower and the decoder) against transformers 5.x: its PyAV loader and
sampler, `Gemma4Processor.replace_video_token`'s prompt, and Gemma4ForConditionalGeneration's
forward over `pixel_values_videos` in fp32, on the tiny checkpoints of test_vision_gemma4 with a
video token. Then speculation on video turns equals plain decoding, a real server takes a
`video_url` part, and bad videos are refused with a 400 that names the part.

transformers' Gemma4VideoProcessor itself needs torchvision, which has no CPU build for this
torch here: its resize is torchvision's uint8 path on the CPU (torch's bicubic antialiased
kernel on the uint8 values, which videos.py calls), its rescale a division by 255."""

from __future__ import annotations

import base64
import io
import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import openai
import pytest
import torch
from conftest import write_tiny_tokenizer
from kernel_checks import needs_kernel
from test_gemma4_assistant import echoing_assistant
from test_vision_gemma4 import BOI, EOI, IMAGE, PREPROCESSOR, SPECIALS, TWO_WAY, make_dir, run
from vision_models import png

from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine import Engine, EngineCore, ServedModel
from quickdraft.images import ImageError, ImageInput
from quickdraft.loading import LoadedModel, load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer
from quickdraft.videos import (
    VideoInput,
    VideoProcessing,
    decode_video,
    expand_videos,
    load_video,
    preprocess_frame,
    sample_indices,
)

VIDEO = 263  # "<|video|>", after test_vision_gemma4's three image tokens
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'video' %}<|video|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FRAMES = 4  # the checkpoints' video budget (video_preprocessor_config.json)


def make_video_dir(directory: Path, shape: str, quiet: bool = False) -> tuple[Any, Path]:
    """test_vision_gemma4's checkpoint with a video token, a template that places it and a
    video processor of FRAMES frames at 70 placeholders."""
    hf, directory = make_dir(directory, shape, quiet)
    hf.config.video_token_id = VIDEO
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"video_token_id": VIDEO}))
    video = dict(PREPROCESSOR, max_soft_tokens=70, num_frames=FRAMES, do_normalize=True)
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video))
    write_tiny_tokenizer(directory, (*SPECIALS, "<|video|>"), TEMPLATE)
    return hf, directory


def mp4(
    frames: int,
    width: int = 40,
    height: int = 32,
    fps: int = 2,
    seed: int = 0,
    container_format: str = "mp4",
) -> bytes:
    """An H.264 (or MPEG-4) video of moving random blocks, written by PyAV (in Matroska the
    stream does not say its frame count)."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8 + 1, width // 8 + 2, 3), dtype=np.uint8)
    out = io.BytesIO()
    with av.open(out, mode="w", format=container_format) as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            big = np.kron(np.roll(base, i, axis=1), np.ones((8, 8, 1), dtype=np.uint8))
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(big[:height, :width]), "rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


@pytest.fixture(scope="module", params=sorted(TWO_WAY))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(transformers' model, ours in fp32) for each layout, with video."""
    root = tmp_path_factory.mktemp(f"g4video-{request.param}")
    hf, directory = make_video_dir(root, request.param)
    return hf, load(str(directory), dtype="fp32", progress=False)


def video_chat(lm: LoadedModel, video: VideoInput, text: str, image: bool = False) -> list[int]:
    """Our chat ids for a user turn of [an image,] a video and text, the video's placeholder
    expanded to its frames' (the server's path)."""
    parts = [{"type": "image"}] * image + [{"type": "video"}, {"type": "text", "text": text}]
    assert lm.video_processing is not None
    expand = partial(expand_videos, videos=[video], proc=lm.video_processing)
    return lm.tokenizer.encode_chat([{"role": "user", "content": parts}], None, expand)


def hf_video_inputs(
    ids: list[int], frames: tuple[ImageInput, ...], video: int = VIDEO
) -> dict[str, Any]:
    """transformers' video inputs for our preprocessed frames: each frame's patches padded to
    the budget's 70 x 2 x 2, positions (x, y) with -1 padding, as Gemma4VideoProcessor
    lays them out."""
    budget = 70 * PREPROCESSOR["pooling_kernel_size"] ** 2
    pixels = torch.zeros(len(frames), budget, frames[0].pixels.shape[1])
    positions = torch.full((len(frames), budget, 2), -1, dtype=torch.long)
    for f, frame in enumerate(frames):
        _, h, w = frame.grid
        pixels[f, : h * w] = frame.pixels
        y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions[f, : h * w] = torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)
    ids_t = torch.tensor([ids])
    kinds = (ids_t == IMAGE).int() + 2 * (ids_t == video).int()
    return dict(
        input_ids=ids_t,
        mm_token_type_ids=kinds,
        pixel_values_videos=pixels,
        video_position_ids=positions,
        num_frames_per_video=torch.tensor([len(frames)]),
    )


def test_decoding_and_sampling_match_transformers(tmp_path: Path) -> None:
    """Our PyAV decode of a 10-frame video sampled to 4 frames: the same frames, indices and
    timestamps as transformers' `load_video` with its default sampler; a shorter video than
    the budget keeps every frame (transformers raises there)."""
    from transformers.video_utils import default_sample_indices_fn
    from transformers.video_utils import load_video as hf_load_video

    data = mp4(10, fps=4)
    path = tmp_path / "v.mp4"
    path.write_bytes(data)
    sampler = partial(default_sample_indices_fn, num_frames=4)
    theirs, meta = hf_load_video(str(path), backend="pyav", sample_indices_fn=sampler)
    frames, indices, fps, _ = decode_video(data, uniform(4))
    assert indices == list(meta.frames_indices) == sample_indices(10, 4) == [0, 2, 5, 7]
    assert fps == meta.fps == 4.0
    assert np.array_equal(np.stack(frames), theirs)
    assert [i / fps for i in indices] == meta.timestamps
    short, kept, _, _ = decode_video(mp4(3), uniform(4))
    assert kept == [0, 1, 2] and len(short) == 3
    mkv = mp4(7, fps=4, container_format="matroska")  # counted by decoding: 7 frames
    import av

    with av.open(io.BytesIO(mkv)) as container:
        assert container.streams.video[0].frames == 0
        every = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    frames, indices, fps, total = decode_video(mkv, uniform(4))
    assert indices == [0, 1, 3, 5] and fps == 4.0 and total == 7
    assert all(np.array_equal(every[i], f) for i, f in zip(indices, frames, strict=True))


def test_prompt_matches_transformers_processor(pair: Any) -> None:
    """The ids of a video turn equal our tokenizer's ids of the text transformers'
    `Gemma4Processor.replace_video_token` writes (timestamps, begin, placeholders, end per
    frame, joined by spaces), each frame's rows one span."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.video_utils import VideoMetadata

    _, lm = pair
    assert lm.video_processing is not None and lm.video_processing.num_frames == FRAMES
    video = load_video(mp4(9, fps=1), lm.video_processing)
    assert video.timestamps == (0.0, 2.0, 4.0, 6.0)
    ids = video_chat(lm, video, "what moves?")
    req = lm.new_request(ids, _params(), images=list(video.frames))
    count = video.frames[0].num_tokens(2)
    meta = VideoMetadata(total_num_frames=9, fps=1.0, frames_indices=[0, 2, 4, 6])
    names = SimpleNamespace(boi_token="<|image>", eoi_token="<image|>", video_token="<|video|>")
    inputs = {"num_soft_tokens_per_video": [count], "video_metadata": [meta]}
    text = Gemma4Processor.replace_video_token(names, inputs, 0)  # type: ignore[arg-type]
    rendered = lm.tokenizer.render_chat(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]}]
    )
    assert req.prompt_ids == lm.tokenizer.encode(rendered.replace("<|video|>", text))
    assert req.images is not None and len(req.images.spans) == FRAMES
    for span in req.images.spans:
        ids_in = req.prompt_ids[span.start - 1 : span.start + span.length + 1]
        assert ids_in == [BOI] + [VIDEO] * count + [EOI]


def uniform(n: int) -> Any:
    """Gemma 4's sampler of `n` frames, as decode_video takes it."""
    return lambda total, fps: sample_indices(total, n)


def _params() -> Any:
    from quickdraft.request import SamplingParams

    return SamplingParams(max_tokens=1)


def test_frames_are_rescaled_pixels() -> None:
    """A flat frame of 51: patches of 51 / 255 = 0.2 (fused normalize with mean 0, std 1, as
    the rescale alone), resized to the budget (70 placeholders of 2 x 2 patches of 4)."""
    raw = dict(PREPROCESSOR, do_normalize=True)
    proc = VideoProcessing.from_config(raw, "gemma4", _image(), "<v>", VIDEO)
    frame = preprocess_frame(np.full((48, 64, 3), 51, dtype=np.uint8), proc)
    assert torch.equal(frame.pixels, torch.full_like(frame.pixels, 51 / 255))
    _, h, w = frame.grid
    assert (h, w) == (14, 18) and frame.num_tokens(2) == 63  # 56 x 72 pixels


def _image() -> Any:
    from quickdraft.images import ImageProcessing

    return ImageProcessing.from_config(PREPROCESSOR, ImageProcessing(kind="gemma4"))


def test_video_logits_match_transformers(pair: Any) -> None:
    """Every row of a prompt with an image, a 4-frame video and text against transformers'
    forward with `pixel_values_videos` (1e-4): each frame's rows are the tower's, two-way
    within the frame in the dense layout."""
    hf, lm = pair
    video = load_video(mp4(8, seed=3), lm.video_processing)
    image = lm.load_image(png(21, 32, 40))
    ids = video_chat(lm, video, "and now?", image=True)
    req = lm.new_request(ids, _params(), images=[image, *video.frames])
    layout, full = req.images, req.prompt_ids
    assert layout is not None
    from test_vision_gemma4 import forward, hf_pixels

    logits, _ = forward(lm, full, layout)
    inputs = hf_video_inputs(full, video.frames)
    pixels = hf_pixels([png(21, 32, 40)])
    with torch.no_grad():
        ref = hf(**inputs, **pixels).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("g4video-quiet")
    hf, target = make_video_dir(root / "target", "dense", quiet=True)
    echoing_assistant(hf.model.language_model.embed_tokens.weight).save_pretrained(
        root / "assistant"
    )
    return target, root / "assistant"


@pytest.mark.parametrize(
    ("dtype", "method"),
    [("fp32", "ngram"), pytest.param("bf16", "assistant", marks=needs_kernel)],
)
def test_speculation_on_video_turns_equals_plain(
    quiet: tuple[Path, Path], dtype: str, method: str
) -> None:
    """Greedy output with speculation equals speculation off's on a video turn, with drafts
    accepted; the same video again resumes from the prefix cache with the same output."""
    lm = load(str(quiet[0]), dtype=dtype, progress=False)
    cfg = SpeculativeConfig(
        method=method,
        num_draft_tokens=4,
        adaptive=False,
        draft_model=str(quiet[1]) if method == "assistant" else None,
    )
    video = load_video(mp4(6, seed=5), lm.video_processing)
    ids = video_chat(lm, video, "the cat sat on the mat. the cat sat on the")
    plain = run(lm, ids, list(video.frames), max_tokens=40)
    fast = run(lm, ids, list(video.frames), cfg, max_tokens=40)
    assert fast.output_ids == plain.output_ids and fast.spec.accepted > 0
    core = EngineCore(lm, prefix_cache=PrefixCacheConfig(enabled=True, block_size=8))
    for _ in range(2):
        again = run(lm, ids, list(video.frames), cfg, max_tokens=40, core=core)
        assert again.output_ids == plain.output_ids


def test_server_video_chat_and_refusals(quiet: tuple[Path, Path]) -> None:
    """A real server on loopback, the real `openai` client: a `video_url` data: URL gets the
    engine's text; bytes that are no video, a truncated video and a second video are 400s
    naming the part, and the server serves on."""
    lm = load(str(quiet[0]), dtype="fp32", progress=False)
    data = mp4(5, seed=7)
    engine = Engine({"g4": ServedModel(lm)}, max_waiting=4)
    engine.start()

    def content(*videos: bytes) -> list[dict[str, Any]]:
        urls = ["data:video/mp4;base64," + base64.b64encode(v).decode() for v in videos]
        parts = [{"type": "video_url", "video_url": {"url": url}} for url in urls]
        return [*parts, {"type": "text", "text": "what happens?"}]

    try:
        with BackgroundServer(create_app(engine, ServerConfig())) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

            def ask(parts: list[dict[str, Any]]) -> Any:
                return client.chat.completions.create(
                    model="g4",
                    messages=[{"role": "user", "content": parts}],  # type: ignore[misc,list-item]
                    max_tokens=12,
                    temperature=0,
                )

            r = ask(content(data))
            for bad, param in [
                (content(b"\x00\x00\x00 not a video at all" * 20), "content[0].video_url"),
                (content(data, data), "content[1].video_url"),
            ]:
                with pytest.raises(openai.BadRequestError) as err:
                    ask(bad)
                assert err.value.body["param"] == f"messages[0].{param}"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError, match="not a readable video"):
                ask(content(data[: len(data) // 2]))  # truncated
            assert ask(content(data)).choices[0].message.content == r.choices[0].message.content
    finally:
        engine.stop()
    video = load_video(data, lm.video_processing)
    ids = video_chat(lm, video, "what happens?")
    req = run(lm, ids, list(video.frames), max_tokens=12)
    assert r.choices[0].message.content == req.text
    frames = len(video.frames) * (video.frames[0].num_tokens(2) + 1)  # rows + end, per frame
    assert r.usage is not None and r.usage.prompt_tokens == len(ids) + frames


def test_gguf_target_with_mmproj_takes_video(tmp_path: Path, home: Path) -> None:
    """llama.cpp users' files: the language model's GGUF, whose tokenizer has `<|video|>`, and
    the mmproj. The video processing is Gemma 4's default (32 frames of 70 placeholders; a
    5-frame video keeps all five) and the logits over a video prompt equal transformers'."""
    from test_vision_gemma4 import GGUF_SPECIALS, forward
    from vision_models import language_model_state

    from quickdraft.hub.gguf_write import llama_cpp_tensors, write_gguf, write_mmproj

    hf, directory = make_dir(tmp_path / "hf", "dense")
    specials = (*GGUF_SPECIALS, "<|video|>")  # from id 257: the video token is 264
    hf.config.video_token_id = 257 + len(GGUF_SPECIALS)
    config = json.loads((directory / "config.json").read_text())
    text = hf.config.text_config.to_dict()
    state = language_model_state(hf)
    tensors = llama_cpp_tensors(state, "gemma4", text)
    gguf = write_gguf(tmp_path / "g4.gguf", "gemma4", text, tensors, specials=specials)
    mmproj = write_mmproj(tmp_path / "mmproj.gguf", config, PREPROCESSOR, hf.state_dict())
    lm = load(str(gguf), dtype="fp32", progress=False, mmproj=str(mmproj))
    proc = lm.video_processing
    assert proc is not None and (proc.num_frames, proc.frame.max_soft_tokens) == (32, 70)
    video = load_video(mp4(5, seed=9), proc)
    assert len(video.frames) == 5
    frames = lm.tokenizer.encode(proc.prompt_text(video), add_special_tokens=False)
    ids = [5, 17, *frames, 99, 3]
    req = lm.new_request(ids, _params(), images=list(video.frames))
    assert req.images is not None and len(req.images.spans) == 5
    logits, _ = forward(lm, req.prompt_ids, req.images)
    with torch.no_grad():
        inputs = hf_video_inputs(req.prompt_ids, video.frames, hf.config.video_token_id)
        ref = hf(**inputs).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4


def test_cli_generate_with_a_video(
    quiet: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --chat --video FILE`: the frames' rows (each with its timestamp, begin and end)
    are in the prompt; without --chat it is a clear error."""
    from quickdraft.cli import main

    lm = load(str(quiet[0]), dtype="fp32", progress=False)
    data = mp4(5, seed=11)
    (tmp_path / "v.mp4").write_bytes(data)
    base = ["generate", "--model", str(quiet[0]), "--dtype", "fp32", "--max-tokens", "4"]
    assert main([*base, "--chat", "--video", str(tmp_path / "v.mp4"), "what is it?"]) == 0
    shown = int(capsys.readouterr().err.split("prompt ")[1].split(" tok")[0])
    video = load_video(data, lm.video_processing)
    ids = video_chat(lm, video, "what is it?")
    req = lm.new_request(ids, _params(), images=list(video.frames))
    assert shown == len(req.prompt_ids)
    assert main([*base, "--video", str(tmp_path / "v.mp4"), "what is it?"]) == 2
    assert "--video needs --chat" in capsys.readouterr().err


def test_bad_videos_are_refused() -> None:
    """No video, frames over the pixel limit, more frames than the limit: ImageError, before
    anything is decoded past the check."""
    with pytest.raises(ImageError, match="not a readable video"):
        decode_video(b"RIFF" + bytes(200), uniform(4))
    with pytest.raises(ImageError, match="over the limit of 100"):
        decode_video(mp4(3), uniform(4), max_pixels=100)
    with pytest.raises(ImageError, match="8 frames, over the limit of 5"):
        decode_video(mp4(8), uniform(4), max_frames=5)
    with pytest.raises(ImageError, match="placed 0 video placeholders for 1 videos"):
        proc = VideoProcessing.from_config({}, "gemma4", _image(), "<|video|>", VIDEO)
        expand_videos("no placeholder here", [VideoInput((), ())], proc)


def test_an_image_only_checkpoint_takes_no_video(tmp_path: Path) -> None:
    """Without a video token in its tokenizer the model has no video processing: the server
    refuses video parts (test above), the model still takes images."""
    _, directory = make_dir(tmp_path, "dense")
    lm = load(str(directory), dtype="fp32", progress=False)
    assert lm.video_processing is None and lm.vision is not None
    assert lm.image_token_ids == frozenset({IMAGE})
