"""The OpenAI surface under speculation (over 400 lines: one section per feature): logprobs,
penalties, logit_bias, structured outputs, tools, n / best_of. A real server on loopback and
the real `openai` client.

One engine serves the same tiny fp32 model three times: speculation off, n-gram, and a draft
model, so every feature is checked to give the same output (and logprobs) with speculation on
as off, stream and non-stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from conftest import make_tiny_hf_model, noisy_copy, write_tiny_tokenizer

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import LoadedModel, load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer
from quickdraft.server.tools import ToolCallStream, hermes_messages, parse_tool_calls
from quickdraft.tokenizer import Tokenizer

MODELS = ["off", "ngram", "draft"]
SPECIALS = {"<s>", "</s>", "<|im_start|>", "<|im_end|>"}  # conftest's tiny tokenizer
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 24}
TOOLS_GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 120}  # byte tokens: a call is ~60
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "days", "rain"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model with a 4k context (tool definitions take ~600 byte tokens) and its
    near draft model."""
    target = tmp_path_factory.mktemp("tiny-long")
    make_tiny_hf_model("qwen2", target, seed=3, max_position_embeddings=4096)
    write_tiny_tokenizer(target)
    return target, noisy_copy(target, tmp_path_factory.mktemp("tiny-long-draft"))


@pytest.fixture(scope="module")
def client(model_dirs: tuple[Path, Path]) -> Iterator[openai.OpenAI]:
    target_dir, near_draft_dir = model_dirs
    lm: LoadedModel = load(str(target_dir), "fp32", progress=False)
    configs = {
        "off": SpeculativeConfig(),
        "ngram": SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False),
        "draft": SpeculativeConfig(
            method="draft", num_draft_tokens=3, draft_model=str(near_draft_dir), adaptive=False
        ),
    }
    engine = Engine({name: ServedModel(lm, cfg) for name, cfg in configs.items()})
    engine.start()
    with BackgroundServer(create_app(engine, ServerConfig(max_concurrency=16))) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    engine.stop()


def chat(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[int, str], dict[int, Any]]:
    """Per choice index: the streamed text and the streamed logprob entries / tool calls."""
    text: dict[int, str] = {}
    extra: dict[int, Any] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            entry = extra.setdefault(c.index, {"logprobs": [], "tool_calls": [], "finish": None})
            if c.logprobs is not None and c.logprobs.content:
                entry["logprobs"] += c.logprobs.content
            entry["tool_calls"] += c.delta.tool_calls or []
            entry["finish"] = c.finish_reason or entry["finish"]
    return text, extra


# ------------------------------------------------------------------------------ logprobs


def test_chat_logprobs_equal_with_speculation_and_match_the_tokens(client: openai.OpenAI) -> None:
    results = {
        m: client.chat.completions.create(
            model=m,
            messages=chat("abc abc abc abc abc"),
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
        for m in MODELS
    }
    base = results["off"].choices[0]
    assert base.logprobs is not None and base.logprobs.content is not None
    entries = base.logprobs.content
    assert len(entries) == 24
    # the tokens' bytes are the text (special tokens, which the text skips, aside)
    raw = b"".join(bytes(e.bytes or []) for e in entries if e.token not in SPECIALS)
    assert raw.decode("utf-8", "replace") == base.message.content
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0.0
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6  # greedy picks the top token
        if "\ufffd" not in e.token:  # a whole character (not part of a multi-byte one)
            assert bytes(e.bytes or []).decode() == e.token
    for m, r in results.items():
        got = r.choices[0]
        assert got.message.content == base.message.content, m
        assert got.logprobs is not None and got.logprobs.content is not None
        for a, b in zip(got.logprobs.content, entries, strict=True):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5), m
    assert results["ngram"].model_extra["speculative"]["accepted"] > 0  # type: ignore[index]

    text, extra = stream_chat(
        client,
        model="ngram",
        messages=chat("abc abc abc abc abc"),
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    assert text[0] == base.message.content
    streamed = extra[0]["logprobs"]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-5)


