"""Cross-request isolation: the n-gram drafter's index of finished outputs is per tenant.

A real uvicorn server on loopback and the real `openai` client. Drafts never change the text,
but they show in the response's `speculative` block (drafted / accepted / cycles), so the block
is the probe an attacker would use: a tenant who sends the prompt another tenant sent gets the
very same block as a tenant the server has never seen (nothing of the other's output drafted),
while the first tenant's own repeat drafts from its earlier output. Fixed k, greedy, one request
at a time: the counters are deterministic, no timing is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import LoadedModel, load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer

NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
KEYS = ("key-a", "key-b", "key-c")
PROMPT = "The secret code word is"


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


@contextmanager
def server(lm: LoadedModel, scope: str) -> Iterator[str]:
    """A fresh engine (empty shared index) behind a server accepting KEYS."""
    engine = Engine({"tiny": ServedModel(lm, NGRAM)}, max_waiting=8)
    engine.start()
    try:
        app = create_app(engine, ServerConfig(api_key=",".join(KEYS), ngram_shared_scope=scope))
        with BackgroundServer(app) as srv:
            yield srv.url + "/v1"
    finally:
        engine.stop()


def complete(url: str, key: str, user: str | None = None) -> tuple[str, dict[str, Any]]:
    """PROMPT greedily as tenant `key` (/ `user`): the text and the speculative block."""
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
    extra: dict[str, Any] = {} if user is None else {"user": user}
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=48,
        temperature=0,
        extra_body={"ignore_eos": True},
        **extra,
    )
    spec = r.model_extra["speculative"]  # type: ignore[index]
    block = {k: spec[k] for k in ("drafted", "accepted", "cycles", "accepted_per_position")}
    return r.choices[0].text, block


def test_server_ngram_shared_index_never_drafts_another_keys_output(lm: LoadedModel) -> None:
    with server(lm, "tenant") as url:
        text_a, fresh = complete(url, "key-a")
        # key-b asks what key-a asked: its reply is key-a's text, but not one accepted draft
        # more than a tenant the server has never seen gets (none came from key-a's output)
        text_b, block_b = complete(url, "key-b")
        assert text_b == text_a and block_b == fresh
        # key-a's own repeat drafts from its earlier output: the index works, within a tenant
        text_again, block_again = complete(url, "key-a")
        assert text_again == text_a and block_again["accepted"] > fresh["accepted"]
        # and key-c, the third tenant, learns nothing from either
        assert complete(url, "key-c") == (text_a, fresh)
        with pytest.raises(openai.AuthenticationError):  # each key is one key, not the list
            complete(url, ",".join(KEYS))


def test_server_ngram_shared_index_keeps_users_of_one_key_apart(lm: LoadedModel) -> None:
    """Within one key, the `user` field (OpenAI's end-user id) names the tenant."""
    with server(lm, "tenant") as url:
        text, fresh = complete(url, "key-a", user="alice")
        assert complete(url, "key-a", user="bob") == (text, fresh)
        assert complete(url, "key-a") == (text, fresh)  # no user: the key's own tenant
        _, alice_again = complete(url, "key-a", user="alice")
        assert alice_again["accepted"] > fresh["accepted"]


def test_server_ngram_shared_scope_global_shares_across_keys(lm: LoadedModel) -> None:
    """The switch: one index for all, so key-b drafts from key-a's output (what tenant scope
    stops, and what the tests above would see without it)."""
    with server(lm, "global") as url:
        text_a, fresh = complete(url, "key-a")
        text_b, block_b = complete(url, "key-b")
        assert text_b == text_a and block_b["accepted"] > fresh["accepted"]


def test_server_config_rejects_unknown_shared_scope() -> None:
    with pytest.raises(ValueError, match="ngram_shared_scope"):
        ServerConfig(ngram_shared_scope="everyone")
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key=" , ")
