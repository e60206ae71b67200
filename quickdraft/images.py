"""Image input, from bytes to what the target's forward reads: decoding (Pillow, bounded),
the Qwen2-VL / Qwen3.5 preprocessing (smart resize, rescale, normalize, patches in merge-block
order) and Gemma 4's (a resize to a budget of placeholder tokens, rescale, patches in raster
order), and a prompt's image layout (which token rows are an image's placeholders, and every
prompt row's multimodal RoPE position).

Stage: the input stage of a vision-language request, beside the tokenizer: the server decodes
and preprocesses (`load_image`), the prompt is tokenized with one placeholder per image and
`ImageLayout.build` expands each to the image's token count; the engine encodes each image once
(by content digest) and hands the forward `ImageRows` (models/base.py). The rules are
transformers' `Qwen2VLImageProcessorPil`, `Gemma4ImageProcessorPil`, `Gemma4Processor` and
`Qwen3_5Model.get_rope_index` (tests compare).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # decoded size refused above this (--max-image-pixels)
MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses longer images


class ImageError(ValueError):
    """An image that cannot be used; `param` names the request field (the HTTP edge's 400)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def fit_area(
    height: int, width: int, factor: int, lo: int, hi: int, frames: int = 1, tp: int = 1
) -> tuple[int, int]:
    """smart_resize's fit: both sides multiples of `factor`, the pixels of `frames` frames
    (rounded to temporal patches of `tp`; an image is one) within [lo, hi], the aspect ratio
    kept as closely as that allows."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / tp) * tp
    if t_bar * h_bar * w_bar > hi:
        beta = math.sqrt(frames * height * width / hi)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < lo:
        beta = math.sqrt(lo / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class ImageProcessing:
    """A checkpoint's preprocessing (preprocessor_config.json; Qwen3.5's values by default).
    `kind` is the tower family's (models/families/vision.py VisionConfig.kind): "gemma4" resizes to
    `max_soft_tokens` placeholders of merge x merge patches and lays patches out in raster
    order, (row, column, channel) within each; the Qwen families smart-resize and lay them
    out in merge-block order, (channel, time, row, column) within each."""

    kind: str = "qwen3_5"
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536  # size.shortest_edge
    max_pixels: int = 16777216  # size.longest_edge
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_soft_tokens: int = 0  # gemma4: the placeholder budget an image is resized to

    @classmethod
    def from_dir(cls, path: Path, kind: str = "qwen3_5") -> ImageProcessing:
        """preprocessor_config.json of `path`, what it leaves out as the `kind` family's
        (models/families/vision.py VisionConfig.kind) defaults."""
        file = path / "preprocessor_config.json"
        base = PROCESSING[kind]
        return cls.from_config(json.loads(file.read_text()), base) if file.is_file() else base

    @classmethod
    def from_config(
        cls, raw: dict[str, Any], base: ImageProcessing | None = None
    ) -> ImageProcessing:
        size = raw.get("size") or {}
        base = base or cls()
        if base.kind == "gemma4":
            plain = raw.get("do_normalize") is False  # Gemma 4's: rescaled only
            return cls(
                kind="gemma4",
                patch_size=int(raw.get("patch_size", base.patch_size)),
                temporal_patch_size=1,
                merge_size=int(raw.get("pooling_kernel_size", base.merge_size)),
                image_mean=(0.0, 0.0, 0.0) if plain else _three(raw.get("image_mean", (0,) * 3)),
                image_std=(1.0, 1.0, 1.0) if plain else _three(raw.get("image_std", (1,) * 3)),
                max_soft_tokens=int(raw.get("max_soft_tokens", base.max_soft_tokens)),
            )
        return cls(
            patch_size=int(raw.get("patch_size", base.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", base.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", base.merge_size)),
            min_pixels=int(size.get("shortest_edge", raw.get("min_pixels", base.min_pixels))),
            max_pixels=int(size.get("longest_edge", raw.get("max_pixels", base.max_pixels))),
            image_mean=_three(raw.get("image_mean", base.image_mean)),
            image_std=_three(raw.get("image_std", base.image_std)),
        )

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `smart_resize`: both sides multiples of patch x merge, the area within
        [min_pixels, max_pixels], the aspect ratio kept as closely as that allows (Gemma 4:
        `budget_resize`)."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ImageError(
                f"image aspect ratio {max(height, width) / min(height, width):.0f} is over "
                f"{MAX_ASPECT_RATIO}"
            )
        if self.kind == "gemma4":
            return self.budget_resize(height, width)
        return fit_area(height, width, factor, self.min_pixels, self.max_pixels)

    def budget_resize(self, height: int, width: int) -> tuple[int, int]:
        """Gemma 4's `get_aspect_ratio_preserving_size`: the largest size of the image's aspect
        ratio within `max_soft_tokens` x merge^2 patches, both sides multiples of patch x
        merge (a very long image keeps one placeholder row or column)."""
        side = self.patch_size * self.merge_size
        max_patches = self.max_soft_tokens * self.merge_size**2
        factor = math.sqrt(max_patches * self.patch_size**2 / (height * width))
        h_bar = math.floor(factor * height / side) * side
        w_bar = math.floor(factor * width / side) * side
        longest = (max_patches // self.merge_size**2) * side
        if h_bar == 0 and w_bar == 0:
            raise ImageError(f"image of {width} x {height} pixels resizes to nothing")
        if h_bar == 0:
            h_bar, w_bar = side, min(width // height * side, longest)
        elif w_bar == 0:
            h_bar, w_bar = min(height // width * side, longest), side
        return h_bar, w_bar


# each tower family's preprocessing, as its checkpoints' preprocessor_config.json gives it
PROCESSING = {
    "qwen3_5": ImageProcessing(),
    "qwen2_5_vl": ImageProcessing(  # Qwen2-VL's processor with CLIP's mean / std
        patch_size=14,
        min_pixels=3136,
        max_pixels=12845056,
        image_mean=(0.48145466, 0.4578275, 0.40821073),
        image_std=(0.26862954, 0.26130258, 0.27577711),
    ),
    "gemma4": ImageProcessing(  # Gemma4ImageProcessor's: rescale only, 280 placeholders
        kind="gemma4",
        patch_size=16,
        temporal_patch_size=1,
        merge_size=3,
        image_mean=(0.0, 0.0, 0.0),
        image_std=(1.0, 1.0, 1.0),
        max_soft_tokens=280,
    ),
}


def _three(values: Sequence[float]) -> tuple[float, float, float]:
    r, g, b = (float(v) for v in values)
    return r, g, b


@dataclass(frozen=True, slots=True, eq=False)
class ImageInput:
    """One preprocessed image: its patches, patch grid and content digest."""

    pixels: Tensor  # [t h w, channels * temporal * patch * patch] fp32, merge-block order
    grid: tuple[int, int, int]  # (t, h, w) in patches
    digest: str  # sha256 of the resized RGB pixels and their size: equal digest, equal pixels
    # M-RoPE time positions per temporal patch (a Qwen2.5-VL video's tokens a second x seconds
    # a patch; 1 for an image)
    time_interval: float = 1.0

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid
        return t * h * w // merge_size**2


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Bytes -> an RGB Pillow image; ImageError for bytes that are no image, or an image over
    `max_pixels` (checked from the header, before the pixels are decoded: a decompression bomb
    costs nothing)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(
                    f"image of {width} x {height} pixels is over the limit of {max_pixels} "
                    "(--max-image-pixels)"
                )
            image.load()
            return image.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"image refused as a decompression bomb: {e}") from None
    except (OSError, ValueError, SyntaxError) as e:  # PIL's ways of saying "not an image"
        raise ImageError(f"the image data is not a readable image ({e})") from None


def preprocess(image: Image.Image, proc: ImageProcessing) -> ImageInput:
    """Resize (bicubic, as the PIL processor), rescale to [0, 1], normalize, and cut into
    patches `[h w, C * temporal * p * p]` (a still image repeated over the temporal patch;
    Gemma 4: `[h w, p * p * C]` in raster order)."""
    height, width = proc.resized(image.height, image.width)
    rgb = image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
    raw = np.asarray(rgb, dtype=np.uint8)  # [H, W, C]
    digest = hashlib.sha256(raw.tobytes() + f"{height}x{width}".encode()).hexdigest()
    p = proc.patch_size
    gh, gw = height // p, width // p
    if proc.kind == "gemma4":  # rescaled in float64 as transformers' `rescale`, then fp32
        x = (raw.astype(np.float64) * (1 / 255)).astype(np.float32)
        if proc.image_mean != (0.0, 0.0, 0.0) or proc.image_std != (1.0, 1.0, 1.0):
            mean = np.asarray(proc.image_mean, dtype=np.float32)
            x = ((x - mean) / np.asarray(proc.image_std, dtype=np.float32)).astype(np.float32)
        x = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4)  # [gh, gw, p, p, C]
        pixels = torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, p * p * 3))
        return ImageInput(pixels, (1, gh, gw), digest)
    x = raw.astype(np.float32) * np.float32(1 / 255)
    mean = np.asarray(proc.image_mean, dtype=np.float32)
    std = np.asarray(proc.image_std, dtype=np.float32)
    x = ((x - mean) / std).transpose(2, 0, 1)  # [C, H, W]
    m, tp = proc.merge_size, proc.temporal_patch_size
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
    pixels = torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, 3 * tp * p * p))
    return ImageInput(pixels, (1, gh, gw), digest)


def load_image(
    data: bytes, proc: ImageProcessing, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> ImageInput:
    return preprocess(decode_image(data, max_pixels), proc)


@dataclass(frozen=True, slots=True)
class ImageRows:
    """The image input of one packed forward of a vision-language model (the target, or its
    MTP head): the packed rows whose embedding is an image's (vision-tower output) instead of
    the token embedding, and every row's multimodal RoPE position (t, h, w; the three equal
    for text). Built by `pack_image_rows` from each sequence's `ImageLayout`."""

    rows: Tensor  # [M] rows of the packed batch, long
    embeds: Tensor  # [M, hidden]
    positions: Tensor  # [3, num_tokens] long: every packed row's (t, h, w) position
    # [num_tokens] long, or None: every packed row's key end (exclusive, a position in its
    # sequence) where some image of this forward is seen both ways (Gemma 4's local layers:
    # an image row sees its whole image); a text row's is its position + 1
    ends: Tensor | None = None


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image's placeholder rows in a prompt: tokens [start, start + length)."""

    start: int
    length: int
    image: ImageInput


