"""gpt-oss's harmony channels at the HTTP edge (server/reasoning.py): reasoning, content and
tool calls from a whole output and from the same output streamed in pieces of every size; the
converter's end-of-generation ids for a harmony vocabulary; and a request on such a
vocabulary keeping the markers in its text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quickdraft.hub.convert import convert_gguf
from quickdraft.hub.gguf_write import TINY_SPECIALS, write_gguf
from quickdraft.request import Request, SamplingParams
from quickdraft.server.reasoning import HarmonyStream, is_harmony, parse_harmony
from quickdraft.tokenizer import Tokenizer

HARMONY_SPECIALS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
)

ANSWER = (
    "<|channel|>analysis<|message|>The user wants a greeting. Keep it short.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather: call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
CALL_HEADER_FIRST = (  # the recipient before the channel, as the chat template writes calls
    '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}<|call|>'
)
PREAMBLE = (
    "<|channel|>commentary<|message|>Let me check.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Done."
)


def test_whole_outputs_split_by_channel() -> None:
    got = parse_harmony(ANSWER)
    assert got.reasoning == "The user wants a greeting. Keep it short."
    assert got.content == "Hello there!" and got.calls == []
    call = parse_harmony(CALL)
    assert call.reasoning == "Need the weather: call the tool." and call.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in call.calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    first = parse_harmony(CALL_HEADER_FIRST)
    assert [c.function.name for c in first.calls] == ["lookup"] and first.reasoning is None
    preamble = parse_harmony(PREAMBLE)  # a commentary message without a recipient: content
    assert preamble.content == "Let me check.Done." and preamble.reasoning is None
    plain = parse_harmony("no markers at all")  # a model not following the format
    assert plain.content == "no markers at all" and plain.reasoning is None


@pytest.mark.parametrize("text", [ANSWER, CALL, CALL_HEADER_FIRST, PREAMBLE], ids=range(4))
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13])
def test_streamed_pieces_add_up_to_the_whole(text: str, size: int) -> None:
    """Markers cut anywhere between pieces: no marker text leaks, and the deltas join into the
    whole output's reasoning, content and calls."""
    whole = parse_harmony(text)
    stream = HarmonyStream()
    reasoning = content = ""
    calls = []
    for at in range(0, len(text), size):
        r, c, d = stream.push(text[at : at + size])
        assert "<|" not in r + c and "|>" not in r + c
        reasoning, content, calls = reasoning + r, content + c, calls + d
    r, c, d = stream.flush()
    reasoning, content, calls = reasoning + r, content + c, calls + d
    assert (reasoning or None, content or None) == (whole.reasoning, whole.content)
    assert [(d.function.name, d.function.arguments) for d in calls] == [
        (c.function.name, c.function.arguments) for c in whole.calls
    ]
    assert [d.index for d in calls] == list(range(len(calls)))


def test_harmony_vocabulary_ends_on_return_and_call(tmp_path: Path) -> None:
    """A gpt-oss vocabulary: the converted model stops on <|return|> and <|call|>, not on
    <|end|> (which only closes the analysis message), it is recognized as harmony, and a
    request that keeps special tokens gets the markers in its text."""
    cfg = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0},
    }
    specials = (*TINY_SPECIALS, *HARMONY_SPECIALS)
    path = write_gguf(tmp_path / "harmony.gguf", "llama", cfg, {}, specials=specials)
    out = convert_gguf(path, tmp_path / "model", "gguf", progress=False)
    tok = Tokenizer(out)
    ids = {t: tok.encode(t, add_special_tokens=False)[0] for t in HARMONY_SPECIALS}
    assert is_harmony(tok)
    eos = set(json.loads((out / "generation_config.json").read_text())["eos_token_id"])
    assert {ids["<|return|>"], ids["<|call|>"]} <= eos and ids["<|end|>"] not in eos
    text = "<|channel|>analysis<|message|>hi<|end|>"
    piece_ids = tok.encode(text, add_special_tokens=False)
    for skip, want in ((True, "analysishi"), (False, text)):
        req = Request([1], SamplingParams(max_tokens=64, skip_special_tokens=skip), tok, ())
        req.append(piece_ids)
        assert req.text == want
    plain = write_gguf(tmp_path / "plain.gguf", "llama", cfg, {})
    assert not is_harmony(Tokenizer(convert_gguf(plain, tmp_path / "p", "gguf", progress=False)))
