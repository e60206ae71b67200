"""Fill-in-the-middle: the FIM tokens found as llama.cpp finds them (checked against its own
vocabulary code through llama-cpp-python on the real Qwen2.5-Coder file), llama-server's /infill
prompt layout and cuts, OpenAI's `suffix` on /v1/completions, llama-server's /infill body and
stream, its n_indent / t_max_predict_ms rules, and vLLM's `stop_token_ids`. Real server on
loopback (httpx, the real `openai` client) over a tiny random model whose tokenizer has
Qwen2.5-Coder's FIM tokens, with n-gram speculation on and off."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import make_tiny_hf_model, write_tiny_tokenizer

from quickdraft import hub
from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel, stream
from quickdraft.infill import (
    CHUNK_SEPARATOR,
    INFILL_BATCH,
    Chunk,
    FimTokens,
    InfillError,
    completion_ids,
    infill_ids,
)
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.llama_api import InfillRequest, _Rules
from quickdraft.server.main import BackgroundServer
from quickdraft.tokenizer import Tokenizer

FIM = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")
REPO = ("<|repo_name|>", "<|file_sep|>")
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


def fim_dir(root: Path, specials: tuple[str, ...]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    make_tiny_hf_model("qwen2", root, seed=3)
    write_tiny_tokenizer(root, specials)
    return root


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load(str(fim_dir(tmp_path_factory.mktemp("fim"), FIM + REPO)), "fp32", progress=False)


@pytest.fixture(scope="module")
def url(lm: LoadedModel, tiny_model_dir: Path) -> Iterator[str]:
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    plain = load(str(tiny_model_dir), "fp32", progress=False)  # no FIM tokens
    engine = Engine(
        {"off": ServedModel(lm), "ngram": ServedModel(lm, ngram), "plain": ServedModel(plain)}
    )
    engine.start()
    with BackgroundServer(create_app(engine, ServerConfig())) as srv:
        yield srv.url
    engine.stop()


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


@pytest.mark.real
def test_fim_tokens_are_the_ones_llama_cpp_finds() -> None:
    """Qwen2.5-Coder's GGUF: the ids llama.cpp's vocabulary loader picks for each FIM role,
    and the end-of-generation set it puts the pad / repo / file tokens in."""
    llama_cpp = pytest.importorskip("llama_cpp")
    gguf = hub.gguf_file("qwen2.5-coder-0.5b", progress=False)
    ref = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    fim = FimTokens.of(Tokenizer(hub.resolve("qwen2.5-coder-0.5b", "fp32", progress=False)))
    roles = ("pre", "suf", "mid", "pad", "rep", "sep")
    want = [getattr(llama_cpp, f"llama_vocab_fim_{r}")(vocab) for r in roles]
    assert [fim.prefix, fim.suffix, fim.middle, fim.pad, fim.repo, fim.file] == want
    assert fim.stops and all(llama_cpp.llama_vocab_is_eog(vocab, t) for t in fim.stops)
    with pytest.raises(InfillError, match=r"prefix .* suffix .* middle"):
        FimTokens.of(Tokenizer(hub.resolve("smollm2-135m", "fp32", progress=False)))


def test_infill_layout_and_cuts_are_llama_servers(lm: LoadedModel) -> None:
    tok = lm.tokenizer
    fim = FimTokens.of(tok)
    assert fim.stops == (fim.pad, fim.repo, fim.file)

    def text(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False, parse_special=False)

    got = infill_ids(tok, fim, PREFIX, SUFFIX, [Chunk("x = 1\n", "util.py")], "<|fim_pad|>ret")
    assert fim.repo is not None and fim.file is not None
    assert got == [
        *[fim.repo, *text("myproject\n")],
        *[fim.file, *text("util.py\n"), *text("x = 1\n")],
        *[fim.file, *text("filename\n")],
        *[fim.prefix, *text(PREFIX), fim.pad, *text("ret")],  # the prompt reads special tokens
        *[fim.suffix, *text(SUFFIX), fim.middle],
    ]
    # --spm-infill: the suffix part first, the prefix part (with the prompt) after it
    spm = infill_ids(tok, fim, PREFIX, SUFFIX, [Chunk("x = 1\n", "util.py")], "ret", spm=True)
    head = spm.index(fim.suffix)
    assert spm[head:] == [
        *[fim.suffix, *text(SUFFIX)],
        *[fim.prefix, *text(PREFIX), *text("ret"), fim.middle],
    ]
    assert spm[:head] == got[: got.index(fim.prefix)]  # the repository part as before
    # the cuts: the prefix's last 3/4 batch, the suffix's first quarter less the prompt and 2,
    # the extra chunks' last tokens after a batch and twice the answer
    long_prefix, long_suffix = "a" * 3000, "b" * 3000
    chunk = Chunk("c" * 500, "big.py")
    got = infill_ids(tok, fim, long_prefix, long_suffix, [chunk], "pq", INFILL_BATCH + 300, 100)
    before = 3 * INFILL_BATCH // 4
    after = INFILL_BATCH // 4 - 2 - 2
    extra = 300 - 200
    assert len(got) == extra + 1 + before + 2 + 1 + after + 1
    assert got[extra] == fim.prefix and got[extra + 1 + before + 2] == fim.suffix
    whole = [fim.repo, *text("myproject\n"), fim.file, *text("big.py\n"), *text(chunk.text)]
    whole += [fim.file, *text("filename\n")]
    assert got[:extra] == whole[-extra:]  # the end of the extra context
    assert got[-1] == fim.middle
    # a model without repository / file tokens: the chunks behind llama-server's separator
    bare = FimTokens(fim.prefix, fim.suffix, fim.middle)
    got = infill_ids(tok, bare, "p", "s", [Chunk("x")])
    fill = [fim.prefix, *text("p"), fim.suffix, *text("s"), fim.middle]
    assert got == [*text(CHUNK_SEPARATOR), *text("x"), *fill]


def test_completion_suffix_is_the_fim_prompt(url: str, lm: LoadedModel) -> None:
    tok = lm.tokenizer
    fim = FimTokens.of(tok)
    ids = completion_ids(tok, fim, tok.encode(PREFIX, add_special_tokens=False), SUFFIX)
    assert ids[0] == fim.prefix and ids[-1] == fim.middle
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    for model in ("off", "ngram"):
        got = client.completions.create(
            model=model, prompt=PREFIX, suffix=SUFFIX, max_tokens=24, temperature=0
        )
        same = client.completions.create(
            model=model, prompt=ids, max_tokens=24, temperature=0, extra_body=_stops(fim)
        )
        assert got.usage is not None and got.usage.prompt_tokens == len(ids)
        assert got.choices[0].text == same.choices[0].text
    # the pad token ends the answer as the end of text does
    forced = client.completions.create(
        model="off",
        prompt=PREFIX,
        suffix=SUFFIX,
        max_tokens=8,
        temperature=0,
        logit_bias={str(fim.pad): 100},
    )
    assert forced.choices[0].text == "" and forced.choices[0].finish_reason == "stop"
    bad = post(url, "/v1/completions", {"model": "plain", "prompt": "a", "suffix": "b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "suffix"
    assert "cannot fill in the middle" in bad.json()["error"]["message"]
    both = post(
        url, "/v1/completions", {"model": "off", "prompt": "a", "suffix": "b", "echo": True}
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "echo"


def _stops(fim: FimTokens) -> dict[str, Any]:
    return {"stop_token_ids": list(fim.stops)}


def test_stop_token_ids_end_the_output(url: str, lm: LoadedModel) -> None:
    """vLLM's stop_token_ids: the output ends before the first of them, ignore_eos or not."""
    prompt = lm.tokenizer.encode("hello")
    req = lm.new_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in stream(lm, req, None, None):
        pass
    out = req.output_ids
    stop_at = next(i for i in range(2, len(out)) if out[i] not in out[:i])
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    for model in ("off", "ngram"):
        got = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"stop_token_ids": [out[stop_at]], "ignore_eos": True},
        )
        assert got.choices[0].finish_reason == "stop"
        assert got.usage is not None and got.usage.completion_tokens == stop_at
    body = {"model": "off", "prompt": "a", "stop_token_ids": [lm.vocab_size]}
    bad = post(url, "/v1/completions", body)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"


