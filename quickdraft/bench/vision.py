"""`quickdraft bench --vision`: image turns on a random-weight vision-language model of
Qwen3.5-0.8B's shape, with transformers in the same run.

The model: Qwen3.5-0.8B's language model (shapes.py: hidden 1024, 18 GDN + 6 gated attention
layers, vocabulary cut to 32k) and its vision tower (depth 12, hidden 768, 12 heads, MLP 3072,
patch 16, 2 x 2 merge, 2304 learned positions), built by transformers'
Qwen3_5ForConditionalGeneration and saved as a checkpoint that quickdraft loads as a user's
(bf16, panel kernels), with an MTP head and a text-only dense draft model (2 layers) that
both draft the target's bigram guess (random weights carry no language, so acceptance is
staged by `out_scale`, as in bench/hybrid.py). Real VLM weights are not available offline.

Measured side by side, warm-up excluded, medians of --reps:
  ttft       a 448 x 448 image + 64 text tokens: quickdraft's time to first token (engine core,
             no prefix cache, encoder cache cleared) split into the vision tower and the
             prefill, against transformers' forward over the same ids and pixels (its tower
             timed alone too)
  repeat     the same request again on a core with the prefix cache: TTFT cold vs served from
             the cache (the image's blocks keyed by its content, its embeddings by digest)
  decode     greedy decode tok/s after an image turn vs after a text-only turn of the same
             prompt length, speculation off and with n-gram, suffix, the draft model and MTP;
             every output compared with speculation off
Writes bench/results/vision.{json,md,png}; prints the tables, then the JSON as the last line.

    flock /tmp/quickdraft-bench.lock quickdraft bench --vision
"""

from __future__ import annotations

import io
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from quickdraft.bench.report import RESULTS, bar_chart, machine, peak_rss_mb, table, write
from quickdraft.bench.shapes import HYBRID_CONFIG as TEXT_CONFIG
from quickdraft.bench.shapes import init_
from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine.core import EngineCore
from quickdraft.images import ImageInput
from quickdraft.loading import LoadedModel, load
from quickdraft.models.heads.mtp import MTPHead
from quickdraft.request import Request, SamplingParams

VISION = dict(  # Qwen3.5-0.8B's vision_config
    depth=12,
    hidden_size=768,
    num_heads=12,
    intermediate_size=3072,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
    out_hidden_size=1024,
    hidden_act="gelu_pytorch_tanh",
)
PAD, START, END = 31999, 31997, 31998  # image placeholder and its brackets, inside the 32k vocab
METHODS = ("none", "ngram", "suffix", "draft", "mtp")


@dataclass(frozen=True, slots=True)
class VisionBench:
    reps: int = 3  # TTFT and repeat runs (medians; one warm-up more)
    tokens: int = 96  # decoded tokens per turn
    decode_reps: int = 5
    out_scale: float = 0.04  # what the target's layers write: stages the acceptance
    out_dir: Path = RESULTS


