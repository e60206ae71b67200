"""Qwen3.5 / 3.6 with video (videos.py's Qwen3-VL path: fps sampling by linspace, the per-frame
cap, one image of grid (1, h, w) per temporal patch behind its "<t seconds>" text) against
transformers 5.x on the tiny Qwen3.5 vision-language checkpoint of tests/vision_models.py with
a video token: the prompt text of `Qwen3VLProcessor.replace_video_token`, `get_rope_index`
(which splits a video's grid per temporal patch) and every prompt row's logits over
`pixel_values_videos` in fp32. Qwen3VLVideoProcessor needs torchvision (no CPU build for this
torch here): its `sample_frames`, `smart_resize` with the cap and `patchify` are written out
below from its code. Then speculation (n-gram, MTP) on a video turn equals plain decoding."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_tiny_tokenizer
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)
from test_video_gemma4 import mp4
from test_video_qwen25 import TEMPLATE, reference_patchify
from test_vision import run
from vision_models import IMAGE_PAD, VISION_SPECIALS, add_copying_mtp_head, make_vlm_dir, png

from quickdraft.config import SpeculativeConfig
from quickdraft.images import ImageRows, pack_image_rows
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.videos import _normalized, _resized, decode_video

VIDEO_PAD = 263
# tiny patches (4, merge 2: 8-pixel units); the bounds are all frames' pixels (Qwen3VL's
# smart_resize counts the frames), a frame capped at 6 tokens' pixels
VIDEO_CONFIG = {
    "size": {"shortest_edge": 8 * 8 * 4, "longest_edge": 48 * 48 * 8},
    "fps": 2,
    "min_frames": 4,
    "max_frames": 16,
    "max_video_tokens": 6,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    hf, directory = make_vlm_dir(tmp_path_factory.mktemp("qwen35-video"), out_scale=0.1)
    add_copying_mtp_head(directory)
    (directory / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    write_tiny_tokenizer(directory, (*VISION_SPECIALS, "<|video_pad|>"), TEMPLATE)
    return hf, load(str(directory), dtype="fp32", progress=False)


def reference_indices(total: int, video_fps: float) -> list[int]:
    """Qwen3VLVideoProcessor.sample_frames with fps, as written there."""
    n = int(total / video_fps * VIDEO_CONFIG["fps"])
    n = min(max(n, VIDEO_CONFIG["min_frames"]), VIDEO_CONFIG["max_frames"], total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def reference_size(frames: int, height: int, width: int) -> tuple[int, int]:
    """Qwen3VLVideoProcessor.resize with the cap, then its smart_resize (factor 8), as written
    there."""
    factor, size = 8, VIDEO_CONFIG["size"]
    cap = VIDEO_CONFIG["max_video_tokens"] * factor * factor
    per_frame = max(min(cap, size["longest_edge"] // frames), int(size["shortest_edge"] * 1.05))
    lo, hi = size["shortest_edge"], per_frame * frames
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / 2) * 2
    if t_bar * h_bar * w_bar > hi:
        beta = math.sqrt(frames * height * width / hi)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < lo:
        beta = math.sqrt(lo / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_ids(lm: LoadedModel, video: Any, text: str, image: bool = False) -> list[int]:
    from functools import partial

    from quickdraft.videos import expand_videos

    assert lm.video_processing is not None
    parts = [{"type": "image"}] * image + [{"type": "video"}, {"type": "text", "text": text}]
    expand = partial(expand_videos, videos=[video], proc=lm.video_processing)
    return lm.tokenizer.encode_chat([{"role": "user", "content": parts}], None, expand)


def test_patches_and_prompt_match_transformers(vlm: tuple[Any, LoadedModel]) -> None:
    """7 frames sampled of 20 at 4 a second (linspace), resized with the cap to the reference
    size, one image per temporal patch whose rows are patchify's (the 7th frame repeated),
    times the mean of each pair; the ids are those of the text replace_video_token writes."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    _, lm = vlm
    proc = lm.video_processing
    assert proc is not None and (proc.kind, proc.token_id) == ("qwen3_5", VIDEO_PAD)
    data = mp4(14, width=40, height=32, fps=4, seed=4)
    video = lm.load_video(data)
    indices = reference_indices(14, 4.0)
    assert len(indices) == 7
    frames, got, fps, _ = decode_video(data, proc.sample)
    assert got == indices
    height, width = reference_size(7, 32, 40)
    raw = _resized(torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2), height, width)
    ref = reference_patchify(_normalized(raw, proc), 4, 2, 2)
    assert len(video.frames) == 4 and all(
        f.grid == (1, height // 4, width // 4) for f in video.frames
    )
    assert torch.equal(torch.cat([f.pixels for f in video.frames]), ref)
    names = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        video_token="<|video_pad|>",
        _calculate_timestamps=lambda i, f, m: Qwen3VLProcessor._calculate_timestamps(None, i, f, m),  # type: ignore[arg-type]
    )
    meta = VideoMetadata(total_num_frames=14, fps=fps, frames_indices=indices)
    grid = torch.tensor([[4, height // 4, width // 4]])
    text = Qwen3VLProcessor.replace_video_token(  # type: ignore[arg-type]
        names, {"video_grid_thw": grid, "video_metadata": [meta]}, 0
    )
    ids = video_ids(lm, video, "what moves?")
    req = lm.new_request(ids, SamplingParams(max_tokens=1), images=list(video.frames))
    parts = [{"type": "video"}, {"type": "text", "text": "what moves?"}]
    rendered = lm.tokenizer.render_chat([{"role": "user", "content": parts}])
    assert req.prompt_ids == lm.tokenizer.encode(rendered.replace("<|video_pad|>", text, 1))


def test_video_logits_match_transformers(vlm: tuple[Any, LoadedModel]) -> None:
    """An image, a 3-patch video and text: positions equal get_rope_index's, every row's logits
    transformers' over pixel_values_videos (1e-4)."""
    hf, lm = vlm
    image = lm.load_image(png(3, 32, 24))
    video = lm.load_video(mp4(12, width=40, height=32, fps=4, seed=6))  # 6 frames: 3 patches
    assert len(video.frames) == 3
    ids = video_ids(lm, video, "and then?", image=True)
    req = lm.new_request(ids, SamplingParams(max_tokens=1), images=[image, *video.frames])
    layout, full = req.images, req.prompt_ids
    assert layout is not None and lm.vision is not None
    layout.embeds = [lm.vision.encode(s.image.pixels, s.image.grid) for s in layout.spans]
    rows = pack_image_rows([layout], [0], [len(full)], 64, torch.device("cpu"))
    assert isinstance(rows, ImageRows)
    cache = lm.model.new_cache(len(full) + 8)
    logits = lm.model(
        torch.tensor(full), [cache], [len(full)], logit_rows=torch.arange(len(full)), images=rows
    ).logits
    ids_t = torch.tensor([full])
    kinds = (ids_t == IMAGE_PAD).int() + 2 * (ids_t == VIDEO_PAD).int()
    _, h, w = video.frames[0].grid
    grid = torch.tensor([[3, h, w]])
    expected, delta = hf.model.get_rope_index(ids_t, kinds, torch.tensor([image.grid]), grid)
    assert torch.equal(layout.positions, expected[:, 0]) and layout.delta == int(delta)
    with torch.no_grad():
        ref = hf(
            input_ids=ids_t,
            pixel_values=image.pixels,
            image_grid_thw=torch.tensor([image.grid]),
            pixel_values_videos=torch.cat([f.pixels for f in video.frames]),
            video_grid_thw=grid,
            mm_token_type_ids=kinds,
        ).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_on_a_video_turn_equals_plain(
    vlm: tuple[Any, LoadedModel], method: str
) -> None:
    """n-gram, and the MTP head (which reads each patch's embeddings one row early): greedy
    output with speculation equals speculation off's on a video turn, drafts accepted."""
    _, lm = vlm
    video = lm.load_video(mp4(10, fps=2, seed=8))
    ids = video_ids(lm, video, "the cat sat on the mat. the cat sat on the")
    plain = run(lm, ids, list(video.frames), max_tokens=32)
    cfg = SpeculativeConfig(method=method, num_draft_tokens=4, adaptive=False)
    fast = run(lm, ids, list(video.frames), cfg, max_tokens=32)
    assert fast.output_ids == plain.output_ids and fast.spec.accepted > 0


def test_a_one_frame_video_is_refused_by_name(vlm: tuple[Any, LoadedModel]) -> None:
    from quickdraft.images import ImageError

    _, lm = vlm
    with pytest.raises(ImageError, match="at least 2 frames"):
        lm.load_video(mp4(1, seed=1))