def test_infill_body_and_stream(url: str, lm: LoadedModel) -> None:
    tok = lm.tokenizer
    fim = FimTokens.of(tok)
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": extra,
        "prompt": "ret",
        "n_predict": 20,
        "temperature": 0,
        "cache_prompt": True,  # llama-server's fields that change nothing here
        "id_slot": 0,
        "samplers": ["top_k", "top_p", "infill"],
    }
    chunks = [Chunk(**c) for c in extra]
    ids = infill_ids(tok, fim, PREFIX, SUFFIX, chunks, "ret", lm.context_length, 20)
    for model in ("off", "ngram"):
        got = post(url, "/infill", {**body, "model": model}).json()
        same = post(
            url,
            "/v1/completions",
            {"model": model, "prompt": ids, "max_tokens": 20, "temperature": 0, **_stops(fim)},
        ).json()
        assert got["content"] == same["choices"][0]["text"]
        assert got["stop"] is True and got["tokens_evaluated"] == len(ids)
        assert got["tokens_predicted"] == same["usage"]["completion_tokens"]
        assert got["stop_type"] == ("limit" if got["tokens_predicted"] == 20 else "eos")
        assert got["prompt"] == tok.decode(ids, skip_special_tokens=False)
        t = got["timings"]
        assert t["predicted_n"] == got["tokens_predicted"] and t["prompt_ms"] > 0
        assert t["prompt_n"] + t["cache_n"] == len(ids)
        assert got["has_new_line"] == ("\n" in got["content"])
        with httpx.stream(
            "POST", url + "/infill", json={**body, "model": model, "stream": True}
        ) as r:
            events = [line for line in r.iter_lines() if line]
        parts = [json.loads(e.removeprefix("data: ")) for e in events]
        assert all(e.startswith("data: ") for e in events)
        assert [p["stop"] for p in parts] == [False] * (len(parts) - 1) + [True]
        assert "".join(p["content"] for p in parts) == got["content"]
        assert parts[-1]["tokens_predicted"] == got["tokens_predicted"]
    # one model served: /infill needs no `model`; llama-server's response_fields
    picked = post(
        url,
        "/infill",
        {**body, "model": "off", "response_fields": ["content", "timings/predicted_n", "nope"]},
    ).json()
    assert set(picked) == {"content", "timings/predicted_n"}
    # a stop string: stop_type "word" and the word
    word = got["content"][3:5]
    if word and word not in got["content"][:3]:
        stopped = post(url, "/infill", {**body, "model": "off", "stop": [word]}).json()
        assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
        assert stopped["content"] == got["content"][: got["content"].index(word)]


