"""Video input, from bytes to what the image stage takes: decoding (PyAV, bounded), then each
family's sampling and preprocessing, as transformers does it (tests compare):

- Gemma 4 (`Gemma4VideoProcessor`, `Gemma4Processor.replace_video_token`): `num_frames`
  sampled uniformly, each frame resized to the video's placeholder budget and cut into patches
  as an image; the template's one video placeholder becomes "mm:ss <video>" per frame, joined
  by spaces, each placeholder then the frame's rows between begin / end of image. A video of
  fewer frames than the budget keeps all of them where transformers raises.
- Qwen2.5-VL (`Qwen2VLVideoProcessor` with frame sampling and the per-frame pixel cap,
  `get_rope_index`): `fps` frames a second, one grid of temporal patches of two frames; its one
  placeholder expands to the grid's rows and its time is in the M-RoPE positions
  (`ImageInput.time_interval`).
- Qwen3.5 (Qwen3VLVideoProcessor and Qwen3VLProcessor, which its checkpoints name): `fps`
  frames a second by linspace, one image of grid (1, h, w) per temporal patch, each behind its
  "<t.t seconds>" and begin / end of vision in the prompt.

Stage: the input stage, beside images.py: from here a frame (Gemma 4), a grid (Qwen2.5-VL) or a
temporal patch (Qwen3.5) is an image to the engine: encoded once by content digest,
prefix-cached by it, two-way where images are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from quickdraft.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    MAX_ASPECT_RATIO,
    ImageError,
    ImageInput,
    ImageProcessing,
    fit_area,
)

DEFAULT_MAX_VIDEO_FRAMES = 36_000  # decoded frames refused above this (20 minutes at 30 fps)
DEFAULT_FPS = 24.0  # transformers' when a stream does not say its rate
VIDEO_TOWERS = ("gemma4", "qwen2_5_vl", "qwen3_5")  # the vision towers that take video here


@dataclass(frozen=True, slots=True)
class VideoProcessing:
    """A checkpoint's video preprocessing (video_preprocessor_config.json, the family's
    defaults where it says nothing). Gemma 4 ("gemma4"): `num_frames` sampled uniformly, each
    frame an image of `frame.max_soft_tokens` placeholders with its timestamp in the prompt.
    Qwen2.5-VL ("qwen2_5_vl"): `fps` frames a second (`min_frames` .. `max_frames`, an even
    count), one grid of temporal patches of two frames, each frame resized within
    [frame.min_pixels, frame.max_pixels] capped by the video's token budget, times in M-RoPE.
    Qwen3.5 ("qwen3_5"): `fps` frames a second, all frames' pixels within those bounds with a
    per-frame cap, one image per temporal patch behind its time in the text."""

    kind: str
    frame: ImageProcessing
    placeholder: str  # the token text the template writes for a video
    token_id: int  # its id
    num_frames: int = 32  # gemma4
    normalize: bool = True  # do_normalize: rescale and normalize fused; False: rescale only
    fps: float = 2.0  # qwen2_5_vl
    min_frames: int = 4
    max_frames: int = 768
    max_video_tokens: int = 128_000  # the pixel cap's budget (0: no cap)
    tokens_per_second: float = 2.0  # M-RoPE time positions a second (the tower's config)
    around: tuple[str, str] = ("", "")  # qwen3_5: the begin / end of vision texts per patch

    @classmethod
    def from_dir(
        cls,
        path: Path,
        tower: str,
        image: ImageProcessing,
        placeholder: str,
        token_id: int,
        tokens_per_second: float = 2.0,
        around: tuple[str, str] = ("", ""),
    ) -> VideoProcessing:
        """The video processor of the checkpoint at `path` for a `tower` ("gemma4",
        "qwen2_5_vl", "qwen3_5"; VisionConfig.kind), the family's defaults where it has none and
        the image processor's patch size and merge (one tower)."""
        file = path / "video_preprocessor_config.json"
        raw = json.loads(file.read_text()) if file.is_file() else {}
        return cls.from_config(raw, tower, image, placeholder, token_id, tokens_per_second, around)

    @classmethod
    def from_config(
        cls,
        raw: dict[str, Any],
        tower: str,
        image: ImageProcessing,
        placeholder: str,
        token_id: int,
        tokens_per_second: float = 2.0,
        around: tuple[str, str] = ("", ""),
    ) -> VideoProcessing:
        def count(key: str, default: int) -> int:
            value = raw.get(key, default)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"video {key} must be a positive integer, got {value!r}")
            return value

        normalize = raw.get("do_normalize") is not False
        if tower == "gemma4":
            frame = ImageProcessing.from_config({"max_soft_tokens": 70, **raw}, image)
            return cls("gemma4", frame, placeholder, token_id, count("num_frames", 32), normalize)
        if tower not in ("qwen2_5_vl", "qwen3_5"):
            raise ValueError(f"video input is not built for {tower} towers")
        # the pixel bounds: a frame's (Qwen2VLVideoProcessor) or all frames' (Qwen3VL's)
        unit = image.patch_size * image.merge_size  # 28 and 32 in the releases
        size = raw.get("size") or {}
        bounds = {
            "min_pixels": size.get("shortest_edge", raw.get("min_pixels", 128 * unit * unit)),
            "max_pixels": size.get("longest_edge", raw.get("max_pixels", unit * unit * 768)),
        }
        frame = ImageProcessing.from_config({**raw, "size": {}, **bounds}, image)
        cap = raw.get("cap_pixels_per_frame", True) is not False
        budget = 128_000 if tower == "qwen2_5_vl" else 768  # the whole video's / a frame's tokens
        return cls(
            tower,
            frame,
            placeholder,
            token_id,
            normalize=normalize,
            fps=float(raw.get("fps", 2.0)),
            min_frames=count("min_frames", 4),
            max_frames=count("max_frames", 768),
            max_video_tokens=count("max_video_tokens", budget) if cap else 0,
            tokens_per_second=tokens_per_second,
            around=around,
        )

    def sample(self, total: int, fps: float) -> list[int]:
        """The frame indices this family samples from `total` frames at `fps`."""
        if self.kind == "gemma4":
            return sample_indices(total, self.num_frames)
        if self.kind == "qwen3_5":  # Qwen3VLVideoProcessor.sample_frames with fps
            n = min(max(int(total / fps * self.fps), self.min_frames), self.max_frames, total)
            return np.linspace(0, total - 1, n).round().astype(int).tolist()
        return qwen_indices(total, fps, self.fps, self.min_frames, self.max_frames, self.frame)

    def prompt_text(self, video: VideoInput) -> str:
        """What replaces the template's placeholder of `video`: Gemma 4 "mm:ss <video>" per
        frame joined by spaces; Qwen3.5 "<t.t seconds><|vision_start|><video><|vision_end|>"
        per temporal patch (Qwen3VLProcessor.replace_video_token); Qwen2.5-VL the placeholder
        (its time is in the positions). Each placeholder then expands to its rows."""
        ph = self.placeholder
        if self.kind == "gemma4":
            stamps = (f"{int(t // 60):02d}:{int(t % 60):02d}" for t in video.timestamps)
            return " ".join(f"{stamp} {ph}" for stamp in stamps)
        if self.kind == "qwen3_5":
            start, end = self.around
            return "".join(f"<{t:.1f} seconds>{start}{ph}{end}" for t in video.timestamps)
        return ph


