"""Image and video parts of a chat request, from URL to preprocessed input, under the
operator's policy.

Stage: the HTTP edge, before tokenization. An `image_url` / `video_url` part's URL is read as
  data:image/...;base64,...   always (the bytes are in the request, bounded by its body limit;
  data:video/...;base64,...   a video's type video/...)
  http(s)://host/...          only when the host is in `--allowed-media-domains` (or a
                              subdomain of one), with a time and a size limit, no redirects
  file:///path                only under `--allowed-local-media-path`
and anything else is refused: a server that fetched any URL a client named would be a proxy
into the operator's network (SSRF), and one that read any path would hand out its files. The
bytes are decoded and preprocessed by images.py / videos.py (size-capped before the pixels are
decoded). Every refusal is an `APIError` 400 naming the part
(`messages[i].content[j].image_url`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from quickdraft.images import DEFAULT_MAX_IMAGE_PIXELS, ImageError, ImageInput, ImageProcessing
from quickdraft.images import load_image as preprocess_bytes
from quickdraft.server.protocol import APIError
from quickdraft.videos import DEFAULT_MAX_VIDEO_FRAMES, VideoInput, VideoProcessing, load_video

DEFAULT_IMAGES_PER_PROMPT = 8
DEFAULT_VIDEOS_PER_PROMPT = 1  # a video is many images' rows (Gemma 4: 32 frames of 70)
_DATA_URL = re.compile(
    r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*),(?P<data>.*)", re.S
)


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """What the operator lets a request's images be (`quickdraft serve` flags)."""

    allowed_domains: tuple[str, ...] = ()  # --allowed-media-domains; () = no remote fetch
    allowed_local_path: Path | None = None  # --allowed-local-media-path; None = no file://
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # --max-image-pixels (decoded size)
    images_per_prompt: int = DEFAULT_IMAGES_PER_PROMPT  # --limit-images-per-prompt
    videos_per_prompt: int = DEFAULT_VIDEOS_PER_PROMPT  # --limit-videos-per-prompt
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES  # a longer video is refused
    fetch_timeout_s: float = 10.0
    max_fetch_bytes: int = 20 << 20  # an image's
    max_video_bytes: int = 200 << 20

    def __post_init__(self) -> None:
        if self.images_per_prompt < 0:
            raise ValueError(f"images per prompt must be >= 0, got {self.images_per_prompt}")
        if self.videos_per_prompt < 0:
            raise ValueError(f"videos per prompt must be >= 0, got {self.videos_per_prompt}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max image pixels must be >= 1, got {self.max_image_pixels}")

    def allows_host(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)


def _refused(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


async def read_media(
    parts: list[tuple[str, str, str]],  # (param, "image" or "video", url), in prompt order
    images: ImageProcessing | None,  # the model's preprocessing; None: a text-only model
    videos: VideoProcessing | None,  # None: a model that takes no video
    policy: MediaPolicy,
    model: str,
) -> list[ImageInput | VideoInput]:
    """The request's images and videos, preprocessed for the model, in prompt order, or an
    APIError 400 for the first one that cannot be had."""
    for kind, limit, flag in (
        ("image", policy.images_per_prompt, "--limit-images-per-prompt"),
        ("video", policy.videos_per_prompt, "--limit-videos-per-prompt"),
    ):
        mine = [param for param, k, _ in parts if k == kind]
        if mine and (images if kind == "image" else videos) is None:
            takes = "text only" if images is None else "images, no video"
            raise _refused(mine[0], f"model {model!r} takes no {kind} input ({takes})")
        if len(mine) > limit:
            raise _refused(
                mine[limit],
                f"{len(mine)} {kind}s in the request; this server takes at most {limit} ({flag})",
            )
    out: list[ImageInput | VideoInput] = []
    for param, kind, url in parts:
        data = await _bytes(url, policy, param, kind)
        try:  # decoding and resizing off the event loop
            if kind == "video":
                assert videos is not None
                out.append(
                    await asyncio.to_thread(
                        load_video, data, videos, policy.max_image_pixels, policy.max_video_frames
                    )
                )
            else:
                assert images is not None
                out.append(
                    await asyncio.to_thread(preprocess_bytes, data, images, policy.max_image_pixels)
                )
        except ImageError as exc:
            raise _refused(param, str(exc)) from None
    return out


async def _bytes(url: str, policy: MediaPolicy, param: str, kind: str) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    limit = policy.max_video_bytes if kind == "video" else policy.max_fetch_bytes
    if scheme == "data":
        return _data_url(url, param, kind)
    if scheme in ("http", "https"):
        return await _fetch(url, policy, param, kind, limit)
    if scheme == "file":
        return await asyncio.to_thread(_local_file, url, policy, param, kind, limit)
    raise _refused(param, f"{kind}_url must be a data:, http(s): or file: URL")


def _data_url(url: str, param: str, kind: str) -> bytes:
    m = _DATA_URL.fullmatch(url)
    if m is None or ";base64" not in m["params"].lower():
        raise _refused(param, f"a data: {kind} URL must be base64 (data:{kind}/...;base64,...)")
    mime = (m["mime"] or "").lower()
    if mime and not mime.startswith(f"{kind}/"):
        raise _refused(param, f"a data: URL of type {mime!r} is not {_a(kind)}")
    try:
        return base64.b64decode(m["data"].strip(), validate=True)
    except (binascii.Error, ValueError):
        raise _refused(param, "the data: URL's base64 is malformed") from None


def _a(kind: str) -> str:
    return f"an {kind}" if kind == "image" else f"a {kind}"


async def _fetch(url: str, policy: MediaPolicy, param: str, kind: str, limit: int) -> bytes:
    host = urlsplit(url).hostname or ""
    if not policy.allows_host(host):
        raise _refused(
            param,
            f"fetching {kind}s from {host!r} is not allowed on this server "
            "(the operator lists the domains it may fetch from: --allowed-media-domains)",
        )
    try:
        async with (
            httpx.AsyncClient(timeout=policy.fetch_timeout_s, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise _refused(param, f"fetching the {kind} gave HTTP {response.status_code}")
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    raise _refused(param, f"the {kind} at the URL is over {limit} bytes")
            return bytes(data)
    except httpx.HTTPError as exc:
        raise _refused(param, f"cannot fetch the {kind}: {type(exc).__name__}") from None


def _local_file(url: str, policy: MediaPolicy, param: str, kind: str, limit: int) -> bytes:
    root = policy.allowed_local_path
    if root is None:
        raise _refused(
            param,
            f"reading local {kind} files is not allowed on this server "
            "(--allowed-local-media-path)",
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _refused(param, "a file: URL must name a local path (file:///...)")
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(root.resolve()):
        raise _refused(param, f"the {kind} path is outside --allowed-local-media-path")
    try:
        size = path.stat().st_size
        if size > limit:
            raise _refused(param, f"the {kind} file is over {limit} bytes")
        return path.read_bytes()
    except OSError:
        raise _refused(param, f"the {kind} file cannot be read") from None