def test_infill_spm_server_puts_the_suffix_first(lm: LoadedModel) -> None:
    """`quickdraft serve --spm-infill` (ServerConfig.spm_infill): /infill evaluates the
    suffix-prefix-middle prompt, as llama-server started with --spm-infill does."""
    tok = lm.tokenizer
    fim = FimTokens.of(tok)
    engine = Engine({"off": ServedModel(lm)})
    engine.start()
    try:
        with BackgroundServer(create_app(engine, ServerConfig(spm_infill=True))) as srv:
            body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4}
            got = post(srv.url, "/infill", {**body, "temperature": 0}).json()
    finally:
        engine.stop()
    ids = infill_ids(tok, fim, PREFIX, SUFFIX, (), "", lm.context_length, 4, spm=True)
    assert ids.index(fim.suffix) < ids.index(fim.prefix)
    assert got["prompt"] == tok.decode(ids, skip_special_tokens=False)
    assert got["tokens_evaluated"] == len(ids)


def test_infill_bad_bodies(url: str) -> None:
    base = {"model": "off", "input_prefix": "a", "input_suffix": "b"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({k: v for k, v in base.items() if k != "input_suffix"}, "input_suffix"),
        ({**base, "input_extra": [{"filename": "x"}]}, "input_extra[0].text"),
        ({**base, "n_indent": -1}, "n_indent"),
        ({**base, "top_k_typo": 3}, "top_k_typo"),
        ({**base, "model": "plain"}, "input_prefix"),  # no FIM tokens
        ({k: v for k, v in base.items() if k != "model"}, "model"),  # three models served
    ]
    for body, param in cases:
        r = post(url, "/infill", body)
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param, r.json()