@dataclass(frozen=True, slots=True, eq=False)
class VideoInput:
    """One preprocessed video: its sampled frames (each an image to the engine) and their times
    in seconds."""

    frames: tuple[ImageInput, ...]
    timestamps: tuple[float, ...]

    @property
    def digest(self) -> str:
        return hashlib.sha256("".join(f.digest for f in self.frames).encode()).hexdigest()


def expand_videos(rendered: str, videos: list[VideoInput], proc: VideoProcessing) -> str:
    """A rendered chat with the template's one placeholder per video replaced by that video's
    text (`VideoProcessing.prompt_text`); ImageError when the counts differ."""
    pieces = rendered.split(proc.placeholder)
    if len(pieces) - 1 != len(videos):
        raise ImageError(
            f"the chat template placed {len(pieces) - 1} video placeholders for {len(videos)} "
            "videos (a template that does not handle video parts cannot take them)"
        )
    out = [pieces[0]]
    for video, piece in zip(videos, pieces[1:], strict=True):
        out += [proc.prompt_text(video), piece]
    return "".join(out)


def sample_indices(total: int, num_frames: int) -> list[int]:
    """transformers' `default_sample_indices_fn`: `num_frames` indices spread uniformly over
    `total` frames (all of them when there are fewer)."""
    n = min(num_frames, total)
    return [i * total // n for i in range(n)]


def qwen_indices(
    total: int, fps: float, want_fps: float, min_frames: int, max_frames: int, proc: ImageProcessing
) -> list[int]:
    """Qwen2VLVideoProcessor.sample_frames with `fps`: `want_fps` frames a second of the
    stream's `fps`, at least `min_frames`, at most `max_frames` and the video's, a multiple of
    the temporal patch; frames at total / n steps. A video shorter than one temporal patch
    keeps its frames (transformers raises there; the last frame pads the patch)."""
    tp = proc.temporal_patch_size
    top = math.floor(min(max_frames, total) / tp) * tp
    n = min(max(total / fps * want_fps, min_frames), top, total)
    n = math.floor(n / tp) * tp
    if n < 1:
        return list(range(total))
    return torch.arange(0, total, total / n).int().tolist()


def decode_video(
    data: bytes,
    pick: Callable[[int, float], list[int]],  # (frames, frame rate) -> the indices to keep
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
) -> tuple[list[np.ndarray], list[int], float, int]:
    """Bytes -> the picked frames as RGB `[H, W, 3]` uint8, their indices, the stream's frame
    rate and its frame count; ImageError for bytes that are no video, a frame over
    `max_pixels` (checked from the stream header, before decoding) or a video of more than
    `max_frames` frames."""
    import av  # PyAV: FFmpeg's decoders

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ImageError("the video data has no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > max_pixels:
                raise ImageError(
                    f"video frames of {width} x {height} pixels are over the limit of "
                    f"{max_pixels} (--max-image-pixels)"
                )
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else DEFAULT_FPS
            total = stream.frames
            if total <= 0:  # the container does not say: count the decoded frames
                total = sum(1 for _ in _frames(container, max_frames))
                container.seek(0)
            if total > max_frames:
                raise ImageError(f"the video has {total} frames, over the limit of {max_frames}")
            wanted = pick(total, fps) if total else []
            picked: list[np.ndarray] = []
            kept: list[int] = []
            if wanted:
                want = set(wanted)
                for i, frame in enumerate(_frames(container, max_frames)):
                    if i in want:
                        picked.append(frame.to_ndarray(format="rgb24"))
                        kept.append(i)
                    if i >= wanted[-1]:
                        break
    except ImageError:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise ImageError(f"the video data is not a readable video ({exc})") from None
    if not picked:
        raise ImageError("the video has no frames")
    return picked, kept, fps, total


def _frames(container: Any, limit: int) -> Iterator[Any]:
    """The first video stream's decoded frames (PyAV's), refusing past `limit`."""
    for i, frame in enumerate(container.decode(video=0)):
        if i >= limit:
            raise ImageError(f"the video has more than {limit} frames, the limit")
        yield frame


def _resized(frames: Tensor, height: int, width: int) -> Tensor:
    """uint8 frames `[T, C, H, W]` resized as torchvision resizes a uint8 video on the CPU:
    torch's bicubic antialiased kernel on the uint8 values (up to 8 levels from the float
    path's result)."""
    if frames.shape[-2:] == (height, width):
        return frames
    return F.interpolate(
        frames, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )


def _normalized(raw: Tensor, video: VideoProcessing) -> Tensor:
    """uint8 `[..., C, H, W]` -> fp32 as transformers' torchvision backend: rescale and
    normalize fused into x - mean / (1 / 255) over std / (1 / 255), or the rescale's product
    alone without do_normalize."""
    proc = video.frame
    if not video.normalize:
        return raw * (1 / 255)  # uint8 x a float: fp32
    mean = torch.tensor(proc.image_mean) * (1.0 / (1 / 255))
    std = torch.tensor(proc.image_std) * (1.0 / (1 / 255))
    return (raw.to(torch.float32) - mean[:, None, None]) / std[:, None, None]


def _digest(raw: Tensor, extra: str = "") -> str:
    """sha256 of resized uint8 pixels `[..., C, H, W]`, their shape and `extra` (what else the
    rows' positions depend on: the prefix cache keys KV by it)."""
    shape = "x".join(map(str, raw.shape)) + extra
    return hashlib.sha256(raw.contiguous().numpy().tobytes() + shape.encode()).hexdigest()


def preprocess_frame(rgb: np.ndarray, video: VideoProcessing) -> ImageInput:
    """One Gemma 4 frame `[H, W, 3]` uint8 -> patches `[h w, p * p * C]` in raster order, as
    Gemma4VideoProcessor: resized to the frame budget, rescaled (normalized)."""
    proc = video.frame
    height, width = proc.resized(*rgb.shape[:2])
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None]  # [1, C, H, W]
    raw = _resized(x, height, width)[0]  # [C, H, W] uint8
    y = _normalized(raw, video)
    p = proc.patch_size
    gh, gw = height // p, width // p
    pixels = y.reshape(3, gh, p, gw, p).permute(1, 3, 2, 4, 0).reshape(gh * gw, p * p * 3)
    return ImageInput(pixels.contiguous(), (1, gh, gw), _digest(raw))


def preprocess_grid(
    frames: list[np.ndarray], video: VideoProcessing, interval: float
) -> ImageInput:
    """Qwen2.5-VL's sampled frames -> one grid `[t h w, C * tp * p * p]` in merge-block order,
    as Qwen2VLVideoProcessor: each frame smart-resized within the pixel bounds (the upper one
    capped so the video stays within `max_video_tokens`), normalized, the last frame repeated
    to fill the last temporal patch; `interval` is its M-RoPE time step per temporal patch."""
    proc = video.frame
    p, m, tp = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    bounds = proc
    if video.max_video_tokens:  # qwen-vl-utils' budget: 90 % of the tokens, spread over frames
        budget = int(video.max_video_tokens * (p * m) ** 2 * 0.9)
        top = max(min(proc.max_pixels, budget * tp // len(frames)), int(proc.min_pixels * 1.05))
        bounds = dataclasses.replace(proc, max_pixels=top)
    height, width = bounds.resized(*frames[0].shape[:2])
    x = torch.from_numpy(np.ascontiguousarray(np.stack(frames))).permute(0, 3, 1, 2)
    raw = _resized(x, height, width)  # [T, C, H, W] uint8
    y = _normalized(raw, video)
    if pad := -len(frames) % tp:
        y = torch.cat([y, y[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = y.shape[0] // tp, height // p, width // p
    y = y.view(gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixels = y.reshape(gt * gh * gw, 3 * tp * p * p).contiguous()
    return ImageInput(pixels, (gt, gh, gw), _digest(raw, f"/{interval!r}"), interval)


def video_size(
    frames: int, height: int, width: int, tp: int, factor: int, lo: int, hi: int
) -> tuple[int, int]:
    """Qwen3VL's smart_resize: sides multiples of `factor` (a side under it scaled up first),
    the frames' pixels (frames rounded to temporal patches) within [lo, hi], the aspect ratio
    kept as closely as that allows."""
    if frames < tp:
        raise ImageError(f"a video needs at least {tp} frames here, it has {frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"video aspect ratio {max(height, width) / min(height, width):.0f} is over "
            f"{MAX_ASPECT_RATIO}"
        )
    return fit_area(height, width, factor, lo, hi, frames, tp)


def preprocess_patches(
    frames: list[np.ndarray], indices: list[int], fps: float, video: VideoProcessing
) -> tuple[tuple[ImageInput, ...], tuple[float, ...]]:
    """Qwen3.5's sampled frames -> one image of grid (1, h, w) per temporal patch (its rows in
    merge-block order, as Qwen3VLVideoProcessor's patchify lays the grid out), and each patch's
    time: the mean of its two frames' (the last frame repeated to fill the last patch), as
    Qwen3VLProcessor's timestamps. Frames resized within the video's pixel bounds, the upper
    one capped at `max_video_tokens` a frame (qwen-vl-utils' cap)."""
    proc = video.frame
    p, m, tp = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    n, hi = len(frames), proc.max_pixels
    if video.max_video_tokens:
        cap = video.max_video_tokens * (p * m) ** 2  # a frame's pixels, then the frames'
        hi = max(min(cap, hi // n), int(proc.min_pixels * 1.05)) * n
    h0, w0 = frames[0].shape[:2]
    height, width = video_size(n, h0, w0, tp, p * m, proc.min_pixels, hi)
    x = torch.from_numpy(np.ascontiguousarray(np.stack(frames))).permute(0, 3, 1, 2)
    raw = _resized(x, height, width)  # [T, C, H, W] uint8
    y = _normalized(raw, video)
    stamps = list(indices) + [indices[-1]] * (-n % tp)
    if pad := -n % tp:
        y = torch.cat([y, y[-1:].expand(pad, -1, -1, -1)])
        raw = torch.cat([raw, raw[-1:].expand(pad, -1, -1, -1)])
    gh, gw = height // p, width // p
    patches, times = [], []
    for i in range(y.shape[0] // tp):
        part = y[i * tp : (i + 1) * tp].reshape(tp, 3, gh // m, m, p, gw // m, m, p)
        part = part.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(gh * gw, 3 * tp * p * p)
        digest = _digest(raw[i * tp : (i + 1) * tp])
        patches.append(ImageInput(part.contiguous(), (1, gh, gw), digest))
        pair = stamps[i * tp : (i + 1) * tp]
        times.append((pair[0] / fps + pair[-1] / fps) / 2)
    return tuple(patches), tuple(times)


def load_video(
    data: bytes,
    proc: VideoProcessing,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
) -> VideoInput:
    frames, indices, fps, total = decode_video(data, proc.sample, max_pixels, max_frames)
    if proc.kind == "gemma4":
        inputs = tuple(preprocess_frame(f, proc) for f in frames)
        return VideoInput(inputs, tuple(i / fps for i in indices))
    if proc.kind == "qwen3_5":
        return VideoInput(*preprocess_patches(frames, indices, fps, proc))
    # the M-RoPE time step of a temporal patch: tokens a second x seconds a patch, seconds a
    # patch = temporal patch / the sampled rate (transformers' second_per_grid_ts)
    sampled_fps = len(indices) / total * fps
    interval = proc.tokens_per_second * proc.frame.temporal_patch_size / sampled_fps
    return VideoInput((preprocess_grid(frames, proc, interval),), ())
