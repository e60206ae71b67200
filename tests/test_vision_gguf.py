"""A Qwen3.5 vision-language model as llama.cpp runs it: the text model in a GGUF and the vision
tower in an mmproj GGUF (models/formats/gguf_vision.py), both written by the project's own writer
(hub/gguf_write.py) from a tiny random-weight transformers checkpoint. The pair loads and equals the
Hugging Face path (tower, logits over an image prompt), and on the GGUF's own quantized weights
speculation with images in the prompt equals speculation off."""

from __future__ import annotations

import ctypes
import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hybrid_models import copying_head, one_thread  # noqa: F401 (autouse fixture)
from PIL import Image
from vision_models import (
    IMAGE_PAD,
    PREPROCESSOR,
    hf_image_forward,
    image_forward,
    language_model_state,
    make_vlm_dir,
    png,
)

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import stream
from quickdraft.hub.gguf_write import llama_cpp_tensors, write_gguf, write_mmproj
from quickdraft.loading import load
from quickdraft.models.families.qwen3_next import HybridLM
from quickdraft.models.formats.gguf_vision import MMProjError, load_mmproj
from quickdraft.models.formats.loader import load_model
from quickdraft.request import SamplingParams
from quickdraft.speculation.factory import make_speculation

pytestmark = pytest.mark.usefixtures("home")  # models convert into a throw-away QUICKDRAFT_HOME
# the GGUF tokenizer's specials from id 257: the vision ones land on the checkpoint's ids
SPECIALS = (
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|im_end|>",
)
VISION_IDS = (IMAGE_PAD, 260, 261)
PROMPT = [5, 17, 42, 260, IMAGE_PAD, 261, 99, 3, 250, 11]  # text, one image, text


@dataclass
class Pair:
    hf: Any  # transformers' Qwen3_5ForConditionalGeneration (fp32)
    hf_dir: Path
    f32: Path  # the text model
    q8: Path
    mmproj: Path  # the vision tower, F32
    mmproj_q8: Path


