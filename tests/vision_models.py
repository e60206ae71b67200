"""A tiny random-weight Qwen3.5 vision-language checkpoint for the vision tests, written by
transformers' own `Qwen3_5ForConditionalGeneration` (the reference), with the byte-level test
tokenizer plus the vision specials and a chat template that renders image parts as Qwen3.5's
does (`<|vision_start|><|image_pad|><|vision_end|>`)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import write_tiny_tokenizer
from hybrid_models import HYBRID_CONFIGS, randomize
from PIL import Image

VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # ids 260..262
VISION_START, VISION_END, IMAGE_PAD = 260, 261, 262

# Qwen3.5's template, reduced to what the tests use: text and image parts, ChatML turns
VLM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PATCH = 4  # tiny patches: a 32 x 32 image is 8 x 8 patches, 16 placeholder tokens


def vlm_config(family: str = "qwen3_5") -> dict[str, Any]:
    """config.json of a tiny `family` ("qwen3_5" or "qwen3_5_moe") vision-language model."""
    text = dict(HYBRID_CONFIGS[family]["text_config"])
    text["rope_parameters"] = dict(
        text["rope_parameters"], mrope_section=[2, 1, 1], mrope_interleaved=True
    )
    return dict(
        model_type=family,
        tie_word_embeddings=False,
        text_config=text,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=PATCH,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=text["hidden_size"],
            num_position_embeddings=16,
        ),
        image_token_id=IMAGE_PAD,
        video_token_id=263,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )


def qwen25_vl_config(
    hidden: int = 64, layers: int = 3, patch: int = PATCH, window: int = 4 * PATCH
) -> dict[str, Any]:
    """config.json of a tiny Qwen2.5-VL: a dense Qwen2 language model (heads of 32, what the
    batch-invariant bf16 attention kernel takes) with M-RoPE sections (4, 6, 6) over its 16
    rotary frequencies, and a 4-block tower with full attention in blocks 1 and 3, windowed in
    0 and 2 (`window` pixels a side: 2 x 2 merged units by default)."""
    return dict(
        model_type="qwen2_5_vl",
        tie_word_embeddings=False,
        text_config=dict(
            vocab_size=320,
            hidden_size=hidden,
            intermediate_size=96,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6]),
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            depth=4,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=patch,
            temporal_patch_size=2,
            spatial_merge_size=2,
            window_size=window,
            fullatt_block_indexes=[1, 3],
            out_hidden_size=hidden,
        ),
        image_token_id=IMAGE_PAD,
        video_token_id=263,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )


def make_qwen25_vl_dir(
    directory: Path, seed: int = 1, out_scale: float = 1.0, **sizes: int
) -> tuple[Any, Path]:
    """The Qwen2.5-VL counterpart of `make_vlm_dir`, its preprocessing in the release's keys
    (`min_pixels` / `max_pixels`) with CLIP's mean and std; `sizes`: qwen25_vl_config's (a
    patch other than the tiny one gets the release's pixel bounds)."""
    import transformers

    cfg = transformers.Qwen2_5_VLConfig(**qwen25_vl_config(**sizes))
    patch = sizes.get("patch", PATCH)
    preprocessor = dict(QWEN25_PREPROCESSOR, patch_size=patch)
    if patch != PATCH:
        preprocessor.update(min_pixels=3136, max_pixels=12845056)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg).float().eval()
    randomize(hf, seed=seed, out_scale=out_scale, offset=False)
    with torch.no_grad():  # the merger's RMSNorm too (its name has no "norm")
        hf.model.visual.merger.ln_q.weight.uniform_(0.8, 1.2)
    hf.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    write_tiny_tokenizer(directory, VISION_SPECIALS, VLM_TEMPLATE)
    return hf, directory


