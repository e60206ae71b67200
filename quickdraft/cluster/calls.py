"""What crosses between the ingress and an engine replica (Ray pickles these).

Stage: the wire between quickdraft/cluster/ingress.py and replica.py. A request goes as one
`GenerateCall` carrying the speculation config the ingress holds for its model (so every
replica, replaced or new, runs what the admin page set); the replica answers with a stream:
a `Refusal`, or a `ReplicaStatus` (where it runs, the replica's load), then the request's
`RequestOutput`s, then a closing `ReplicaStatus`. `ModelInfo` is what the ingress needs to
validate and render requests without loading weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from quickdraft.config import SpeculativeConfig
from quickdraft.engine.prefix_cache import PrefixCacheStats
from quickdraft.image_encoder import EncoderStats
from quickdraft.images import ImageInput, ImageProcessing
from quickdraft.request import SamplingParams
from quickdraft.tokenizer import Tokenizer
from quickdraft.videos import VideoProcessing


@dataclass(frozen=True, slots=True)
class GenerateCall:
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    tenant: str
    route_key: str  # read by router.PrefixAffinityRouter; "" = no affinity
    spec: SpeculativeConfig
    images: tuple[ImageInput, ...] = ()  # one per image placeholder of prompt_ids


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    replica: str  # Ray Serve's replica id
    pid: int
    running: int
    waiting: int
    drafted: int  # over the replica's lifetime (all models)
    accepted: int
    prefix: dict[str, PrefixCacheStats | None] = field(default_factory=dict)
    encoder: dict[str, EncoderStats | None] = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """The replica's engine refused the request at submit."""

    kind: str  # "queue_full" | "engine_dead" | "invalid"
    message: str
    param: str | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: Path
    tokenizer: Tokenizer
    vocab_size: int
    context_length: int
    eos_ids: tuple[int, ...]
    spec: SpeculativeConfig
    device: str = "cpu"  # loading.device_name of where the replica runs it
    image_processing: ImageProcessing | None = None  # a vision-language model's preprocessing
    video_processing: VideoProcessing | None = None  # a model that takes video (Gemma 4)
