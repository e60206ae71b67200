"""Video input (Gemma 4), from bytes to frames the image stage takes: decoding (PyAV, bounded),
transformers' uniform frame sampling and timestamps, each sampled frame resized to the video's
placeholder budget and cut into patches as an image, and the prompt text a video stands for.

Stage: the input stage, beside images.py. A video becomes its frames' `ImageInput`s and a
text that replaces the chat template's one video placeholder: per frame "mm:ss <video>",
joined by spaces, whose single placeholder `ImageLayout.build` expands to the frame's rows
between begin / end of image, as `Gemma4Processor.replace_video_token` writes it. From there a
frame is an image to the engine (encoded once by content digest, prefix-cached by it, two-way
in Gemma 4's local layers). The rules are transformers' `Gemma4VideoProcessor`,
`default_sample_indices_fn` and `read_video_pyav` (tests compare), with one difference: a video
of fewer frames than the budget keeps all of them where transformers raises.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from quickdraft.images import DEFAULT_MAX_IMAGE_PIXELS, ImageError, ImageInput, ImageProcessing

DEFAULT_MAX_VIDEO_FRAMES = 36_000  # decoded frames refused above this (20 minutes at 30 fps)
DEFAULT_FPS = 24.0  # transformers' when a stream does not say its rate


@dataclass(frozen=True, slots=True)
class VideoProcessing:
    """A checkpoint's video preprocessing (video_preprocessor_config.json; Gemma4VideoProcessor's
    defaults): `num_frames` sampled uniformly, each resized to `frame.max_soft_tokens`
    placeholders and rescaled as `frame` says."""

    frame: ImageProcessing
    placeholder: str  # the token text the template writes for a video, and the prompt per frame
    num_frames: int = 32
    normalize: bool = True  # do_normalize: rescale and normalize fused; False: rescale only

    @classmethod
    def from_dir(cls, path: Path, image: ImageProcessing, placeholder: str) -> VideoProcessing:
        """The video processor of the checkpoint at `path` (defaults where it has none: the
        image processor's patch size and pooling, one tower, and 70 placeholders a frame)."""
        file = path / "video_preprocessor_config.json"
        raw = json.loads(file.read_text()) if file.is_file() else {}
        return cls.from_config(raw, image, placeholder)

    @classmethod
    def from_config(
        cls, raw: dict[str, Any], image: ImageProcessing, placeholder: str
    ) -> VideoProcessing:
        frame = ImageProcessing.from_config({"max_soft_tokens": 70, **raw}, image)
        frames = raw.get("num_frames", 32)
        if not isinstance(frames, int) or frames < 1:
            raise ValueError(f"video num_frames must be a positive integer, got {frames!r}")
        return cls(frame, placeholder, frames, raw.get("do_normalize") is not False)


@dataclass(frozen=True, slots=True, eq=False)
class VideoInput:
    """One preprocessed video: its sampled frames (each an image to the engine) and their times
    in seconds."""

    frames: tuple[ImageInput, ...]
    timestamps: tuple[float, ...]

    def prompt_text(self, placeholder: str) -> str:
        """What replaces the template's video placeholder: "mm:ss <placeholder>" per frame,
        joined by spaces (each placeholder then expands to its frame's rows)."""
        return " ".join(
            f"{int(t // 60):02d}:{int(t % 60):02d} {placeholder}" for t in self.timestamps
        )

    @property
    def digest(self) -> str:
        return hashlib.sha256("".join(f.digest for f in self.frames).encode()).hexdigest()


def expand_videos(rendered: str, videos: list[VideoInput], placeholder: str) -> str:
    """A rendered chat with the template's one `placeholder` per video replaced by that video's
    frames' text (`VideoInput.prompt_text`); ImageError when the counts differ."""
    pieces = rendered.split(placeholder)
    if len(pieces) - 1 != len(videos):
        raise ImageError(
            f"the chat template placed {len(pieces) - 1} video placeholders for {len(videos)} "
            "videos (a template that does not handle video parts cannot take them)"
        )
    out = [pieces[0]]
    for video, piece in zip(videos, pieces[1:], strict=True):
        out += [video.prompt_text(placeholder), piece]
    return "".join(out)


def sample_indices(total: int, num_frames: int) -> list[int]:
    """transformers' `default_sample_indices_fn`: `num_frames` indices spread uniformly over
    `total` frames (all of them when there are fewer)."""
    n = min(num_frames, total)
    return [i * total // n for i in range(n)]


def decode_video(
    data: bytes,
    num_frames: int,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
) -> tuple[list[np.ndarray], list[int], float]:
    """Bytes -> the sampled frames as RGB `[H, W, 3]` uint8, their indices and the stream's
    frame rate; ImageError for bytes that are no video, a frame over `max_pixels` (checked from
    the stream header, before decoding) or a video of more than `max_frames` frames."""
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
            wanted = sample_indices(total, num_frames) if total else []
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
    return picked, kept, fps


def _frames(container: Any, limit: int) -> Iterator[Any]:
    """The first video stream's decoded frames (PyAV's), refusing past `limit`."""
    for i, frame in enumerate(container.decode(video=0)):
        if i >= limit:
            raise ImageError(f"the video has more than {limit} frames, the limit")
        yield frame


def preprocess_frame(rgb: np.ndarray, video: VideoProcessing) -> ImageInput:
    """One frame `[H, W, 3]` uint8 -> patches `[h w, p * p * C]` in raster order, as
    Gemma4VideoProcessor: torchvision's resize of a uint8 video on the CPU (bicubic with
    antialias, on the uint8 values), then rescale and normalize fused into one division (or,
    without do_normalize, the rescale's product)."""
    proc = video.frame
    h0, w0 = rgb.shape[:2]
    height, width = proc.resized(h0, w0)
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None]  # [1, C, H, W]
    if (height, width) != (h0, w0):
        x = F.interpolate(
            x, size=[height, width], mode="bicubic", align_corners=False, antialias=True
        )
    raw = x[0]  # [C, H, W] uint8
    digest = hashlib.sha256(
        raw.permute(1, 2, 0).contiguous().numpy().tobytes() + f"{height}x{width}".encode()
    ).hexdigest()
    if video.normalize:  # transformers fuses the rescale into mean and std: x / (std / (1 / 255))
        mean = torch.tensor(proc.image_mean) * (1.0 / (1 / 255))
        std = torch.tensor(proc.image_std) * (1.0 / (1 / 255))
        y = (raw.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
    else:
        y = raw * (1 / 255)  # uint8 x a float: fp32
    p = proc.patch_size
    gh, gw = height // p, width // p
    pixels = y.reshape(3, gh, p, gw, p).permute(1, 3, 2, 4, 0).reshape(gh * gw, p * p * 3)
    return ImageInput(pixels.contiguous(), (1, gh, gw), digest)


def load_video(
    data: bytes,
    proc: VideoProcessing,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
) -> VideoInput:
    frames, indices, fps = decode_video(data, proc.num_frames, max_pixels, max_frames)
    inputs = tuple(preprocess_frame(f, proc) for f in frames)
    return VideoInput(inputs, tuple(i / fps for i in indices))