QWEN25_PREPROCESSOR = {
    "patch_size": PATCH,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 16 * 16,
    "max_pixels": 48 * 48,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def make_vlm_dir(
    directory: Path, seed: int = 1, out_scale: float = 1.0, family: str = "qwen3_5"
) -> tuple[Any, Path]:
    """(the transformers model, its checkpoint directory) with preprocessing for tiny patches.
    A small `out_scale` (hybrid_models.randomize) makes the language model's next token mostly
    a function of the current one: its greedy output soon cycles, so lookups get accepted."""
    import transformers

    if family == "qwen2_5_vl":
        return make_qwen25_vl_dir(directory, seed, out_scale)
    raw = vlm_config(family)
    text = dict(raw["text_config"])
    mtp = text.pop("mtp_num_hidden_layers")
    moe = family == "qwen3_5_moe"
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_class = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    cfg = config_class(**{**raw, "text_config": text})
    hf = model_class(cfg).float().eval()
    randomize(hf, seed=seed, out_scale=out_scale)
    with torch.no_grad():  # LayerNorm weights around 1 (randomize centres norms on 0)
        for name, p in hf.model.visual.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    hf.save_pretrained(directory)
    saved = json.loads((directory / "config.json").read_text())
    saved["text_config"]["mtp_num_hidden_layers"] = mtp  # no head in the file: MTP tests add one
    (directory / "config.json").write_text(json.dumps(saved))
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    write_tiny_tokenizer(directory, VISION_SPECIALS, VLM_TEMPLATE)
    return hf, directory


PREPROCESSOR = {
    "patch_size": PATCH,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 16 * 16, "longest_edge": 48 * 48},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def png(seed: int, width: int = 32, height: int = 32) -> bytes:
    """A random RGB picture as PNG bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def make_bigram_draft(target: Any, directory: Path) -> Path:
    """A dense (Qwen2) text-only draft model for `target` (transformers' VLM): its layers add
    nothing, and its embedding, final norm and head are the target's, so it drafts the
    target's next token from the current token alone, which a small-`out_scale` target mostly
    follows. It sees an image's rows as their placeholder ids."""
    from conftest import make_tiny_hf_model

    draft = make_tiny_hf_model(
        "qwen2", directory, seed=2, tie_word_embeddings=False, rms_norm_eps=1e-6
    )
    lm = target.model.language_model
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(lm.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.model.norm.weight.copy_(1.0 + lm.norm.weight)  # the target's norm is (1 + w)
        for layer in draft.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft.save_pretrained(directory)
    write_tiny_tokenizer(directory, VISION_SPECIALS, VLM_TEMPLATE)
    return directory


def add_copying_mtp_head(directory: Path) -> Path:
    """Write an `mtp.*` head into the checkpoint at `directory` (a file of its own): the
    copying head of hybrid_models (it drafts the target's bigram guess), so MTP drafts on a
    small-`out_scale` target are often accepted."""
    from hybrid_models import copying_head, hf_names
    from safetensors.torch import save_file

    from quickdraft.models.formats.loader import load_model

    model = load_model(directory, torch.float32)
    head = copying_head(model)  # type: ignore[arg-type]
    tensors = {"mtp." + n: t for n, t in hf_names(dict(head.state_dict()), "qwen3_5", 0).items()}
    save_file(tensors, str(directory / "mtp.safetensors"), metadata={"format": "pt"})
    return directory


def hf_image_forward(hf: Any, ids: list[int], image: Any, **kwargs: Any) -> Any:
    """transformers' forward over `ids` (placeholders expanded) with one image."""
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        return hf(
            input_ids=ids_t,
            pixel_values=image.pixels,
            image_grid_thw=torch.tensor([image.grid]),
            mm_token_type_ids=(ids_t == IMAGE_PAD).int(),
            **kwargs,
        )


def image_forward(
    lm: Any, prompt: list[int], image: Any, room: int = 0
) -> tuple[Any, list[int], Any, Any]:
    """Our forward over every row of `prompt` with its one image placeholder expanded, the
    image encoded by `lm`'s tower, every row scored: (output, the expanded ids, their layout,
    the cache with `room` more positions, not committed)."""
    from quickdraft.images import ImageLayout, ImageRows

    ids, layout = ImageLayout.build(prompt, [image], IMAGE_PAD, 2)
    layout.embeds = [lm.vision.encode(image.pixels, image.grid)]
    span = layout.spans[0]
    rows = torch.arange(span.start, span.start + span.length)
    cache = lm.model.new_cache(len(ids) + room)
    out = lm.model(
        torch.tensor(ids),
        [cache],
        [len(ids)],
        logit_rows=torch.arange(len(ids)),
        images=ImageRows(rows, layout.embeds[0], layout.rows(0, len(ids))),
    )
    return out, ids, layout, cache


def hf_generate(hf: Any, ids: list[int], image: Any, tokens: int) -> list[int]:
    """transformers' greedy continuation of `ids` (placeholders expanded) with one image."""
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids_t,
            pixel_values=image.pixels,
            image_grid_thw=torch.tensor([image.grid]),
            mm_token_type_ids=(ids_t == IMAGE_PAD).int(),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
        )
    return list(out[0, ids_t.shape[1] :].tolist())


def assert_forward_and_decode_match(hf: Any, lm: Any, prompt: list[int], image: Any) -> None:
    """Every row's logits of our forward over `prompt` with its image, then 8 cached decode
    steps (their M-RoPE positions past the prompt), against transformers' (1e-4)."""
    out, ids, layout, cache = image_forward(lm, prompt, image, room=16)
    cache.commit(len(ids))
    ref = hf_image_forward(hf, ids, image, use_cache=True)
    assert (out.logits - ref.logits[0]).abs().max().item() < 1e-4
    assert_decode_steps_match(hf, lm, ref, cache, layout)


def assert_decode_steps_match(hf: Any, lm: Any, ref: Any, cache: Any, layout: Any) -> None:
    """From transformers' output `ref` over an image prompt (its cache in `ref`) and ours
    (its committed `cache`, the prompt's `layout`): 8 greedy decode steps, each row's image
    input as the engine packs it, every step's logits within 1e-4 of transformers'."""
    from quickdraft.images import pack_image_rows

    past = ref.past_key_values
    hidden = lm.model.config.hidden_size
    for _ in range(8):
        token = int(ref.logits[0, -1].argmax())
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = ref.past_key_values
        n = cache.length
        rows = pack_image_rows([layout], [n], [1], hidden, torch.device("cpu"))
        step = lm.model(torch.tensor([token]), [cache], [1], images=rows)
        cache.commit(n + 1)
        assert (step.logits[0] - ref.logits[0, -1]).abs().max().item() < 1e-4


def language_model_state(hf: Any) -> dict[str, torch.Tensor]:
    """A composite transformers model's language model as a text checkpoint names it
    (`model.layers...`, `lm_head`): what llama_cpp_tensors lays out as a GGUF."""
    state = dict(hf.state_dict())
    prefix = "model.language_model."
    text = {"model." + k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    text["lm_head.weight"] = state["lm_head.weight"]
    return text
