"""`quickdraft serve` flags -> SpeculativeConfig: defaults, vLLM's --speculative-config, and
clear errors for conflicting or malformed values (no model is loaded here)."""

from __future__ import annotations

import pytest

from quickdraft.cli import build_parser, serve_spec_config
from quickdraft.config import SpeculativeConfig


def spec(*argv: str) -> SpeculativeConfig:
    return serve_spec_config(build_parser().parse_args(["serve", *argv]))


def test_server_cli_default_is_the_packaged_pair() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.model == "qwen2.5-coder-1.5b" and args.host == "127.0.0.1"
    assert args.dtype == "bf16"
    cfg = spec()
    assert (cfg.method, cfg.draft_model, cfg.num_draft_tokens) == ("draft", "qwen2.5-coder-0.5b", 5)


def test_server_cli_other_models_default_to_ngram() -> None:
    cfg = spec("smollm2-135m")
    assert cfg.method == "ngram" and cfg.draft_model is None


def test_server_cli_explicit_flags() -> None:
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
def test_server_cli_vllm_speculative_config(
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
        pytest.param(["--speculative-config", '{"method": "eagle3"}'], "eagle3", id="bad-method"),
        pytest.param(["--speculative-config", '{"topk": 2}'], "unsupported keys", id="bad-key"),
        pytest.param(
            ["--speculative-config", '{"num_speculative_tokens": "4"}'], "integer", id="k-string"
        ),
        pytest.param(["--num-draft-tokens", "99"], "num_draft_tokens", id="k-too-large"),
    ],
)
def test_server_cli_bad_speculation_is_a_clear_error(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec("smollm2-135m", *argv)
