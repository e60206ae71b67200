"""Qwen2.5-VL with video (videos.py's Qwen path: fps sampling, the pixel cap, one grid of
temporal patches, M-RoPE time positions) against transformers 5.x on the tiny checkpoint of
test_vision_qwen25 with a video token: its `get_rope_index` with `second_per_grid_ts`, its
tower over `pixel_values_videos` and every prompt row's logits in fp32. transformers'
Qwen2VLVideoProcessor needs torchvision, which has no CPU build for this torch here: its
`sample_frames` (with fps), the cap of `resize` and `patchify` are written out below from its
code and compared; its resize is torchvision's uint8 path (videos.py). Then speculation on a
video turn equals plain decoding, and the prefix cache keeps it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_tiny_tokenizer
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)
from test_video_gemma4 import mp4
from test_vision import run
from vision_models import IMAGE_PAD, VISION_SPECIALS, make_qwen25_vl_dir, png

from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine import EngineCore
from quickdraft.images import ImageInput, ImageRows, pack_image_rows
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation
from quickdraft.videos import VideoProcessing, qwen_indices

VIDEO_PAD = 263  # the tiny checkpoints' video_token_id, after the three vision specials
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# tiny patches (4, merge 2: 8-pixel units), 16 x 16 .. 48 x 48 pixels a frame, 2 frames a
# second, a token budget small enough that the cap binds at 8 frames
VIDEO_CONFIG = {
    "min_pixels": 16 * 16,
    "max_pixels": 48 * 48,
    "fps": 2.0,
    "min_frames": 4,
    "max_frames": 16,
    "max_video_tokens": 40,
}


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    hf, directory = make_qwen25_vl_dir(tmp_path_factory.mktemp("qwen25vl-video"), out_scale=0.1)
    (directory / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    write_tiny_tokenizer(directory, (*VISION_SPECIALS, "<|video_pad|>"), TEMPLATE)
    return hf, load(str(directory), dtype="fp32", progress=False)


def reference_indices(total: int, video_fps: float, cfg: dict[str, Any], tp: int = 2) -> list[int]:
    """Qwen2VLVideoProcessor.sample_frames with `fps` (transformers 5.x), as written there."""
    max_frames = math.floor(min(cfg["max_frames"], total) / tp) * tp
    num_frames = total / video_fps * cfg["fps"]
    num_frames = min(max(num_frames, cfg["min_frames"]), max_frames, total)
    num_frames = math.floor(num_frames / tp) * tp
    return torch.arange(0, total, total / num_frames).int().tolist()


def reference_patchify(video: torch.Tensor, p: int, m: int, tp: int) -> torch.Tensor:
    """Qwen2VLVideoProcessor.patchify of one normalized video [T, C, H, W], as written there."""
    videos = video[None]
    b, t, c, h, w = videos.shape
    if pad := -t % tp:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
        t += pad
    gt, gh, gw = t // tp, h // p, w // p
    patches = videos.view(b, gt, tp, c, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(gt * gh * gw, c * tp * p * p)


def video_ids(lm: LoadedModel, text: str, image: bool = False) -> list[int]:
    parts = [{"type": "image"}] * image + [{"type": "video"}, {"type": "text", "text": text}]
    return lm.tokenizer.encode_chat([{"role": "user", "content": parts}])


@pytest.mark.parametrize(
    ("total", "fps"), [(9, 4.0), (30, 30.0), (100, 10.0), (7, 1.0), (40, 2.0)], ids=str
)
def test_sampling_matches_transformers(total: int, fps: float) -> None:
    proc = VideoProcessing.from_config(VIDEO_CONFIG, "qwen2_5_vl", _image(), "<v>", VIDEO_PAD)
    assert qwen_indices(total, fps, 2.0, 4, 16, proc.frame) == reference_indices(
        total, fps, VIDEO_CONFIG
    )


def _image() -> Any:
    from vision_models import QWEN25_PREPROCESSOR

    from quickdraft.images import PROCESSING, ImageProcessing

    return ImageProcessing.from_config(QWEN25_PREPROCESSOR, PROCESSING["qwen2_5_vl"])


def reference_size(height: int, width: int, frames: int, cfg: dict[str, Any]) -> tuple[int, int]:
    """Qwen2VLVideoProcessor.resize with cap_pixels_per_frame: the capped upper bound, then
    smart_resize (factor 8 here), as written there."""
    factor, lo = 8, cfg["min_pixels"]
    total = int(cfg["max_video_tokens"] * factor * factor * 0.9)
    hi = max(min(cfg["max_pixels"], total * 2 // frames), int(lo * 1.05))
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > hi:
        beta = math.sqrt(height * width / hi)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < lo:
        beta = math.sqrt(lo / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def test_grid_is_transformers_patchify_of_the_capped_frames(vl: tuple[Any, LoadedModel]) -> None:
    """8 frames sampled of 16 at 4 a second, 80 x 64 pixels: the cap (40 tokens' pixels x 0.9
    x 2 / 8 frames = 576) resizes them to 24 x 16, and the rows are transformers' patchify of
    the normalized frames; an odd count of frames is padded by the last one. The time step
    is tokens_per_second x 2 frames / the sampled 2 a second."""
    hf, lm = vl
    proc = lm.video_processing
    assert proc is not None and (proc.kind, proc.token_id) == ("qwen2_5_vl", VIDEO_PAD)
    data = mp4(16, width=80, height=64, fps=4, seed=2)
    (grid,) = lm.load_video(data).frames
    height, width = reference_size(64, 80, 8, VIDEO_CONFIG)
    assert grid.grid == (4, height // 4, width // 4) == (4, 4, 6)
    assert grid.time_interval == hf.config.vision_config.tokens_per_second * 2 / 2.0
    from quickdraft.videos import _normalized, _resized, decode_video

    frames, indices, _, _ = decode_video(data, proc.sample)
    assert indices == reference_indices(16, 4.0, VIDEO_CONFIG) and len(frames) == 8
    raw = _resized(torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2), height, width)
    assert torch.equal(grid.pixels, reference_patchify(_normalized(raw, proc), 4, 2, 2))
    # 5 frames at 1 a second: min_frames 4 -> 4 frames, 2 temporal patches; a 1-frame video
    # keeps its frame, padded to one patch
    assert lm.load_video(mp4(5, fps=1, seed=3)).frames[0].grid[0] == 2
    assert lm.load_video(mp4(1, seed=3)).frames[0].grid[0] == 1


def our_forward(lm: LoadedModel, ids: list[int], inputs: list[ImageInput]) -> Any:
    req = lm.new_request(list(ids), SamplingParams(max_tokens=1), images=inputs)
    layout = req.images
    assert layout is not None and lm.vision is not None
    layout.embeds = [lm.vision.encode(s.image.pixels, s.image.grid) for s in layout.spans]
    full = req.prompt_ids
    rows = pack_image_rows([layout], [0], [len(full)], 64, torch.device("cpu"))
    assert isinstance(rows, ImageRows)
    cache = lm.model.new_cache(len(full) + 8)
    out = lm.model(
        torch.tensor(full), [cache], [len(full)], logit_rows=torch.arange(len(full)), images=rows
    )
    return out.logits, full, layout


def test_video_positions_tower_and_logits_match_transformers(vl: tuple[Any, LoadedModel]) -> None:
    """An image, then a 5-grid video, then text: M-RoPE positions equal get_rope_index's with
    second_per_grid_ts (time steps of 2 x 2 / 2 = 2 positions), the tower's rows over the
    video grid equal get_video_features', every row's logits transformers' (1e-4)."""
    hf, lm = vl
    image = lm.load_image(png(4, 32, 24))
    video = lm.load_video(mp4(20, width=40, height=32, fps=4, seed=5))  # 10 frames, 5 patches
    (grid,) = video.frames
    assert grid.grid[0] == 5
    ids = video_ids(lm, "what happens?", image=True)
    logits, full, layout = our_forward(lm, ids, [image, grid])
    ids_t = torch.tensor([full])
    kinds = (ids_t == IMAGE_PAD).int() + 2 * (ids_t == VIDEO_PAD).int()
    seconds = torch.tensor([2 / 2.0])  # temporal patch / sampled fps
    assert grid.time_interval == hf.config.vision_config.tokens_per_second * 1.0
    expected, delta = hf.model.get_rope_index(
        ids_t, kinds, torch.tensor([image.grid]), torch.tensor([grid.grid]), seconds
    )
    assert torch.equal(layout.positions, expected[:, 0]) and layout.delta == int(delta)
    with torch.no_grad():
        tower = hf.model.get_video_features(
            grid.pixels, torch.tensor([grid.grid]), return_dict=True
        ).pooler_output[0]
        ref = hf(
            input_ids=ids_t,
            pixel_values=image.pixels,
            image_grid_thw=torch.tensor([image.grid]),
            pixel_values_videos=grid.pixels,
            video_grid_thw=torch.tensor([grid.grid]),
            second_per_grid_ts=seconds,
            mm_token_type_ids=kinds,
        ).logits[0]
    assert lm.vision is not None
    assert (lm.vision.encode(grid.pixels, grid.grid) - tower).abs().max().item() < 1e-5
    assert (logits - ref).abs().max().item() < 1e-4


