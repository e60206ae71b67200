"""/v1/completions `echo` with `logprobs` (what lm-evaluation-harness's loglikelihood tasks
send): the answer's text starts with the prompt and its logprobs with every prompt token's,
scored by the prefill (the first one has none), equal to a plain forward's log-softmax over
the prompt; the prefix cache (on by default) never serves such a prompt's rows, and n-gram
speculation leaves every figure as it is. Real server on loopback, real `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import LoadedModel, load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer

PROMPT = "the cat sat on the mat. the cat sat on the mat. the dog"


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


@pytest.fixture(scope="module")
def client(lm: LoadedModel) -> Iterator[openai.OpenAI]:
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    engine = Engine({"off": ServedModel(lm), "ngram": ServedModel(lm, ngram)})
    engine.start()
    with BackgroundServer(create_app(engine, ServerConfig())) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    engine.stop()


def reference(lm: LoadedModel, ids: list[int], top: int) -> tuple[list[float], list[Any]]:
    """Each prompt token's logprob (after the first) and the `top` best of its row, from one
    whole-prompt forward."""
    cache = lm.model.new_cache(len(ids) + 1)
    logits = lm.model(
        torch.tensor(ids), [cache], [len(ids)], logit_rows=torch.arange(len(ids) - 1)
    ).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    return chosen, logp.topk(top, dim=-1).indices.tolist()


def test_echo_scores_the_prompt_as_a_plain_forward(client: openai.OpenAI, lm: LoadedModel) -> None:
    ids = lm.tokenizer.encode(PROMPT, parse_special=False)
    want, want_top = reference(lm, ids, 3)
    # a plain request first: the prompt's blocks enter the prefix cache, which echo must skip
    client.completions.create(model="off", prompt=PROMPT, max_tokens=1, temperature=0)
    answers = []
    for model in ("off", "ngram"):
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=3
        )
        choice = r.choices[0]
        assert choice.text.startswith(PROMPT)
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert lp.top_logprobs is not None and lp.text_offset is not None
        n = len(ids)
        assert len(lp.tokens) == n + len(lp.tokens[n:]) and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and lp.text_offset[:2] == [0, 1]
        got = lp.token_logprobs[1:n]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5  # type: ignore[operator]
        for row, best in zip(lp.top_logprobs[1:n], want_top, strict=True):
            # keyed by text, as OpenAI's format is: byte tokens that decode alike share a key
            assert row is not None and set(row) == {lm.tokenizer.token_text(t) for t in best}
        assert "".join(lp.tokens[:n]) == PROMPT  # byte tokens of an ASCII prompt
        assert r.usage is not None and r.usage.prompt_tokens == n
        answers.append((choice.text, lp.token_logprobs))
    assert answers[0] == answers[1]


def test_echo_without_logprobs(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="off", prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model="off", prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None


def test_echo_streams_the_prompt_first(client: openai.OpenAI) -> None:
    """Streamed, the prompt (with its logprobs) comes as the first chunk; the chunks add up to
    the one-body answer: text, tokens, logprobs and offsets."""
    args: dict[str, Any] = dict(model="ngram", prompt=PROMPT, max_tokens=6, temperature=0)
    whole = client.completions.create(echo=True, logprobs=2, **args).choices[0]
    chunks = [
        c.choices[0]
        for c in client.completions.create(echo=True, logprobs=2, stream=True, **args)
        if c.choices
    ]
    assert chunks[0].text == PROMPT
    assert "".join(c.text for c in chunks) == whole.text
    assert whole.logprobs is not None
    got: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.logprobs is not None:
            for key in got:
                got[key] += getattr(c.logprobs, key) or []
    assert got["tokens"] == whole.logprobs.tokens
    assert got["token_logprobs"] == whole.logprobs.token_logprobs
    assert got["text_offset"] == whole.logprobs.text_offset
    plain = client.completions.create(echo=True, stream=True, **args)
    assert "".join(c.choices[0].text for c in plain if c.choices) == whole.text


def test_vllm_prompt_logprobs_extension(client: openai.OpenAI, lm: LoadedModel) -> None:
    """vLLM's `prompt_logprobs` (extra body), on completions and chat, in one body and in the
    first chunk of a stream: None first, then per prompt token its id's logprob and rank
    (a plain forward's) beside its best alternatives."""
    ids = lm.tokenizer.encode(PROMPT, parse_special=False)
    cache = lm.model.new_cache(len(ids) + 1)
    logits = lm.model(
        torch.tensor(ids), [cache], [len(ids)], logit_rows=torch.arange(len(ids) - 1)
    ).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    extra = {"prompt_logprobs": 2}
    r = client.completions.create(
        model="ngram", prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra
    )
    got = r.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert got[0] is None and len(got) == len(ids)
    for i, row in enumerate(got[1:]):
        token = ids[i + 1]
        mine = row[str(token)]
        assert abs(mine["logprob"] - float(logp[i, token])) < 1e-5
        assert mine["rank"] == int((logp[i] > logp[i, token]).sum()) + 1
        best = logp[i].topk(2).indices.tolist()
        assert {str(t) for t in best} <= set(row) and len(row) <= 3
        assert row[str(best[0])]["rank"] == 1
    stream = client.completions.create(
        model="off", prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra, stream=True
    )
    first = next(iter(stream))
    assert first.choices[0].model_extra["prompt_logprobs"] == got  # type: ignore[index]
    chat = client.chat.completions.create(
        model="off",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        temperature=0,
        extra_body=extra,
    )
    rows = chat.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert chat.usage is not None and len(rows) == chat.usage.prompt_tokens and rows[0] is None
