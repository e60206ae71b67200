"""quickdraft.cluster: 2 engine replicas x 1 thread on a real local Ray Serve, SmolLM2-135M,
driven through Serve's HTTP proxy by the real `openai` client, against the single-process
server on the same weights.

One Ray instance serves the whole session (2 CPUs, no dashboard); the replica-kill test runs
last, since it leaves a replica freshly replaced. Skipped, with the reason, only where the
`cluster` extra is missing or Ray cannot start.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from serve_process import free_port

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer, ServeOptions

ray = pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

pytestmark = pytest.mark.real
MODEL, DTYPE = "smollm2-135m", "gguf"
KEY, ADMIN = "sk-cluster", "cluster-admin"
NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False)
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 24}
REPLICA = "x-quickdraft-replica"
SYSTEM = (
    "You are a careful assistant for a team of engineers. Answer in short, plain sentences, "
    "quote code exactly, and say so when you do not know."
)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    from quickdraft.cluster.deploy import ClusterOptions, build_app

    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=128 * 2**20,
        )
    except Exception as exc:  # no shared memory, no free ports, a sandbox without fork, ...
        pytest.skip(f"Ray cannot start here: {type(exc).__name__}: {exc}")
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        opts = ServeOptions(MODEL, DTYPE, NGRAM, served_name=MODEL, shutdown_timeout_s=5)
        settings = tmp_path_factory.mktemp("cluster") / "settings.json"
        config = ServerConfig(api_key=KEY, admin_token=ADMIN, settings_path=settings)
        app = build_app(opts, config, ClusterOptions(replicas=2, threads_per_replica=1))
        serve.run(app, name="quickdraft", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def single(cluster: str) -> Iterator[str]:
    """The single-process server on the same model, speculation and key (started after the
    cluster, so the two do not load at once on 2 cores)."""
    engine = Engine({MODEL: ServedModel(load(MODEL, DTYPE, progress=False), NGRAM)})
    engine.start()
    with BackgroundServer(create_app(engine, ServerConfig(api_key=KEY))) as srv:
        yield srv.url
    engine.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def admin(url: str, method: str = "GET", path: str = "state", **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    return httpx.request(method, f"{url}/admin/api/{path}", headers=headers, timeout=120, **kw)


def conversation(topic: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Tell me about {topic}, in two sentences."},
    ]


def test_cluster_greedy_outputs_equal_the_single_process_server(cluster: str, single: str) -> None:
    messages = conversation("the Python list type")
    got, want = client(cluster), client(single)
    one = got.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    ref = want.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert one.choices[0].message.content == ref.choices[0].message.content
    assert one.choices[0].finish_reason == ref.choices[0].finish_reason
    assert one.usage is not None and ref.usage is not None
    assert one.usage.completion_tokens == ref.usage.completion_tokens
    spec = one.model_extra["speculative"]  # type: ignore[index]
    assert spec["method"] == "ngram" and spec["cycles"] > 0

    stream = got.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].model_extra["speculative"]  # type: ignore[index]

    prompt = "def fibonacci(n):\n    "
    c1 = got.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    c2 = want.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert c1.choices[0].text == c2.choices[0].text

    # the Responses API and /tokenize through the ingress: the chat path's answer and ids
    r = got.responses.create(
        model=MODEL,
        input=messages[1]["content"],
        instructions=SYSTEM,
        max_output_tokens=GREEDY["max_tokens"],
        temperature=0,
    )
    assert r.output_text == ref.choices[0].message.content
    # stored in the ingress: retrieved, and continued wherever the next turn runs
    assert got.responses.retrieve(r.id).output_text == r.output_text
    more: dict[str, Any] = dict(model=MODEL, max_output_tokens=8, temperature=0)
    on = got.responses.create(input="and then?", previous_response_id=r.id, **more)
    turns: list[Any] = [
        {"role": "user", "content": messages[1]["content"]},
        {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "and then?"},
    ]
    assert on.output_text == got.responses.create(input=turns, store=False, **more).output_text
    later = got.responses.create(
        input="and then?", previous_response_id=r.id, background=True, **more
    )
    deadline = time.monotonic() + 120
    while (polled := got.responses.retrieve(later.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, polled
        time.sleep(0.1)
    assert polled.output_text == on.output_text  # run on a replica after its request ended
    streamed = list(
        got.responses.create(
            input="and then?", previous_response_id=r.id, background=True, stream=True, **more
        )
    )
    assert streamed[-1].response.output_text == on.output_text
    resumed = got.responses.retrieve(streamed[0].response.id, stream=True, starting_after=1)
    assert [e.sequence_number for e in resumed] == [e.sequence_number for e in streamed[2:]]
    headers = {"Authorization": f"Bearer {KEY}"}
    ids = httpx.post(
        cluster + "/tokenize", json={"model": MODEL, "messages": messages}, headers=headers
    ).json()
    assert ids["count"] == ref.usage.prompt_tokens
    # Anthropic's Messages API (x-api-key) and llama-server's /completion through the ingress
    anth = anthropic.Anthropic(base_url=cluster, api_key=KEY, max_retries=0)
    m = anth.messages.create(
        model=MODEL,
        system=SYSTEM,
        messages=[{"role": "user", "content": messages[1]["content"]}],
        max_tokens=GREEDY["max_tokens"],
        extra_body={"temperature": 0},
    )
    assert m.content[0].text == ref.choices[0].message.content
    native = {"model": MODEL, "prompt": prompt, "n_predict": 24, "temperature": 0}
    n1, n2 = (
        httpx.post(url + "/completion", json=native, headers=headers).json()
        for url in (cluster, single)
    )
    assert n1["content"] == n2["content"] and n1["tokens_predicted"] == n2["tokens_predicted"]
    # several calls for one HTTP request (n choices, embedding inputs) each routed: Ray Serve
    # gave them one internal request id, and its router then left all but one unrouted
    two = got.completions.create(model=MODEL, prompt=prompt, n=2, **GREEDY)
    assert [c.text for c in two.choices] == [c1.choices[0].text] * 2
    # /v1/embeddings through the ingress: each input runs on a replica, the vectors in order
    texts = [prompt, SYSTEM]
    e1, e2 = (client(url).embeddings.create(model=MODEL, input=texts) for url in (cluster, single))
    assert e1.usage.prompt_tokens == e2.usage.prompt_tokens
    for a, b in zip(e1.data, e2.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)


def test_cluster_routes_a_conversation_to_one_replica_and_reuses_its_cache(cluster: str) -> None:
    api = client(cluster)
    messages = conversation("hash tables")
    replicas, cached = set(), []
    for turn in range(3):
        raw = api.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, **GREEDY
        )
        replicas.add(raw.headers[REPLICA])
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"And what about case {turn}?"},
        ]
    assert len(replicas) == 1, replicas  # every turn on the conversation's home replica
    assert cached[1] > 0 and cached[2] > cached[1]  # its prefix cache held the earlier turns
    (home,) = replicas
    metrics = httpx.get(cluster + "/metrics", timeout=30).text
    routed = [
        line
        for line in metrics.splitlines()
        if line.startswith("quickdraft:replica_requests_total") and f'"{home}"' in line
    ]
    assert routed and float(routed[0].split()[-1]) >= 3, routed
    assert "quickdraft:request_success_total" in metrics


def test_cluster_errors_and_auth_are_the_single_servers(cluster: str) -> None:
    body = {"model": MODEL, "messages": conversation("x"), "max_tokens": 10**6}
    r = httpx.post(cluster + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(cluster + "/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    body = {**body, "model": "nope", "max_tokens": 4}
    r = httpx.post(cluster + "/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_cluster_admin_change_reaches_every_replica(cluster: str) -> None:
    state = admin(cluster).json()
    settings = next(m for m in state["models"] if m["name"] == MODEL)["settings"]
    r = admin(cluster, "PUT", f"models/{MODEL}", json={**settings, "enabled": False})
    assert r.status_code == 200, r.text
    try:
        api, seen = client(cluster), set()
        for i in range(16):  # distinct conversations until both replicas have answered
            raw = api.chat.completions.with_raw_response.create(
                model=MODEL, messages=conversation(f"topic number {i}"), **GREEDY
            )
            seen.add(raw.headers[REPLICA])
            assert raw.parse().model_extra["speculative"]["method"] == "none"  # type: ignore[index]
            if len(seen) == 2:
                break
        assert len(seen) == 2
        replicas = admin(cluster).json()["replicas"]
        assert {r["replica"] for r in replicas} == seen
    finally:
        r = admin(cluster, "PUT", f"models/{MODEL}", json=settings)
        assert r.status_code == 200, r.text


def test_cluster_replica_killed_mid_stream_ends_cleanly_and_is_replaced(cluster: str) -> None:
    from ray import serve

    body = {
        "model": MODEL,
        "messages": conversation("the history of computing"),
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    auth = {"Authorization": f"Bearer {KEY}"}
    events: list[str] = []
    with httpx.stream(
        "POST", cluster + "/v1/chat/completions", json=body, headers=auth, timeout=120
    ) as r:
        assert r.status_code == 200
        victim = r.headers[REPLICA]
        pid = next(x["pid"] for x in admin(cluster).json()["replicas"] if x["replica"] == victim)
        lines = r.iter_lines()
        for line in lines:  # a few tokens in: the request is decoding on the victim
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 4:
                break
        os.kill(pid, signal.SIGKILL)
        events += [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "replica_lost", last

    api = client(cluster)
    for i in range(4):  # the survivor serves (requests that met the dead one are sent again)
        reply = api.chat.completions.create(
            model=MODEL, messages=conversation(f"recovery {i}"), **GREEDY
        )
        assert reply.choices[0].finish_reason in ("stop", "length")

    deadline = time.monotonic() + 180  # a liveness bound for Ray's replacement, not a speed claim
    while True:
        status = serve.status().applications["quickdraft"].deployments["EngineReplica"]
        if status.replica_states.get("RUNNING", 0) == 2:
            break
        assert time.monotonic() < deadline, status
        time.sleep(1)


def test_cluster_options_refuse_bad_values(tmp_path: Path) -> None:
    from quickdraft.cluster.deploy import ClusterOptions

    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        ClusterOptions(replicas=0)
    with pytest.raises(ValueError, match="--max-replicas"):
        ClusterOptions(replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="--threads-per-replica"):
        ClusterOptions(threads_per_replica=0)


def test_router_rendezvous_moves_only_the_lost_replicas_keys() -> None:
    from quickdraft.cluster.router import rendezvous

    replicas = [f"replica-{i}" for i in range(4)]
    keys = [f"conversation-{i}" for i in range(400)]
    home = {k: rendezvous(k, replicas)[0] for k in keys}
    assert set(home.values()) == set(replicas)  # every replica is some conversation's home
    after = {k: rendezvous(k, replicas[:3])[0] for k in keys}
    moved = [k for k in keys if after[k] != home[k]]
    assert moved and all(home[k] == "replica-3" for k in moved)  # only the lost one's keys
    assert all(after[k] == rendezvous(k, replicas)[1] for k in moved)  # to their second choice
