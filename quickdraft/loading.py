"""Load a model by name or path: the weights in their run-time layout, its tokenizer, its EOS ids.

Stage: what every entry point calls first (CLI, server, benchmarks, tests, the draft-model
drafter). `load` resolves the name through the hub (catalog name, Hugging Face directory or
.gguf file), builds the model, converts its GEMM operands to the layout the CPU kernels stream
(bf16 -> 16-row panels; or int8 / int4 for a draft model) and builds the kernels now rather
than inside a first request. Nothing here runs a step: the engine (quickdraft/engine/) does.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quickdraft import hub
from quickdraft.config import DEFAULT_DTYPE, GGUF_DTYPE, QUANTIZATIONS, parse_dtype
from quickdraft.grammar import Grammar, GrammarCompiler, Matcher
from quickdraft.hub.gguf_gemma4 import GEMMA4_VIDEO_TOKEN
from quickdraft.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageError,
    ImageInput,
    ImageLayout,
    ImageProcessing,
    load_image,
)
from quickdraft.kernels import kernels_available, panels_apply, prefetch
from quickdraft.models.base import LanguageModel
from quickdraft.models.families.gemma4_config import Gemma4Config
from quickdraft.models.families.vision import ImageTower, VisionConfig
from quickdraft.models.formats.gguf_gpu import runs_on_device
from quickdraft.models.formats.gguf_loader import is_gguf_dir
from quickdraft.models.formats.gguf_vision import QWEN_VIDEO_TOKEN, load_mmproj, placeholders
from quickdraft.models.formats.loader import load_model, load_vision
from quickdraft.models.formats.packed_copy import operands_of
from quickdraft.models.graphs import for_device
from quickdraft.models.registry import model_class, read_config
from quickdraft.request import Request, SamplingError, SamplingParams
from quickdraft.tokenizer import Tokenizer
from quickdraft.videos import VIDEO_TOWERS, VideoInput, VideoProcessing, load_video


class ContextLengthError(ValueError):
    """A request that cannot fit the model's context; `param` names what to shorten."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def context_room(context: int, prompt_tokens: int, max_tokens: int | None = None) -> int:
    """Output tokens a prompt of `prompt_tokens` leaves in a `context`; raises
    ContextLengthError when the prompt (param "prompt") or prompt + max_tokens (param
    "max_tokens") does not fit."""
    room = context - prompt_tokens
    if room < 1:
        raise ContextLengthError(
            f"the prompt has {prompt_tokens} tokens; the model context is {context} tokens",
            "prompt",
        )
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{prompt_tokens + max_tokens} exceeds the model context of {context} tokens",
            "max_tokens",
        )
    return room


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    dtype_name: str
    model: LanguageModel
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    vision: ImageTower | None = None  # a vision-language target's image encoder
    image_processing: ImageProcessing | None = None  # its preprocessing (with `vision`)
    video_processing: VideoProcessing | None = None  # a tower that takes video (videos.py)
    _grammars: GrammarCompiler | None = field(default=None, repr=False)
    _grammars_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def grammar_compiler(self) -> GrammarCompiler:
        """This model's grammar compiler, built on first use (it reads the whole vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                vocab = self.model.config.vocab_size
                self._grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_ids)
            return self._grammars

    def grammar_matcher(self, grammar: Grammar) -> Matcher:
        """A fresh matcher at the start of `grammar`; GrammarError if it does not compile."""
        return self.grammar_compiler().matcher(grammar)

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def device(self) -> str:
        return device_name(self.model.device)

    @property
    def image_token_ids(self) -> frozenset[int]:
        """Placeholder ids whose rows are image embeddings (lookup drafters never draft them)."""
        if self.vision is None:
            return frozenset()
        video = set() if self.video_processing is None else {self.video_processing.token_id}
        return frozenset({self.vision.config.image_token_id} | video)

    def load_image(self, data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageInput:
        """Image bytes -> this model's preprocessed input; ImageError for a text-only model,
        bytes that are no image, or an image over `max_pixels`."""
        if self.vision is None or self.image_processing is None:
            raise ImageError(f"model {self.name!r} takes no image input (text only)")
        return load_image(data, self.image_processing, max_pixels)

    def load_video(self, data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> VideoInput:
        """Video bytes -> this model's sampled, preprocessed frames; ImageError for a model
        that takes no video or bytes that are no video."""
        if self.video_processing is None:
            raise ImageError(f"model {self.name!r} takes no video input")
        return load_video(data, self.video_processing, max_pixels)

    def room(self, prompt_tokens: int, max_tokens: int | None = None) -> int:
        return context_room(self.context_length, prompt_tokens, max_tokens)

    def new_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str = "",
        tenant: str = "",
        images: Sequence[ImageInput] = (),
    ) -> Request:
        """`images`: one per image or video-frame placeholder id in `prompt_ids`, in order
        (each placeholder is expanded to its image's token count here)."""
        layout = None
        if images:
            if self.vision is None or self.image_processing is None:
                raise ImageError(f"model {self.name!r} takes no image input (text only)")
            vc, videos = self.vision.config, self.video_processing
            gemma = vc.kind == "gemma4"  # begin / end of image ids around, plain positions
            prompt_ids, layout = ImageLayout.build(
                prompt_ids,
                images,
                vc.image_token_id,
                vc.spatial_merge_size,
                around=(vc.vision_start_token_id, vc.vision_end_token_id) if gemma else None,
                mrope=not gemma,
                two_way=gemma and bool(getattr(self.model.config, "two_way_images", False)),
                video_token_id=None if videos is None else videos.token_id,
            )
        self.room(len(prompt_ids), params.max_tokens)
        vocab = self.model.config.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise SamplingError(f"logit_bias token ids must be < {vocab}", "logit_bias")
        if params.grammar is not None:
            self.grammar_compiler().compile(params.grammar)  # GrammarError: refused here
        return Request(prompt_ids, params, self.tokenizer, self.eos_ids, request_id, tenant, layout)


def _takes_images(cfg: Any, vision: VisionConfig) -> bool:
    """Whether a language model of config `cfg` reads a `vision` tower's rows: Gemma 4's
    decoder a Gemma 4 tower's; the Qwen families' (with M-RoPE) theirs."""
    if vision.kind == "gemma4":
        return isinstance(cfg, Gemma4Config)
    return bool(getattr(cfg, "mrope_section", ()))


def _vision_ids(
    tokenizer: Tokenizer, mmproj: str, texts: tuple[str, str, str]
) -> tuple[int, int, int]:
    """The target's ids of the mmproj's placeholder `texts` (image, begin, end)."""
    ids = [tokenizer.token_id(text) for text in texts]
    if None in ids:
        raise ValueError(
            f"--mmproj {mmproj}: the model's tokenizer lacks {texts}: not the vision-language "
            "model this projector belongs to"
        )
    a, b, c = (int(i) for i in ids if i is not None)
    return a, b, c


# a GGUF target's video placeholder by tower (Qwen2.5-VL and Qwen3.5 share theirs)
VIDEO_TOKENS = {"gemma4": GEMMA4_VIDEO_TOKEN}

DEVICES = ("auto", "cpu", "cuda")  # what --device takes ("cuda:N" too)


def resolve_device(name: str) -> torch.device:
    """--device -> the torch device: "auto" is the first CUDA GPU when torch sees one, else the
    CPU; "cuda" (or "cuda:N") without a GPU is an error that says why."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not re.fullmatch(r"cuda(:\d+)?", name):
        raise ValueError(f"device {name!r}: choose one of {', '.join(DEVICES)} (or cuda:N)")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda or "no CUDA"
            raise ValueError(
                f"device {name!r}: torch {torch.__version__} ({built}) sees no CUDA GPU; "
                "use --device cpu"
            )
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def _gguf_on_device(path: Path) -> bool:
    """Whether the model directory `path` is a GGUF whose formats run on a GPU."""
    if not is_gguf_dir(path):
        return False
    cfg = read_config(path)
    return runs_on_device(model_class(cfg.model_type), cfg)


def device_name(device: torch.device) -> str:
    """What /health, the admin page and the benchmarks call the device a model runs on."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def load(
    model: str,
    dtype: str = DEFAULT_DTYPE,
    device: str = "cpu",
    progress: bool = True,
    quantization: str = "none",
    mmproj: str | None = None,
) -> LoadedModel:
    """`quantization="gguf"`: the GGUF's own quantized weights (dtype "gguf"), for a model
    that is a GGUF; `"int8"` / `"int4"`: projection weights in 8 / 4 bits (half / 0.31x the
    bytes of bf16, so a memory-bound step runs up to 2-3x faster); dense models only, meant for
    draft models, whose precision only moves the acceptance rate. `device` ("auto", "cpu",
    "cuda"; see `resolve_device`): on a GPU a dense GGUF model keeps its own formats
    (kernels/triton_gguf.py; other GGUF families are dequantized to bf16 there) and a dense
    model runs behind models/graphs.py's GraphModel (CUDA graphs, static KV slots). `mmproj`:
    llama.cpp's multimodal projector file of a vision-language GGUF target
    (models/formats/gguf_vision.py); a Hugging Face directory brings its own vision tower."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: choose one of {QUANTIZATIONS}")
    where = resolve_device(device)
    if where.type != "cpu":
        if quantization not in ("none", "gguf"):
            raise ValueError(
                f"{quantization} weights run on the CPU kernels only; on {where} drop the "
                "quantization (the model runs in bf16 there)"
            )
        if quantization == "gguf" or dtype == GGUF_DTYPE:
            dtype, quantization = GGUF_DTYPE, "none"
            if not _gguf_on_device(hub.resolve(model, dtype, progress=progress)):
                dtype = "bf16"  # Gemma 3, MoE, hybrid: dequantized, as before
    if quantization == "gguf":  # the GGUF's own formats, whatever the caller's dtype
        dtype, quantization = GGUF_DTYPE, "none"
    path = hub.resolve(model, dtype, progress=progress)
    net = for_device(load_model(path, parse_dtype(dtype), where, quantization))
    if net.device.type == "cpu":
        # Build the C++ kernels (once per install, ~2 min on 2 cores) now, not inside the first
        # forward: there a server's first request waited for it, past its client's timeout.
        kernels_available()
    if quantization != "none":
        net.quantize_(quantization)
    elif panels_apply(net.dtype, net.device):
        net.pack_()  # bf16 on CPU: the layout the panel kernel streams
    if net.device.type == "cpu":
        prefetch.tune(operands_of(net))  # this host's distance, over this model's operands
    tokenizer = Tokenizer(path)
    eos = set(net.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    # the vision tower runs in fp32 with an fp32 target, else in bf16 (no GGUF kernels there)
    tower_dtype = torch.float32 if net.dtype == torch.float32 else torch.bfloat16
    vision: ImageTower | None
    processing: ImageProcessing | None
    if mmproj is not None:
        ids = _vision_ids(tokenizer, mmproj, placeholders(mmproj))
        vision, processing = load_mmproj(mmproj, ids, tower_dtype, where)
    else:
        vision = None if is_gguf_dir(path) else load_vision(path, tower_dtype, where)
        processing = None if vision is None else ImageProcessing.from_dir(path, vision.config.kind)
    videos = None
    if vision is not None and processing is not None:
        vc = vision.config
        video_id = vc.video_token_id
        if mmproj is not None:  # a projector names no video token: the GGUF tokenizer's entry
            found = tokenizer.token_id(VIDEO_TOKENS.get(vc.kind, QWEN_VIDEO_TOKEN))
            video_id = -1 if found is None else found
        placeholder = tokenizer.vocab_entry(video_id) if video_id >= 0 else None
        if placeholder is not None and vc.kind in VIDEO_TOWERS:  # else: images only
            around = (
                tokenizer.vocab_entry(vc.vision_start_token_id) or "",
                tokenizer.vocab_entry(vc.vision_end_token_id) or "",
            )
            videos = VideoProcessing.from_dir(
                path, vc.kind, processing, placeholder, video_id, vc.tokens_per_second, around
            )
    if vision is not None and not _takes_images(net.config, vision.config):
        raise ValueError(
            f"{model}: {net.config.model_type} takes no image input from a "
            f"{vision.config.kind} vision tower"
        )
    if vision is not None and vision.config.out_hidden_size != net.config.hidden_size:
        raise ValueError(
            f"{model}: the vision tower's output ({vision.config.out_hidden_size} wide) does "
            f"not fit the language model ({net.config.hidden_size}): a projector of another model"
        )
    eos_ids = tuple(sorted(eos))
    return LoadedModel(model, path, dtype, net, tokenizer, eos_ids, vision, processing, videos)