def test_completion_logprobs_have_tokens_offsets_and_tops(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="ngram", prompt="abc abc abc", logprobs=2, extra_body={"ignore_eos": True}, **GREEDY
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 24
    text = "".join(t for t in lp.tokens if t not in SPECIALS)
    assert text.startswith(r.choices[0].text.rstrip("\ufffd"))  # an unfinished char is held
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(24)]
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs)


# ------------------------------------------------------------------------ penalties, bias


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 1.2, "frequency_penalty": 0.6},
        {"extra_body": {"repetition_penalty": 1.6, "ignore_eos": True}},
        {"logit_bias": {"70": 4, "71": -100}},
    ],
    ids=["presence-frequency", "repetition", "logit-bias"],
)
def test_penalties_and_bias_equal_with_speculation_and_change_the_output(
    client: openai.OpenAI, fields: dict[str, Any]
) -> None:
    kwargs = {"extra_body": {"ignore_eos": True}, **fields}
    outs = {
        m: client.chat.completions.create(
            model=m, messages=chat("xyz xyz xyz xyz"), **GREEDY, **kwargs
        )
        .choices[0]
        .message.content
        for m in MODELS
    }
    assert outs["ngram"] == outs["off"] and outs["draft"] == outs["off"]
    plain = client.chat.completions.create(
        model="off", messages=chat("xyz xyz xyz xyz"), extra_body={"ignore_eos": True}, **GREEDY
    )
    assert plain.choices[0].message.content != outs["off"]
    text, _ = stream_chat(
        client, model="draft", messages=chat("xyz xyz xyz xyz"), **GREEDY, **kwargs
    )
    assert text[0] == outs["off"]


def test_logit_bias_minus_100_bans_a_token(
    client: openai.OpenAI, model_dirs: tuple[Path, Path]
) -> None:
    tok = Tokenizer(model_dirs[0])
    kwargs: dict[str, Any] = dict(prompt="aaaa", extra_body={"ignore_eos": True}, **GREEDY)
    base = client.completions.create(model="ngram", **kwargs).choices[0].text
    banned = tok.encode(base, add_special_tokens=False)[0]  # byte-level: one token per byte
    for m in MODELS:
        text = client.completions.create(model=m, logit_bias={str(banned): -100}, **kwargs)
        assert banned not in tok.encode(text.choices[0].text, add_special_tokens=False), m


# ------------------------------------------------------------------------ structured outputs


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_json_schema_output_validates_and_equals_with_speculation(
    client: openai.OpenAI, stream: bool
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    prompt = chat('{"city": "Rome", "days": 3, "rain": false} {"city": "Oslo", "days": 2, ')
    outs = {}
    for m in MODELS:
        kwargs: dict[str, Any] = dict(model=m, messages=prompt, response_format=fmt, max_tokens=64)
        if stream:
            outs[m] = stream_chat(client, temperature=0, **kwargs)[0][0]
        else:
            r = client.chat.completions.create(temperature=0, **kwargs)
            assert r.choices[0].finish_reason == "stop"
            outs[m] = r.choices[0].message.content
    assert outs["ngram"] == outs["off"] == outs["draft"]
    jsonschema.validate(json.loads(outs["off"]), SCHEMA)
    # sampled output follows the schema too
    for seed in range(3):
        r = client.chat.completions.create(
            model="draft", messages=prompt, response_format=fmt, max_tokens=64, seed=seed
        )
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)


def test_regex_grammar_and_choice_extensions(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="ngram",
        messages=chat("id?"),
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}},
        **GREEDY,
    )
    content = r.choices[0].message.content or ""
    assert len(content) == 6 and content[3] == "-" and content[:3].isupper()
    r = client.chat.completions.create(
        model="draft",
        messages=chat("pick"),
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        **GREEDY,
    )
    assert json.loads(r.choices[0].message.content or "") in ("yes", "no")
    r = client.chat.completions.create(
        model="off",
        messages=chat("say"),
        extra_body={"structured_outputs": {"grammar": 'root ::= "ab" ("c" | "d")+'}},
        **GREEDY,
    )
    content = r.choices[0].message.content or ""
    assert content.startswith("ab") and set(content[2:]) <= {"c", "d"} and len(content) > 2