def test_code_completion_stop_rules() -> None:
    """llama-server's n_indent: a line after the first whose indentation is under n_indent
    ends the answer before its first character (once that character is there);
    t_max_predict_ms: past the limit, a new line ends it."""
    body = InfillRequest(input_prefix="", input_suffix="", n_indent=4)
    rules = _Rules(body)
    text = "x = 1\n    y = 2\n  "
    assert rules.cut(text, 0) is None  # the third line's first character is yet to come
    text += "z"
    assert rules.cut(text, len(text) - 1) == len("x = 1\n    y = 2\n  ")
    assert _Rules(body).cut("  a\n\tb", 0) == len("  a\n\t")  # a tab counts as one
    timed = _Rules(InfillRequest(input_prefix="", input_suffix="", t_max_predict_ms=1))
    assert timed.cut("a", 0) is None
    time.sleep(0.01)
    assert timed.cut("ab", 1) is None  # no new line yet
    assert timed.cut("ab\nc", 2) == 4


def test_native_completion_is_the_completion_of_its_prompt(url: str, lm: LoadedModel) -> None:
    """llama-server's /completion: a text prompt read with special tokens and the tokenizer's
    own additions, or token ids; the body, the stream, n_probs, grammar and json_schema."""
    tok = lm.tokenizer
    prompt = "def f(x):<|fim_pad|>"
    ids = tok.encode(prompt, add_special_tokens=True, parse_special=True)
    assert FimTokens.of(tok).pad in ids  # read as the token, as llama-server reads it
    for model in ("off", "ngram"):
        got = post(
            url,
            "/completion",
            {"model": model, "prompt": prompt, "n_predict": 16, "temperature": 0, "n_probs": 2},
        ).json()
        same = post(
            url,
            "/v1/completions",
            {"model": model, "prompt": ids, "max_tokens": 16, "temperature": 0, "logprobs": 2},
        ).json()["choices"][0]
        assert got["content"] == same["text"] and got["tokens_evaluated"] == len(ids)
        probs = got["completion_probabilities"]
        assert len(probs) == got["tokens_predicted"]
        assert [p["logprob"] for p in probs] == pytest.approx(same["logprobs"]["token_logprobs"])
        assert all(len(p["top_logprobs"]) == 2 and bytes(p["bytes"]) for p in probs)
        by_ids = post(
            url, "/completions", {"model": model, "prompt": ids, "n_predict": 16, "temperature": 0}
        ).json()
        assert by_ids["content"] == got["content"]
        with httpx.stream(
            "POST",
            url + "/completion",
            json={"model": model, "prompt": ids, "n_predict": 16, "temperature": 0, "stream": True},
        ) as r:
            parts = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line]
        assert "".join(p["content"] for p in parts) == got["content"] and parts[-1]["stop"]
    yes_no = post(
        url,
        "/completion",
        {"model": "off", "prompt": "ok?", "grammar": 'root ::= "yes" | "no"', "temperature": 0},
    ).json()
    assert yes_no["content"] in ("yes", "no") and yes_no["stop_type"] == "eos"
    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 2]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    shaped = post(
        url,
        "/completion",
        {"model": "off", "prompt": "ok?", "json_schema": schema, "temperature": 0, "n_predict": 64},
    ).json()
    assert json.loads(shaped["content"]) in ({"n": 1}, {"n": 2})
    for body, param in [
        ({"prompt": [lm.vocab_size]}, "prompt"),
        ({"prompt": "a", "grammar": "root ::= x", "json_schema": schema}, "grammar"),
        ({"prompt": "a", "grammar": "root ::= ("}, "grammar"),
        ({"prompt": ""}, "prompt"),
    ]:
        r = post(url, "/completion", {"model": "off", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_cli_generate_fills_in_the_middle(tmp_path: Path, lm: LoadedModel) -> None:
    """`quickdraft generate --suffix`: the prompt before the gap, the answer, the suffix; a
    model without FIM tokens is a clear error."""
    from test_generate import cli

    model = fim_dir(tmp_path / "fim", FIM + REPO)
    args = ["generate", "--model", str(model), "--dtype", "fp32", "--max-tokens", "6"]
    res = cli(*args, "--suffix", SUFFIX, PREFIX)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(PREFIX) and res.stdout.endswith(SUFFIX + "\n")
    fim = FimTokens.of(lm.tokenizer)
    before = lm.tokenizer.encode(PREFIX, add_special_tokens=False)
    assert f"prompt {len(completion_ids(lm.tokenizer, fim, before, SUFFIX))} tok" in res.stderr
    plain = fim_dir(tmp_path / "plain", ())
    res = cli("generate", "--model", str(plain), "--dtype", "fp32", "--suffix", "x", "y")
    assert res.returncode == 2 and "cannot fill in the middle" in res.stderr
