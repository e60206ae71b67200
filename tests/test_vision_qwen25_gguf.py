"""Qwen2.5-VL as llama.cpp runs it: the language model in a `qwen2vl` GGUF and the windowed
tower in a `qwen2.5vl_merger` mmproj, both written by the project's own writer from a tiny
random-weight transformers checkpoint (patch 14 and 112-pixel windows, llama.cpp's fixed
window: a 224 x 224 image is 4 windows). The pair loads and equals the Hugging Face path; on
Q8_0 weights speculation with an image equals speculation off; llama.cpp's mtmd (the peers
extra) picks the same greedy tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)
from test_vision_gguf import PROMPT, VISION_IDS, Pair, llama_cpp_greedy, write_pair
from vision_models import (
    IMAGE_PAD,
    hf_image_forward,
    image_forward,
    language_model_state,
    make_qwen25_vl_dir,
    png,
)

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.hub.gguf_write import window_pattern
from quickdraft.loading import load
from quickdraft.models.families.vision_qwen25 import Qwen25VisionTower
from quickdraft.models.formats.gguf_vision import load_mmproj
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation

pytestmark = pytest.mark.usefixtures("home")
SIDE = 224  # 16 x 16 patches of 14: 8 x 8 merged units, 2 x 2 windows of 4 x 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    tmp = tmp_path_factory.mktemp("qwen25vl-gguf")
    hf, hf_dir = make_qwen25_vl_dir(tmp / "hf", out_scale=0.1, patch=14, window=112)
    preprocessor = json.loads((hf_dir / "preprocessor_config.json").read_text())
    return write_pair(hf, hf_dir, tmp, "qwen2vl", language_model_state(hf), preprocessor)


def test_qwen25_mmproj_tower_equals_the_checkpoints(pair: Pair) -> None:
    """The F32 mmproj (q / k / v split, n_wa_pattern) gives the checkpoint's tower bit for
    bit; Q8_0 stays close."""
    hf_lm = load(str(pair.hf_dir), "fp32", progress=False)
    assert isinstance(hf_lm.vision, Qwen25VisionTower)
    image = hf_lm.load_image(png(3, SIDE, SIDE))
    assert image.grid == (1, 16, 16)
    expected = hf_lm.vision.encode(image.pixels, image.grid)
    tower, processing = load_mmproj(pair.mmproj, VISION_IDS, torch.float32)
    # the video fields are the model's, not the projector's: a GGUF target finds its video
    # token in the tokenizer and takes the released checkpoints' 2 time positions a second
    video = {"video_token_id": -1, "tokens_per_second": 2.0}
    assert tower.config == dataclasses.replace(hf_lm.vision.config, **video)
    assert processing.image_std == pytest.approx(hf_lm.image_processing.image_std)  # type: ignore[union-attr]
    assert torch.equal(tower.encode(image.pixels, image.grid), expected)
    q8, _ = load_mmproj(pair.mmproj_q8, VISION_IDS, torch.float32)
    got = q8.encode(image.pixels, image.grid)
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_window_pattern_is_llama_cpps() -> None:
    assert window_pattern([7, 15, 23, 31]) == 8
    with pytest.raises(ValueError, match="not every"):
        window_pattern([7, 15, 20])


def test_qwen25_gguf_logits_equal_transformers(pair: Pair) -> None:
    lm = load(str(pair.f32), "fp32", progress=False, mmproj=str(pair.mmproj))
    assert lm.model.config.mrope_section == (4, 6, 6)
    image = lm.load_image(png(2, SIDE, SIDE))
    out, ids, _, _ = image_forward(lm, PROMPT, image)
    ref = hf_image_forward(pair.hf, ids, image)
    assert (out.logits - ref.logits[0]).abs().max().item() < 1e-4


def test_qwen25_gguf_speculation_equals_plain(pair: Pair) -> None:
    """Q8_0 text weights run as they are (the GGUF kernels) with the Q8_0 mmproj's tower."""
    lm = load(str(pair.q8), "gguf", progress=False, mmproj=str(pair.mmproj_q8))
    cfg = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    accepted = 0
    for seed in (1, 2):
        outputs = []
        for spec in (None, make_speculation(lm, cfg)):
            image = lm.load_image(png(seed, SIDE, SIDE))
            req = lm.new_request(list(PROMPT), SamplingParams(max_tokens=48), images=[image])
            for _ in stream(lm, req, spec):
                pass
            outputs.append(req.output_ids)
            accepted += req.spec.accepted
        assert outputs[0] == outputs[1]
    assert accepted > 0


@pytest.mark.parametrize("seed", [5, 6])
def test_qwen25_greedy_tokens_equal_llama_cpp(pair: Pair, seed: int) -> None:
    """The independent oracle: llama.cpp's mtmd on the same F32 pair (its qwen2.5vl graph:
    windowed attention, M-RoPE sections) picks the same greedy tokens."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed"
    )
    ids, theirs = llama_cpp_greedy(llama_cpp, pair, png(seed, SIDE, SIDE), 16)
    assert ids.count(IMAGE_PAD) == 1
    lm = load(str(pair.f32), "fp32", progress=False, mmproj=str(pair.mmproj))
    image = lm.load_image(png(seed, SIDE, SIDE))
    req = lm.new_request(ids, SamplingParams(max_tokens=16, ignore_eos=True), images=[image])
    for _ in stream(lm, req, None):
        pass
    assert req.output_ids == theirs