# ------------------------------------------------------------------------------ tools


def test_tool_call_round_trip_with_speculation(client: openai.OpenAI) -> None:
    messages: list[Any] = chat("What is the weather in Paris?")
    calls = {}
    for m in MODELS:
        r = client.chat.completions.create(
            model=m, messages=messages, tools=[WEATHER], tool_choice="required", **TOOLS_GREEDY
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        calls[m] = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls["ngram"] == calls["off"] == calls["draft"]
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    # the tool's result goes back; the model answers (tools offered, choice auto)
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    final = client.chat.completions.create(
        model="ngram", messages=messages, tools=[WEATHER], **TOOLS_GREEDY
    )
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # streamed: the same call arrives as delta.tool_calls with finish_reason tool_calls
    _, extra = stream_chat(
        client,
        model="draft",
        messages=chat("What is the weather in Paris?"),
        tools=[WEATHER],
        tool_choice="required",
        **TOOLS_GREEDY,
    )
    streamed = extra[0]["tool_calls"]
    assert extra[0]["finish"] == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed] == calls["off"]


def test_named_tool_choice_forces_that_function(client: openai.OpenAI) -> None:
    other = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
            },
        },
    }
    r = client.chat.completions.create(
        model="ngram",
        messages=chat("hello"),
        tools=[WEATHER, other],
        tool_choice={"type": "function", "function": {"name": "add"}},
        **TOOLS_GREEDY,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and [c.function.name for c in calls] == ["add"], r.choices[0]
    assert isinstance(json.loads(calls[0].function.arguments)["a"], int)


def test_tool_call_parsing_and_streaming_agree() -> None:
    text = (
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Sure." and [c.function.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].function.arguments) == {"x": 1}
    for step in (1, 3, 7):  # any split of the stream gives the same calls
        stream = ToolCallStream()
        got_text, got_calls = "", []
        for i in range(0, len(text), step):
            t, c = stream.push(text[i : i + step])
            got_text, got_calls = got_text + t, got_calls + c
        got_text += stream.flush()
        assert got_text.strip() == "Sure."
        assert [(c.function.name, c.function.arguments) for c in got_calls] == [
            (c.function.name, c.function.arguments) for c in calls
        ]
    # a block that is not a call stays text
    assert parse_tool_calls("<tool_call>oops</tool_call>") == ("<tool_call>oops</tool_call>", [])


def test_hermes_fallback_renders_tools_calls_and_results_as_turns() -> None:
    msgs = hermes_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "21C", "tool_call_id": "c1"},
        ],
        [WEATHER],
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.") and "get_weather" in msgs[0]["content"]
    assert '"arguments": {"city": "Paris"}' in msgs[2]["content"]
    assert msgs[3]["content"] == "<tool_response>\n21C\n</tool_response>"


# ------------------------------------------------------------------------------ n, best_of


def test_n_choices_are_seeded_per_choice_and_reproducible(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        messages=chat("tell me"),
        max_tokens=12,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    r = client.chat.completions.create(model="ngram", n=3, **kwargs)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert r.usage is not None and r.usage.completion_tokens == 36
    # seeded sampling with one-hot (n-gram) drafts draws what speculation off draws
    again = client.chat.completions.create(model="off", n=3, **kwargs)
    assert [c.message.content for c in again.choices] == texts
    single = client.chat.completions.create(model="off", **{**kwargs, "seed": 8})
    assert single.choices[0].message.content == texts[1]  # choice i runs with seed + i
    streamed, _ = stream_chat(client, model="ngram", n=3, **kwargs)
    assert [streamed[i] for i in range(3)] == texts


def test_best_of_returns_the_most_likely_candidates(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="ngram",
        prompt="abc",
        max_tokens=8,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    best = client.completions.create(best_of=4, n=2, logprobs=0, **kwargs)
    every = client.completions.create(n=4, logprobs=0, **kwargs)
    assert len(best.choices) == 2

    def mean(c: Any) -> float:
        return sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)

    ranked = sorted(every.choices, key=mean, reverse=True)[:2]
    assert {c.text for c in best.choices} == {c.text for c in ranked}
