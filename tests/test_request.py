"""Output bookkeeping: EOS, max_tokens and stop strings inside a multi-token block, streaming
hold-back, and UTF-8-safe incremental detokenization (real byte-level tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from quickdraft.request import FinishReason, Request, SamplingParams
from quickdraft.tokenizer import Tokenizer

EOS = 259  # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def make(tok: Tokenizer, **kw: object) -> Request:
    return Request([1, 2, 3], SamplingParams(**kw), tok, (EOS,))  # type: ignore[arg-type]


def test_request_eos_inside_block_cuts_there(tok: Tokenizer) -> None:
    req = make(tok)
    kept = req.append([*tok.encode("ab"), EOS, *tok.encode("cd")])
    assert kept == 3 and req.finish_reason == FinishReason.STOP
    assert req.text == "ab" and req.output_ids == tok.encode("ab")


def test_request_max_tokens_mid_block_never_overshoots(tok: Tokenizer) -> None:
    req = make(tok, max_tokens=4)
    assert req.append(tok.encode("abc")) == 3 and not req.finished
    assert req.append(tok.encode("defg")) == 1
    assert req.finish_reason == FinishReason.LENGTH and req.text == "abcd"


def test_request_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    req = make(tok, stop=("END",))
    req.append(tok.encode("xxEN"))
    assert req.stream_delta() == "xx"  # "EN" may begin the stop string: held back
    kept = req.append(tok.encode("Dyy"))
    assert kept == 1 and req.finish_reason == FinishReason.STOP
    assert req.text == "xx" and req.stream_delta() == ""


def test_request_held_back_prefix_released_when_not_a_stop(tok: Tokenizer) -> None:
    req = make(tok, stop=("END",))
    req.append(tok.encode("xxEN"))
    assert req.stream_delta() == "xx"
    req.append(tok.encode("Zq"))
    assert req.stream_delta() == "ENZq"


def test_request_ignore_eos_keeps_going(tok: Tokenizer) -> None:
    req = Request([1], SamplingParams(ignore_eos=True, max_tokens=3), tok, (EOS,))
    assert req.append([65, EOS, 66]) == 3 and req.finish_reason == FinishReason.LENGTH


def test_detokenizer_holds_incomplete_utf8(tok: Tokenizer) -> None:
    req = make(tok)
    ids = tok.encode("é!")  # 'é' is two bytes -> two byte tokens
    assert len(ids) == 3
    req.append(ids[:1])
    assert req.stream_delta() == ""
    req.append(ids[1:])
    assert req.stream_delta() == "é!"


def test_tokenizer_chat_template_matches_transformers(tiny_model_dir: Path) -> None:
    import transformers

    ours = Tokenizer(tiny_model_dir)
    ref = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_model_dir / "tokenizer.json")
    )
    ref.chat_template = ours.chat_template
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ü"}]
    assert ours.render_chat(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_request_rejects_empty_prompt(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="empty"):
        Request([], SamplingParams(), tok, (EOS,))
