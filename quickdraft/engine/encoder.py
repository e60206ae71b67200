"""The image encoder of a vision-language target, on the engine's side: vision-tower outputs
kept by image content digest, and the `ImageRows` of a packed forward.

Stage: inside the step, before the target's forward (engine/spec_cycle.py). `fill` gives each
image of a request its placeholder rows' embeddings, from the cache when the same pixels were
encoded before (a later turn, another request), else from the tower; `image_rows` packs the
step's image rows and every row's M-RoPE position. An image's embeddings depend on its pixels
only (the tower encodes one image at a time), so a cached entry equals a fresh encoding bit for
bit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from quickdraft.images import ImageLayout
from quickdraft.models.base import ImageRows
from quickdraft.models.vision import VisionTower

ENCODER_CACHE_BYTES = 256 << 20  # embeddings kept by digest, least recently used dropped first


@dataclass(slots=True)
class EncoderStats:
    images: int = 0  # images handed to `fill`
    encoded: int = 0  # of those, run through the tower (the rest were cached)
    seconds: float = 0.0  # wall time in the tower
    bytes: int = 0  # embeddings held now


class ImageEncoder:
    def __init__(self, tower: VisionTower, budget: int = ENCODER_CACHE_BYTES) -> None:
        self.tower = tower
        self.budget = budget
        self.cache: OrderedDict[str, Tensor] = OrderedDict()  # digest -> [tokens, hidden]
        self.stats = EncoderStats()

    def fill(self, layout: ImageLayout) -> None:
        """Every span of `layout` without embeddings gets its image's (cached or encoded)."""
        for i, span in enumerate(layout.spans):
            if layout.embeds[i] is not None:
                continue
            digest = span.image.digest
            self.stats.images += 1
            embeds = self.cache.get(digest)
            if embeds is None:
                t0 = time.perf_counter()
                embeds = self.tower.encode(span.image.pixels, span.image.grid)
                self.stats.seconds += time.perf_counter() - t0
                self.stats.encoded += 1
                self._keep(digest, embeds)
            else:
                self.cache.move_to_end(digest)
            assert embeds.shape[0] == span.length
            layout.embeds[i] = embeds

    def _keep(self, digest: str, embeds: Tensor) -> None:
        if embeds.nbytes > self.budget:
            return
        self.cache[digest] = embeds
        self.stats.bytes += embeds.nbytes
        while self.stats.bytes > self.budget:
            _, dropped = self.cache.popitem(last=False)
            self.stats.bytes -= dropped.nbytes


def image_rows(
    layouts: Sequence[ImageLayout | None],
    starts: Sequence[int],  # per sequence: its first new row's index in the sequence
    num_new: Sequence[int],  # per sequence: its rows in the packed forward
    hidden: int,  # the target's hidden size
    device: torch.device,
) -> ImageRows | None:
    """The packed forward's image input, or None when no sequence of it has images (then
    every position is the plain one and the model runs as for text)."""
    if all(layout is None for layout in layouts):
        return None
    positions: list[Tensor] = []
    rows: list[Tensor] = []
    embeds: list[Tensor] = []
    row = 0
    for layout, start, n in zip(layouts, starts, num_new, strict=True):
        if layout is None:
            positions.append(torch.arange(start, start + n).expand(3, n))
        else:
            positions.append(layout.rows(start, n))
            for offset, emb in layout.image_rows(start, n):
                rows.append(torch.arange(row + offset, row + offset + emb.shape[0]))
                embeds.append(emb)
        row += n
    return ImageRows(
        torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long, device=device),
        torch.cat(embeds) if embeds else torch.zeros(0, hidden, device=device),
        torch.cat(positions, dim=1).to(device),
    )