def write_pair(
    hf: Any,
    hf_dir: Path,
    tmp: Path,
    arch: str,
    text: dict[str, torch.Tensor],  # the language model's tensors, as a text checkpoint names them
    preprocessor: dict[str, Any],
) -> Pair:
    """The GGUF + mmproj files of the checkpoint at `hf_dir` (its model `hf`): the text model
    as llama.cpp's `arch` in F32 and Q8_0, the tower in F32 and Q8_0."""
    config = json.loads((hf_dir / "config.json").read_text())
    text_cfg = config["text_config"]
    state = dict(hf.state_dict())
    tensors = llama_cpp_tensors(text, arch, text_cfg)

    def lm_file(name: str, qtype: str) -> Path:
        return write_gguf(tmp / name, arch, text_cfg, tensors, qtype, SPECIALS)

    return Pair(
        hf,
        hf_dir,
        lm_file("lm-f32.gguf", "F32"),
        lm_file("lm-q8_0.gguf", "Q8_0"),
        write_mmproj(tmp / "mmproj-f32.gguf", config, preprocessor, state),
        write_mmproj(tmp / "mmproj-q8_0.gguf", config, preprocessor, state, "Q8_0"),
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    tmp = tmp_path_factory.mktemp("vlm-gguf")
    hf, hf_dir = make_vlm_dir(tmp / "hf", out_scale=0.1)
    ours = load_model(hf_dir, torch.float32)
    assert isinstance(ours, HybridLM)
    mtp = {f"mtp.{k}": v for k, v in copying_head(ours).state_dict().items()}
    return write_pair(hf, hf_dir, tmp, "qwen35", language_model_state(hf) | mtp, PREPROCESSOR)


def test_mmproj_tower_equals_the_checkpoints(pair: Pair) -> None:
    """The F32 mmproj's tower gives the checkpoint's tower bit for bit; Q8_0 stays close."""
    hf_lm = load(str(pair.hf_dir), "fp32", progress=False)
    assert hf_lm.vision is not None
    image = hf_lm.load_image(png(3))
    expected = hf_lm.vision.encode(image.pixels, image.grid)
    tower, processing = load_mmproj(pair.mmproj, VISION_IDS, torch.float32)
    # the video token is the model's, not the projector's (a GGUF target's tokenizer has it)
    assert tower.config == dataclasses.replace(hf_lm.vision.config, video_token_id=-1)
    assert (processing.patch_size, processing.merge_size) == (4, 2)
    assert processing.image_mean == hf_lm.image_processing.image_mean  # type: ignore[union-attr]
    assert torch.equal(tower.encode(image.pixels, image.grid), expected)
    q8, _ = load_mmproj(pair.mmproj_q8, VISION_IDS, torch.float32)
    got = q8.encode(image.pixels, image.grid)
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_gguf_vlm_logits_equal_transformers(pair: Pair) -> None:
    """The F32 pair, dequantized to fp32: logits over an image prompt as transformers'."""
    lm = load(str(pair.f32), "fp32", progress=False, mmproj=str(pair.mmproj))
    assert lm.image_token_ids == {IMAGE_PAD}
    image = lm.load_image(png(2))  # 32 x 32 pixels: a size both preprocessings keep
    out, ids, _, _ = image_forward(lm, PROMPT, image)
    ref = hf_image_forward(pair.hf, ids, image)
    assert (out.logits - ref.logits[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_gguf_vlm_speculation_equals_plain(pair: Pair, method: str) -> None:
    """Q8_0 text weights run as they are (the GGUF kernels) with the Q8_0 mmproj's tower:
    with an image in the prompt, speculation on equals off, drafts accepted."""
    lm = load(str(pair.q8), "gguf", progress=False, mmproj=str(pair.mmproj_q8))
    cfg = SpeculativeConfig(method=method, num_draft_tokens=4, adaptive=False)
    accepted = 0
    for seed in (1, 2):
        outputs = []
        for spec in (None, make_speculation(lm, cfg)):
            image = lm.load_image(png(seed))
            req = lm.new_request(list(PROMPT), SamplingParams(max_tokens=48), images=[image])
            for _ in stream(lm, req, spec):
                pass
            outputs.append(req.output_ids)
            accepted += req.spec.accepted
        assert outputs[0] == outputs[1]
    assert accepted > 0


def test_mmproj_refuses_what_it_cannot_run(pair: Pair, tmp_path: Path) -> None:
    with pytest.raises(MMProjError, match="not a readable GGUF"):
        load_mmproj(pair.hf_dir / "config.json", VISION_IDS)
    with pytest.raises(MMProjError, match="projector"):
        load_mmproj(pair.f32, VISION_IDS)  # a text model, not a projector
    # a target whose tokenizer has no vision tokens: not a Qwen3.5 vision-language model
    text_cfg = json.loads((pair.hf_dir / "config.json").read_text())["text_config"]
    state = {n: t for n, t in load_model(pair.hf_dir, torch.float32).state_dict().items()}
    plain = write_gguf(
        tmp_path / "text.gguf", "qwen35", text_cfg, llama_cpp_tensors(state, "qwen35", text_cfg)
    )
    with pytest.raises(ValueError, match="tokenizer lacks"):
        load(str(plain), "fp32", progress=False, mmproj=str(pair.mmproj))


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed"
    )


def llama_cpp_greedy(
    llama_cpp: Any, pair: Pair, image: bytes, tokens: int
) -> tuple[list[int], list[int]]:
    """llama.cpp's multimodal library (mtmd) on the F32 pair: the prompt "ab<image>cd" as it
    tokenizes it (the image as one placeholder id here), then its greedy tokens."""
    from llama_cpp import mtmd_cpp as mtmd

    llm = llama_cpp.Llama(model_path=str(pair.f32), n_ctx=256, n_threads=2, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.print_timings, params.n_threads = False, False, 2
    ctx = mtmd.mtmd_init_from_file(str(pair.mmproj).encode(), llm._model.model, params)
    assert ctx, "llama.cpp could not load the mmproj file"
    rgb = np.asarray(Image.open(io.BytesIO(image)).convert("RGB"), dtype=np.uint8)
    bitmap = mtmd.mtmd_bitmap_init(
        rgb.shape[1], rgb.shape[0], (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes())
    )
    text = mtmd.mtmd_input_text()
    text.text = body = b"ab" + mtmd.mtmd_default_marker() + b"cd"
    text.text_len, text.add_special, text.parse_special = len(body), False, True
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    try:
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        ids: list[int] = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                ids.append(IMAGE_PAD)
                continue
            n = ctypes.c_size_t()
            p = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            ids += [p[j] for j in range(n.value)]
        n_past = llama_cpp.llama_pos(0)
        lctx = llm._ctx.ctx
        assert (
            mtmd.mtmd_helper_eval_chunks(
                ctx, lctx, chunks, 0, 0, llm.n_batch, True, ctypes.byref(n_past)
            )
            == 0
        )
        out, pos = [], n_past.value
        for _ in range(tokens):
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(lctx, -1), shape=(llm.n_vocab(),)
            )
            out.append(int(logits.argmax()))
            batch = llama_cpp.llama_batch_init(1, 0, 1)
            batch.n_tokens, batch.token[0], batch.pos[0] = 1, out[-1], pos
            batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 0, 1
            assert llama_cpp.llama_decode(lctx, batch) == 0
            llama_cpp.llama_batch_free(batch)
            pos += 1
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(ctx)
    return ids, out


@pytest.mark.parametrize("seed", [5, 6])
def test_greedy_tokens_equal_llama_cpp_with_an_image(pair: Pair, llama_cpp: Any, seed: int) -> None:
    """The independent oracle: llama.cpp's mtmd runs the same F32 GGUF + mmproj pair (an image
    of 32 x 32 pixels, which neither preprocessing resizes) and picks the same greedy tokens."""
    ids, theirs = llama_cpp_greedy(llama_cpp, pair, png(seed), 16)
    assert ids.count(IMAGE_PAD) == 1
    lm = load(str(pair.f32), "fp32", progress=False, mmproj=str(pair.mmproj))
    req = lm.new_request(
        ids, SamplingParams(max_tokens=16, ignore_eos=True), images=[lm.load_image(png(seed))]
    )
    for _ in stream(lm, req, None):
        pass
    assert req.output_ids == theirs