def test_speculation_on_a_video_turn_equals_plain(vl: tuple[Any, LoadedModel]) -> None:
    """n-gram and suffix: greedy output with speculation equals speculation off's on a video
    turn; the prefix cache resumes the same video with the same output."""
    _, lm = vl
    video = lm.load_video(mp4(12, fps=2, seed=7))
    ids = video_ids(lm, "the cat sat on the mat. the cat sat on the")
    plain = run(lm, ids, list(video.frames), max_tokens=32)
    for method in ("ngram", "suffix"):
        cfg = SpeculativeConfig(method=method, num_draft_tokens=4, adaptive=False)
        assert run(lm, ids, list(video.frames), cfg, max_tokens=32).output_ids == plain.output_ids
    core = EngineCore(lm, prefix_cache=PrefixCacheConfig(enabled=True, block_size=8))
    cached = []
    for _ in range(2):
        req = lm.new_request(list(ids), SamplingParams(max_tokens=32), images=list(video.frames))
        seq = core.add(req, make_speculation(lm, SpeculativeConfig()))
        while not req.finished:
            core.step()
        cached.append(seq.cached_tokens)
        assert req.output_ids == plain.output_ids
    assert cached[0] == 0 and cached[1] > 0


def test_a_checkpoint_without_the_video_token_takes_none(tmp_path: Path) -> None:
    _, directory = make_qwen25_vl_dir(tmp_path)
    lm = load(str(directory), dtype="fp32", progress=False)
    assert lm.vision is not None and lm.video_processing is None


def test_server_video_turn_equals_the_engine(vl: tuple[Any, LoadedModel]) -> None:
    """A real server and the openai client: a `video_url` part on Qwen2.5-VL (one grid, no
    timestamps in the text) gets the engine's text; usage counts the grid's rows."""
    import base64

    import openai

    from quickdraft.engine import Engine, ServedModel
    from quickdraft.server import ServerConfig, create_app
    from quickdraft.server.main import BackgroundServer

    _, lm = vl
    data = mp4(10, fps=2, seed=11)
    engine = Engine({"vl": ServedModel(lm)}, max_waiting=4)
    engine.start()
    try:
        with BackgroundServer(create_app(engine, ServerConfig())) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            url = "data:video/mp4;base64," + base64.b64encode(data).decode()
            content = [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": "what happens?"},
            ]
            r = client.chat.completions.create(
                model="vl",
                messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
                max_tokens=12,
                temperature=0,
            )
    finally:
        engine.stop()
    (grid,) = lm.load_video(data).frames
    ids = video_ids(lm, "what happens?")
    req = run(lm, ids, [grid], max_tokens=12)
    assert r.choices[0].message.content == req.text
    assert r.usage is not None and r.usage.prompt_tokens == len(ids) - 1 + grid.num_tokens(2)
