"""The image encoder of a vision-language model: vision-tower outputs kept by image content
digest.

Stage: inside the step, before the target's forward (engine/spec_cycle.py, which then packs the
step's image rows with images.py `pack_image_rows`), and before a draft model's forward when
the draft model is a vision-language model too (its own tower: speculation/drafters/
draft_model.py). `fill` gives each image of a request its
placeholder rows' embeddings, from the cache when the same pixels were encoded before (a later
turn, another request), else from the tower. An image's embeddings depend on its pixels only
(the tower encodes one image at a time), so a cached entry equals a fresh encoding bit for bit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

from quickdraft.images import ImageLayout
from quickdraft.models.families.vision import ImageTower

ENCODER_CACHE_BYTES = 256 << 20  # embeddings kept by digest, least recently used dropped first


@dataclass(slots=True)
class EncoderStats:
    images: int = 0  # images handed to `fill`
    encoded: int = 0  # of those, run through the tower (the rest were cached)
    seconds: float = 0.0  # wall time in the tower
    bytes: int = 0  # embeddings held now


class ImageEncoder:
    def __init__(self, tower: ImageTower, budget: int = ENCODER_CACHE_BYTES) -> None:
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