@dataclass(slots=True, eq=False)
class ImageLayout:
    """A prompt's images: their placeholder spans, every prompt row's M-RoPE position, and the
    offset of the rows after the prompt (position = index + delta, all three streams). The
    encoder output of each span is filled in by the engine (`embeds`, by span). `two_way`:
    an image's rows attend to each other both ways (Gemma 4's local layers), so a forward
    that runs some of them runs all of those after (`chunk`)."""

    spans: list[ImageSpan]
    positions: Tensor  # [3, prompt tokens] long
    delta: int  # max(position) + 1 - prompt tokens
    embeds: list[Tensor | None] = field(default_factory=list)  # per span [length, hidden]
    two_way: bool = False

    @classmethod
    def build(
        cls,
        prompt_ids: list[int],
        images: Sequence[ImageInput],
        image_token_id: int,
        merge_size: int,
        around: tuple[int, int] | None = None,
        mrope: bool = True,
        two_way: bool = False,
        video_token_id: int | None = None,
    ) -> tuple[list[int], ImageLayout]:
        """Expand each single `image_token_id` of `prompt_ids` (one per image, in order) into
        that image's placeholder count, between the ids `around` (Gemma 4's begin / end of
        image; the Qwen templates write theirs); returns the expanded ids and their layout.
        Without `mrope` every row's position is its index (all three streams); `around`
        goes without it. A video's frames are images here, each placeholder the
        `video_token_id` (expanded with that id; videos.py writes one per frame)."""
        assert around is None or not mrope, "begin / end ids around an image: no M-RoPE"
        marks = {image_token_id} if video_token_id is None else {image_token_id, video_token_id}
        slots = [i for i, t in enumerate(prompt_ids) if t in marks]
        if len(slots) != len(images):
            what = "image" if video_token_id is None else "image or video-frame"
            raise ImageError(
                f"the prompt has {len(slots)} {what} placeholders for {len(images)} images "
                "(the model's chat template places one per image part; one that does not "
                "handle image parts cannot take images)"
            )
        ids: list[int] = []
        spans: list[ImageSpan] = []
        streams: list[Tensor] = []
        pos, last = 0, 0
        for slot, image in zip(slots, images, strict=True):
            ids.extend(prompt_ids[last:slot])
            if around is not None:
                ids.append(around[0])
            text = slot - last + (around is not None)
            streams.append(torch.arange(pos, pos + text).expand(3, text))
            pos += text
            count = image.num_tokens(merge_size)
            spans.append(ImageSpan(len(ids), count, image))
            ids.extend([prompt_ids[slot]] * count)
            if around is not None:
                ids.append(around[1])
            if not mrope:
                streams.append(torch.arange(pos, len(ids)).expand(3, -1))
                pos = len(ids)
                last = slot + 1
                continue
            t, h, w = image.grid
            gh, gw = h // merge_size, w // merge_size
            times = (torch.arange(t) * image.time_interval).long()  # get_vision_position_ids
            tt, hh, ww = torch.meshgrid(times, torch.arange(gh), torch.arange(gw), indexing="ij")
            streams.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(gh, gw)
            last = slot + 1
        tail = len(prompt_ids) - last
        ids.extend(prompt_ids[last:])
        streams.append(torch.arange(pos, pos + tail).expand(3, tail))
        positions = torch.cat(streams, dim=1)
        delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
        return ids, cls(spans, positions, delta, [None] * len(spans), two_way)

    def chunk(self, start: int, rows: int) -> int:
        """Prompt rows a forward from row `start` runs, for a wish of `rows`: a two-way image
        that the wish would cut is left whole to the next forward (it starts after `start`)
        or finished in this one (it started at or before)."""
        end = start + rows
        for span in self.spans if self.two_way else ():
            if span.start < end < span.start + span.length:
                return (
                    span.start - start if span.start > start else span.start + span.length - start
                )
        return rows

    def rows(self, start: int, count: int) -> Tensor:
        """M-RoPE positions `[3, count]` of the sequence's rows [start, start + count): the
        prompt's table, then index + delta past the prompt (decode steps, drafts)."""
        prompt = self.positions.shape[1]
        inside = self.positions[:, start : min(start + count, prompt)]
        after = torch.arange(max(start, prompt), max(start + count, prompt)) + self.delta
        return torch.cat([inside, after.expand(3, -1)], dim=1)

    def image_rows(self, start: int, count: int) -> list[tuple[int, Tensor]]:
        """(offset within [start, start + count), embeddings) of every image row in that range,
        one entry per span it touches."""
        out = []
        for span, embeds in zip(self.spans, self.embeds, strict=True):
            lo, hi = max(start, span.start), min(start + count, span.start + span.length)
            if lo < hi:
                assert embeds is not None, "the engine encodes every image before its rows run"
                out.append((lo - start, embeds[lo - span.start : hi - span.start]))
        return out

    def keys(self, prompt_ids: list[int]) -> list[int]:
        """`prompt_ids` with each image row replaced by a negative id derived from its image's
        digest and its place in the image: the prefix cache's block keys."""
        keys = list(prompt_ids)
        for span in self.spans:
            base = int(span.image.digest[:16], 16) << 24  # 64 bits of digest, 24 of row
            for j in range(span.length):
                keys[span.start + j] = -1 - (base + j)
        return keys