def build(directory: Path, out_scale: float) -> tuple[Any, LoadedModel]:
    """transformers' model (bf16) and ours, loaded from the checkpoint it saved."""
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    text = {k: v for k, v in TEXT_CONFIG.items() if k != "mtp_num_hidden_layers"}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [11, 11, 10]}
    cfg = transformers.Qwen3_5Config(
        text_config=text,
        vision_config=VISION,
        tie_word_embeddings=False,
        image_token_id=PAD,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    init_(hf.model.language_model, 0, out_scale)
    init_(hf.lm_head, 2, 1.0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the tower: unit-gain linears, LayerNorms at identity
        for name, p in hf.model.visual.named_parameters():
            if "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in**-0.5)
    hf = hf.to(torch.bfloat16)
    hf.save_pretrained(directory)
    raw = json.loads((directory / "config.json").read_text())
    raw["text_config"]["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(raw))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
    lm = load(str(directory), "bf16", progress=False)
    head = staged_head(lm)
    state = {f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(directory / "mtp.safetensors"))
    return hf, load(str(directory), "bf16", progress=False)


def staged_head(lm: LoadedModel) -> MTPHead:
    """bench/hybrid.py's head: fc passes norm_e(embed(t)) through, its layer adds nothing."""
    from quickdraft.models.heads.mtp import hybrid_mtp_parts

    model: Any = lm.model
    cfg = model.config
    dtype, device = torch.bfloat16, torch.device("cpu")
    embed = model.get_submodule("model.embed_tokens")
    head = MTPHead(
        hybrid_mtp_parts(cfg, dtype, device), cfg.hidden_size, embed, model.head, dtype, device
    )
    init_(head, 1, 0.0)
    h = cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)
        head.get_parameter("pre_fc_norm_embedding.weight").zero_()
        head.get_parameter("norm.weight").copy_(model.get_parameter("model.norm.weight"))
    return head


def bigram_draft(hf: Any, target: Path, directory: Path) -> Path:
    """A text-only dense (Qwen2) draft model of 2 layers: the target's embedding, final norm
    and head with layers that write nothing, so it drafts the target's next token from the
    current one (what a small `out_scale` target mostly follows); it sees an image's rows as
    their placeholder ids."""
    import shutil

    import transformers

    text = hf.model.language_model
    cfg = transformers.Qwen2Config(
        vocab_size=TEXT_CONFIG["vocab_size"],
        hidden_size=TEXT_CONFIG["hidden_size"],
        intermediate_size=TEXT_CONFIG["intermediate_size"],
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    draft: Any = transformers.Qwen2ForCausalLM(cfg).eval()
    draft = draft.to(torch.bfloat16)
    init_(draft, 4, 0.0)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(text.embed_tokens.weight)
        draft.lm_head.weight.copy_(hf.lm_head.weight)
        draft.model.norm.weight.copy_(1.0 + text.norm.weight.float())  # the target's is 1 + w
        for layer in draft.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
    draft.save_pretrained(directory)
    shutil.copy(target / "tokenizer.json", directory / "tokenizer.json")
    return directory


def picture(seed: int, size: int = 448) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def prompt(seed: int, text: int = 64, image: bool = True) -> list[int]:
    """`text` text tokens around one image placeholder (or none)."""
    words = np.random.default_rng(seed).integers(0, 256, text).tolist()
    middle = [START, PAD, END] if image else []
    return words[: text // 2] + middle + words[text // 2 :]


def run(
    core: EngineCore,
    lm: LoadedModel,
    ids: list[int],
    images: list[ImageInput],
    tokens: int,
    spec: Any = None,
) -> Request:
    req = lm.new_request(
        list(ids), SamplingParams(max_tokens=tokens, ignore_eos=True), images=images
    )
    core.add(req, spec)
    while not req.finished:
        core.step()
    return req


def ttft(lm: LoadedModel, hf: Any, reps: int) -> dict[str, Any]:
    image = lm.load_image(picture(1))
    ids = prompt(1)
    ours, encoder = [], []
    for r in range(reps + 1):
        core = EngineCore(lm)  # no prefix cache, an empty encoder cache
        req = run(core, lm, ids, [image], 1)
        assert req.timing.ttft is not None and core.encoder is not None
        if r:  # the first one warms up
            ours.append(req.timing.ttft)
            encoder.append(core.encoder.stats.seconds)
    full = list(req.prompt_ids)
    ids_t = torch.tensor([full])
    grid = torch.tensor([image.grid])
    pixels = image.pixels.to(torch.bfloat16)
    theirs, their_tower = [], []
    with torch.inference_mode():
        for r in range(reps + 1):
            t0 = time.perf_counter()
            hf.model.get_image_features(pixels, grid)
            t1 = time.perf_counter()
            out = hf(
                input_ids=ids_t,
                pixel_values=pixels,
                image_grid_thw=grid,
                mm_token_type_ids=(ids_t == PAD).int(),
                logits_to_keep=1,
            )
            int(out.logits[0, -1].argmax())
            if r:
                their_tower.append(t1 - t0)
                theirs.append(time.perf_counter() - t1)
    med = statistics.median
    return {
        "prompt_tokens": len(full),
        "image_tokens": len(full) - len(ids) + 1,
        "ours_s": med(ours),
        "ours_encoder_s": med(encoder),
        "ours_prefill_s": med(ours) - med(encoder),
        "transformers_s": med(theirs),
        "transformers_encoder_s": med(their_tower),
        "ratio": med(ours) / med(theirs),
    }


def repeat(lm: LoadedModel, reps: int) -> dict[str, Any]:
    cold, warm = [], []
    for _ in range(reps):
        core = EngineCore(lm, prefix_cache=PrefixCacheConfig(enabled=True))
        first = run(core, lm, prompt(2), [lm.load_image(picture(2))], 1)
        again = run(core, lm, prompt(2), [lm.load_image(picture(2))], 1)
        assert first.timing.ttft is not None and again.timing.ttft is not None
        cold.append(first.timing.ttft)
        warm.append(again.timing.ttft)
    med = statistics.median
    return {"cold_s": med(cold), "cached_s": med(warm), "speedup": med(cold) / med(warm)}


def decode(lm: LoadedModel, tokens: int, reps: int, draft: Path) -> dict[str, Any]:
    """Per method and turn kind (medians of `reps` runs): tok/s after the first token, ms per
    target forward (a cycle: what an image could slow; tok/s also moves with the staged
    acceptance, which differs between the two turns' outputs), AL, identical to spec off."""
    from quickdraft.speculation.factory import make_speculation

    out: dict[str, Any] = {}
    image = lm.load_image(picture(3))
    turns = {"image": (prompt(3), [image])}
    image_len = len(lm.new_request(prompt(3), SamplingParams(), images=[image]).prompt_ids)
    turns["text"] = (prompt(4, text=image_len, image=False), [])
    plain: dict[str, list[int]] = {}
    for method in METHODS:
        cfg = SpeculativeConfig(
            method=method,
            num_draft_tokens=4,
            adaptive=False,
            draft_model=str(draft) if method == "draft" else None,
            draft_quantization="none",
        )
        spec = make_speculation(lm, cfg)
        rates: dict[str, list[float]] = {kind: [] for kind in turns}
        cycle_ms: dict[str, list[float]] = {kind: [] for kind in turns}
        last: dict[str, Request] = {}
        for ids, images in turns.values():
            run(EngineCore(lm), lm, ids, images, 8, spec)  # warm-up
        for _ in range(reps):  # the two turns interleaved: host noise hits both alike
            for kind, (ids, images) in turns.items():
                req = last[kind] = run(EngineCore(lm), lm, ids, images, tokens, spec)
                t = req.timing
                assert t.finished is not None and t.first_token is not None
                seconds = t.finished - t.first_token
                rates[kind].append((len(req.output_ids) - 1) / seconds)
                cycles = req.spec.cycles if method != "none" else len(req.output_ids)
                cycle_ms[kind].append(1000 * seconds / max(cycles - 1, 1))
        for kind, req in last.items():
            if method == "none":
                plain[kind] = req.output_ids
            out[f"{method}/{kind}"] = {
                "tok_s": statistics.median(rates[kind]),
                "cycle_ms": statistics.median(cycle_ms[kind]),
                "al": req.spec.mean_acceptance_length if method != "none" else 1.0,
                "identical": req.output_ids == plain[kind],
                "prompt_tokens": len(req.prompt_ids),
            }
    for method in METHODS:
        image_row, text_row = out[f"{method}/image"], out[f"{method}/text"]
        image_row["vs_text"] = image_row["tok_s"] / text_row["tok_s"]
        image_row["cycle_vs_text"] = image_row["cycle_ms"] / text_row["cycle_ms"]
    return out


def markdown(r: dict[str, Any]) -> str:
    t, p, d = r["ttft"], r["repeat"], r["decode"]
    rows = [
        [
            "quickdraft",
            f"{t['ours_s']:.3f}",
            f"{t['ours_encoder_s']:.3f}",
            f"{t['ours_prefill_s']:.3f}",
        ],
        ["transformers", f"{t['transformers_s']:.3f}", f"{t['transformers_encoder_s']:.3f}", "-"],
    ]
    md = f"## TTFT, 448 x 448 image + 64 text tokens ({t['prompt_tokens']} prompt tokens)\n\n"
    md += table(["engine", "TTFT s", "vision tower s", "prefill s"], rows)
    md += f"\nquickdraft / transformers TTFT: **{t['ratio']:.3f}x** (target <= 0.5x)\n\n"
    md += "## The same image again (prefix cache)\n\n"
    md += table(
        ["cold TTFT s", "cached TTFT s", "speedup"],
        [[f"{p['cold_s']:.3f}", f"{p['cached_s']:.4f}", f"{p['speedup']:.1f}x"]],
    )
    md += "\n## Decode after an image turn vs a text-only turn of the same length\n\n"
    rows = []
    for m in METHODS:
        im, tx = d[m + "/image"], d[m + "/text"]
        rows.append(
            [
                m,
                f"{im['tok_s']:.1f}",
                f"{tx['tok_s']:.1f}",
                f"{im['vs_text']:.3f}",
                f"{im['cycle_ms']:.1f}",
                f"{tx['cycle_ms']:.1f}",
                f"{im['cycle_vs_text']:.3f}",
                f"{im['al']:.2f}",
                f"{tx['al']:.2f}",
                im["identical"] and tx["identical"],
            ]
        )
    header = ["method", "image tok/s", "text tok/s", "tok/s image/text", "image ms/cycle"]
    header += ["text ms/cycle", "cycle image/text", "AL image", "AL text", "identical"]
    md += table(header, rows)
    return md


def run_vision(bench: VisionBench) -> dict[str, Any]:
    report: dict[str, Any] = {"machine": machine(), "vision_config": VISION}
    with tempfile.TemporaryDirectory() as tmp:
        hf, lm = build(Path(tmp) / "target", bench.out_scale)
        draft = bigram_draft(hf, Path(tmp) / "target", Path(tmp) / "draft")
        report["ttft"] = ttft(lm, hf, bench.reps)
        del hf
        report["repeat"] = repeat(lm, bench.reps)
        report["decode"] = decode(lm, bench.tokens, bench.decode_reps, draft)
    report["peak_rss_mb"] = peak_rss_mb()
    d = report["decode"]
    write(
        "vision",
        report,
        markdown(report),
        bar_chart(
            "decode tok/s: image turn vs text turn",
            "tok/s",
            list(METHODS),
            {k: [d[f"{m}/{k}"]["tok_s"] for m in METHODS] for k in ("image", "text")},
        ),
        bench.out_dir,
    )
    return report
