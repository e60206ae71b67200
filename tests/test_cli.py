"""Command-line flags -> configs: `serve`'s speculation defaults, vLLM's --speculative-config,
clear errors for conflicting or malformed values, and the same speculation flags with the same
meaning on every subcommand (no model is loaded here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quickdraft.cli import build_parser, main, sampling_params, serve_options, spec_config
from quickdraft.config import SpeculativeConfig
from quickdraft.request import SamplingParams
from quickdraft.server import ServerConfig
from quickdraft.server.media import MediaPolicy


def spec(*argv: str) -> SpeculativeConfig:
    return spec_config(build_parser().parse_args(["serve", *argv]))


def test_cli_serve_default_is_the_packaged_pair() -> None:
    opts, config = serve_options(build_parser().parse_args(["serve"]))
    assert (opts.model, opts.dtype, opts.host) == ("qwen2.5-coder-1.5b", "gguf", "127.0.0.1")
    assert config.max_concurrency == ServerConfig().max_concurrency
    cfg = spec()
    assert (cfg.method, cfg.draft_model, cfg.num_draft_tokens) == ("draft", "qwen2.5-coder-0.5b", 5)


def test_cli_serve_prefix_cache_flags_reach_the_engine_options() -> None:
    opts, _ = serve_options(build_parser().parse_args(["serve"]))
    assert opts.prefix_cache.enabled
    opts, _ = serve_options(build_parser().parse_args(["serve", "--no-prefix-cache"]))
    assert not opts.prefix_cache.enabled
    argv = ["serve", "--prefix-cache-gb", "0.5", "--prefix-block-size", "32"]
    opts, _ = serve_options(build_parser().parse_args(argv))
    assert (opts.prefix_cache.max_gb, opts.prefix_cache.block_size) == (0.5, 32)


def test_cli_serve_responses_store_flag_reaches_the_server_config() -> None:
    _, config = serve_options(build_parser().parse_args(["serve"]))
    assert config.responses_store_mb == ServerConfig().responses_store_mb > 0
    _, config = serve_options(build_parser().parse_args(["serve", "--responses-store-mb", "0"]))
    assert config.responses_store_mb == 0
    with pytest.raises(ValueError, match="responses_store_mb"):
        serve_options(build_parser().parse_args(["serve", "--responses-store-mb", "-1"]))


def test_cli_serve_spm_infill_flag_reaches_the_server_config() -> None:
    _, config = serve_options(build_parser().parse_args(["serve"]))
    assert config.spm_infill is False
    _, config = serve_options(build_parser().parse_args(["serve", "--spm-infill"]))
    assert config.spm_infill is True


def test_cli_serve_pooling_flag_reaches_the_server_config() -> None:
    _, config = serve_options(build_parser().parse_args(["serve"]))
    assert config.pooling is None  # the model's own, else last
    _, config = serve_options(build_parser().parse_args(["serve", "--pooling", "mean"]))
    assert config.pooling == "mean"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--pooling", "max"])
    with pytest.raises(ValueError, match="pooling"):
        ServerConfig(pooling="max")


def test_cli_serve_other_models_default_to_ngram() -> None:
    cfg = spec("smollm2-135m")
    assert cfg.method == "ngram" and cfg.draft_model is None


def test_cli_serve_explicit_flags() -> None:
    cfg = spec("--speculative-method", "none")
    assert not cfg.enabled and cfg.draft_model == "qwen2.5-coder-0.5b"  # kept for the admin page
    cfg = spec("smollm2-135m", "--speculative-method", "ngram", "--num-draft-tokens", "3")
    assert (cfg.method, cfg.num_draft_tokens) == ("ngram", 3)
    cfg = spec("x", "--draft-model", "y", "--no-adaptive")
    assert (cfg.method, cfg.draft_model, cfg.adaptive) == ("draft", "y", False)


@pytest.mark.parametrize(
    ("json_text", "expected"),
    [
        pytest.param(
            '{"method": "draft_model", "model": "d", "num_speculative_tokens": 4}',
            ("draft", "d", 4),
            id="draft-model",
        ),
        pytest.param('{"model": "d"}', ("draft", "d", 5), id="model-implies-draft"),
        pytest.param(
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
            ("ngram", None, 2),
            id="ngram",
        ),
    ],
)
def test_cli_serve_vllm_speculative_config(
    json_text: str, expected: tuple[str, str | None, int]
) -> None:
    cfg = spec("smollm2-135m", "--speculative-config", json_text)
    assert (cfg.method, cfg.draft_model, cfg.num_draft_tokens) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--speculative-config", '{"method": "ngram"}', "--num-draft-tokens", "3"],
            "not both",
            id="config-and-flags",
        ),
        pytest.param(["--speculative-config", "{method"], "not valid JSON", id="bad-json"),
        pytest.param(["--speculative-config", "[1]"], "JSON object", id="not-an-object"),
        pytest.param(["--speculative-config", '{"method": "medusa"}'], "medusa", id="bad-method"),
        pytest.param(["--speculative-config", '{"topk": 2}'], "unsupported keys", id="bad-key"),
        pytest.param(
            ["--speculative-config", '{"num_speculative_tokens": "4"}'], "integer", id="k-string"
        ),
        pytest.param(["--num-draft-tokens", "99"], "num_draft_tokens", id="k-too-large"),
    ],
)
def test_cli_serve_bad_speculation_is_a_clear_error(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec("smollm2-135m", *argv)


SPEC_FLAGS = [
    "--speculative-method",
    "ngram",
    "--num-draft-tokens",
    "3",
    "--ngram-min",
    "2",
    "--ngram-max",
    "3",
    "--ngram-shared-tokens",
    "0",
    "--no-adaptive",
]


@pytest.mark.parametrize(
    "command", [["serve", "m"], ["generate", "--model", "m"], ["bench", "--model", "m"]]
)
def test_cli_spec_flags_mean_the_same_everywhere(command: list[str]) -> None:
    cfg = spec_config(build_parser().parse_args([*command, *SPEC_FLAGS]))
    assert cfg == SpeculativeConfig(
        method="ngram",
        num_draft_tokens=3,
        ngram_min=2,
        ngram_max=3,
        ngram_shared_tokens=0,
        adaptive=False,
    )


def test_cli_unset_flags_keep_the_config_defaults() -> None:
    """Nothing given: `generate` gets the dataclasses' own defaults (speculation off)."""
    args = build_parser().parse_args(["generate", "hi"])
    assert spec_config(args) == SpeculativeConfig()
    assert sampling_params(args) == SamplingParams()
    args = build_parser().parse_args(["generate", "--max-tokens", "7", "--stop", "x", "hi"])
    assert sampling_params(args) == SamplingParams(max_tokens=7, stop=("x",))


