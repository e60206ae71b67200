"""quickdraft.server.metrics: the /metrics scrape parses and its counts equal what the responses
reported (tokens, speculation counters per position, latency histogram counts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer

ADMIN = "admin-token-for-metrics"


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    engine = Engine({"tiny": ServedModel(lm, spec)})
    engine.start()
    with BackgroundServer(create_app(engine, ServerConfig(admin_token=ADMIN))) as server:
        yield server
    engine.stop()


def scrape(srv: BackgroundServer) -> dict[str, list[Any]]:
    """{sample name: [(labels, value), ...]} from a parsed scrape."""
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("quickdraft:"), family.name
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    return sum(
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    )


def test_metrics_scrape_matches_the_responses(srv: BackgroundServer) -> None:
    before = scrape(srv)
    assert value(before, "quickdraft:num_requests_running") == 0
    assert value(before, "quickdraft:spec_decode_num_draft_tokens_total") == 0
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    specs, completion_tokens = [], 0
    for i, stream in enumerate([False, True, False, True]):
        kw: dict[str, Any] = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "to be or not to be " * (i + 1)}],
            "max_tokens": 30,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        if stream:
            chunks = list(
                client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw
                )
            )
            assert chunks[-1].usage is not None
            completion_tokens += chunks[-1].usage.completion_tokens
            specs.append(chunks[-1].model_extra["speculative"])  # type: ignore[index]
        else:
            r = client.chat.completions.create(**kw)
            assert r.usage is not None
            completion_tokens += r.usage.completion_tokens
            specs.append(r.model_extra["speculative"])  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])

    m = scrape(srv)
    model = {"model_name": "tiny"}
    assert value(m, "quickdraft:request_success_total", finished_reason="length", **model) == 4
    assert value(m, "quickdraft:request_errors_total", status="404") == 1
    assert value(m, "quickdraft:generation_tokens_total", **model) == completion_tokens == 120
    drafted = sum(s["drafted"] for s in specs)
    accepted = sum(s["accepted"] for s in specs)
    assert drafted > 0 and accepted > 0, "n-gram speculation should have run"
    assert value(m, "quickdraft:spec_decode_num_draft_tokens_total", **model) == drafted
    assert value(m, "quickdraft:spec_decode_num_accepted_tokens_total", **model) == accepted
    per_pos = [0] * max(len(s["accepted_per_position"]) for s in specs)
    for s in specs:
        for i, n in enumerate(s["accepted_per_position"]):
            per_pos[i] += n
    for pos, n in enumerate(per_pos):
        got = value(
            m, "quickdraft:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)
        )
        assert got == n
    drafts = value(m, "quickdraft:spec_decode_num_drafts_total", **model)
    assert 0 < drafts <= sum(s["cycles"] for s in specs)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert value(m, f"quickdraft:{hist}_count", **model) == 4
    # every output token after the first of each request is one inter-token observation
    assert value(m, "quickdraft:inter_token_latency_seconds_count", **model) == 120 - 4

    # the admin page's live numbers come from the same counts
    state = httpx.get(
        srv.url + "/admin/api/state", headers={"Authorization": f"Bearer {ADMIN}"}
    ).json()
    stats = state["models"][0]["stats"]
    assert stats["requests"] == 4 and stats["draft_tokens"] == drafted
    assert stats["accepted_tokens"] == accepted and stats["drafts"] == drafts
    hist = stats["acceptance_histogram"]  # [j] = drafting cycles that accepted exactly j
    assert sum(hist) == drafts
    assert sum(j * n for j, n in enumerate(hist)) == accepted