def pack_image_rows(
    layouts: Sequence[ImageLayout | None],
    starts: Sequence[int],  # per sequence: the sequence index of its first row here
    num_new: Sequence[int],  # per sequence: its rows in the packed forward
    hidden: int,  # the model's hidden size
    device: torch.device,
    shift: int = 0,  # row i takes the embedding of token i + shift (1: an MTP head's rows)
) -> ImageRows | None:
    """A packed forward's image input, or None when no sequence of it has images (then every
    position is the plain one and the model runs as for text)."""
    if all(layout is None for layout in layouts):
        return None
    # key ends only where some image of the forward is seen both ways (not an MTP head's rows)
    two_way = not shift and any(layout is not None and layout.two_way for layout in layouts)
    positions: list[Tensor] = []
    rows: list[Tensor] = []
    embeds: list[Tensor] = []
    ends: list[Tensor] = []
    row = 0
    for layout, start, n in zip(layouts, starts, num_new, strict=True):
        if two_way:
            ends.append(torch.arange(start + 1, start + n + 1))
        if layout is None:
            positions.append(torch.arange(start, start + n).expand(3, n))
        else:
            positions.append(layout.rows(start, n))
            for offset, emb in layout.image_rows(start + shift, n):
                rows.append(torch.arange(row + offset, row + offset + emb.shape[0]))
                embeds.append(emb)
            if two_way and layout.two_way:
                _two_way_ends(layout, start, n, ends[-1])
        row += n
    return ImageRows(
        torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long, device=device),
        torch.cat(embeds).to(device) if embeds else torch.zeros(0, hidden, device=device),
        torch.cat(positions, dim=1).to(device),
        torch.cat(ends).to(device) if two_way else None,
    )


def _two_way_ends(layout: ImageLayout, start: int, n: int, end: Tensor) -> None:
    """`end` (the key ends of a sequence's rows [start, start + n)) past each image row's own
    position to its image's end: the image must run whole here (`ImageLayout.chunk`)."""
    for span in layout.spans:
        lo, hi = max(start, span.start), span.start + span.length
        if lo < min(hi, start + n):
            assert hi <= start + n, "a two-way image runs whole (ImageLayout.chunk)"
            end[lo - start : hi - start] = hi