def test_cli_bench_defaults_to_the_packaged_pair() -> None:
    cfg = spec_config(build_parser().parse_args(["bench"]))
    assert (cfg.method, cfg.draft_model) == ("draft", "qwen2.5-coder-0.5b")
    assert cfg.num_draft_tokens == SpeculativeConfig().num_draft_tokens


def test_cli_serve_allowed_hosts() -> None:
    _, config = serve_options(build_parser().parse_args(["serve"]))
    assert config.allowed_hosts == ()
    argv = ["serve", "--allowed-hosts", "a.example, b.example", "--allowed-hosts", "*"]
    _, config = serve_options(build_parser().parse_args(argv))
    assert config.allowed_hosts == ("a.example", "b.example", "*")


def test_cli_serve_shutdown_timeout() -> None:
    opts, _ = serve_options(build_parser().parse_args(["serve"]))
    assert opts.shutdown_timeout_s == 30
    opts, _ = serve_options(build_parser().parse_args(["serve", "--shutdown-timeout", "2.5"]))
    assert opts.shutdown_timeout_s == 2.5
    with pytest.raises(ValueError, match="shutdown timeout"):
        serve_options(build_parser().parse_args(["serve", "--shutdown-timeout", "-1"]))


def test_cli_serve_ngram_shared_scope_and_several_api_keys() -> None:
    _, config = serve_options(build_parser().parse_args(["serve"]))
    assert config.ngram_shared_scope == "tenant"
    argv = ["serve", "--ngram-shared-scope", "global", "--api-key", "k1, k2"]
    _, config = serve_options(build_parser().parse_args(argv))
    assert config.ngram_shared_scope == "global" and config.api_keys == ("k1", "k2")


def test_cli_device_reaches_every_loader_and_errs_clearly(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--device is on every command that loads a model (auto by default: the GPU when torch
    sees one); on a host without a GPU, cuda fails before loading anything, saying why."""
    parser = build_parser()
    opts, _ = serve_options(parser.parse_args(["serve", "--device", "cpu"]))
    assert opts.device == "cpu" and serve_options(parser.parse_args(["serve"]))[0].device == "auto"
    for command in (["generate"], ["bench"], ["train-drafter"]):
        assert parser.parse_args([*command, "--device", "cuda"]).device == "cuda"
    if torch.cuda.is_available():
        return  # the error below is a GPU-less host's
    argv = ["generate", "--model", str(tiny_model_dir), "--dtype", "fp32", "--device", "cuda", "x"]
    assert main(argv) == 2
    assert "sees no CUDA GPU; use --device cpu" in capsys.readouterr().err


def test_cli_serve_media_flags(tmp_path: Path) -> None:
    """--allowed-media-domains / --allowed-local-media-path / --max-image-pixels /
    --limit-images-per-prompt / --mmproj reach the server's media policy and the model options;
    a local media path that is no directory is refused."""
    opts, config = serve_options(build_parser().parse_args(["serve"]))
    assert config.media == MediaPolicy() and opts.mmproj is None
    argv = [
        "serve",
        "--allowed-media-domains",
        "Images.Example, cdn.example.",
        "--allowed-local-media-path",
        str(tmp_path),
        "--max-image-pixels",
        "1000000",
        "--limit-images-per-prompt",
        "2",
        "--mmproj",
        "mmproj.gguf",
    ]
    opts, config = serve_options(build_parser().parse_args(argv))
    media = config.media
    assert media.allowed_domains == ("images.example", "cdn.example")
    assert media.allows_host("a.images.example") and not media.allows_host("images.example.evil")
    assert (media.allowed_local_path, media.max_image_pixels) == (tmp_path, 1_000_000)
    assert media.images_per_prompt == 2 and opts.mmproj == "mmproj.gguf"
    argv = ["serve", "--allowed-local-media-path", str(tmp_path / "missing")]
    with pytest.raises(ValueError, match="not a directory"):
        serve_options(build_parser().parse_args(argv))
    # vLLM's --limit-mm-per-prompt sets both limits (what it names), over the two flags
    argv = ["serve", "--limit-videos-per-prompt", "3", "--limit-mm-per-prompt", '{"image": 5}']
    media = serve_options(build_parser().parse_args(argv))[1].media
    assert (media.images_per_prompt, media.videos_per_prompt) == (5, 3)
    for bad in ('{"audio": 1}', "image=4", '{"video": -1}', '{"image": true}'):
        with pytest.raises(ValueError, match="limit-mm-per-prompt"):
            serve_options(build_parser().parse_args(["serve", "--limit-mm-per-prompt", bad]))


def test_cli_generate_with_an_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --chat --image FILE` on a vision-language model: the image's rows are in the
    prompt; without --chat it is a clear error."""
    from vision_models import make_vlm_dir, png

    _, directory = make_vlm_dir(tmp_path / "vlm")
    picture = tmp_path / "p.png"
    picture.write_bytes(png(1))
    base = ["generate", "--model", str(directory), "--dtype", "fp32", "--max-tokens", "4"]

    def prompt_tokens(*extra: str) -> int:
        assert main([*base, "--chat", *extra, "what is it?"]) == 0
        return int(capsys.readouterr().err.split("prompt ")[1].split(" tok")[0])

    # the image's 16 rows between <|vision_start|> and <|vision_end|>
    assert prompt_tokens("--image", str(picture)) == prompt_tokens() + 18
    assert main([*base, "--image", str(picture), "what is it?"]) == 2
    assert "--image needs --chat" in capsys.readouterr().err
