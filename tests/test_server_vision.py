"""Images through the OpenAI API: a real server on loopback serving the tiny random-weight
Qwen3.5 vision-language checkpoint, the real `openai` client unchanged. Image parts as data:
URLs (several per message and per conversation, streaming and not), `usage` counting the image
rows, the operator's URL / path policy, and every kind of bad image answered 400 naming the
part, after which the next request is served."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hybrid_models import one_thread  # noqa: F401 (autouse fixture)
from PIL import Image
from vision_models import make_vlm_dir, png

from quickdraft.engine import Engine, ServedModel, stream
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer
from quickdraft.server.media import MediaPolicy


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    _, directory = make_vlm_dir(tmp_path_factory.mktemp("vlm-srv"), out_scale=0.1)
    return load(str(directory), dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files the image server and the local-path policy hand out."""
    root = tmp_path_factory.mktemp("media")
    (root / "ok.png").write_bytes(png(7))
    (root / "big.bin").write_bytes(os.urandom(300_000))
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.png").write_bytes(png(8))
    (root / "escape.png").symlink_to(outside / "secret.png")
    return root


@pytest.fixture(scope="module")
def image_server(media_dir: Path) -> Iterator[str]:
    """A plain HTTP server on loopback serving `media_dir` (the allowed remote host)."""
    handler = functools.partial(_QuietHandler, directory=str(media_dir))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def srv(lm: LoadedModel, media_dir: Path) -> Iterator[BackgroundServer]:
    engine = Engine({"vlm": ServedModel(lm)}, max_waiting=8)
    engine.start()
    media = MediaPolicy(
        allowed_domains=("127.0.0.1",),
        allowed_local_path=media_dir,
        max_image_pixels=200 * 200,
        images_per_prompt=3,
        max_fetch_bytes=200_000,
    )
    config = ServerConfig(max_concurrency=4, media=media)
    with BackgroundServer(create_app(engine, config)) as server:
        yield server
    engine.stop()


@pytest.fixture(scope="module")
def client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def ask(client: openai.OpenAI, messages: list[Any], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=12, temperature=0, **kwargs
    )


def engine_output(lm: LoadedModel, messages: list[Any], images: list[bytes]) -> tuple[str, int]:
    """The same conversation straight through the engine: (text, prompt tokens)."""
    ids = lm.tokenizer.encode_chat(messages)
    loaded = [lm.load_image(data) for data in images]
    req = lm.new_request(ids, SamplingParams(max_tokens=12), images=loaded)
    for _ in stream(lm, req, None):
        pass
    return req.text, len(req.prompt_ids)


def test_server_image_chat_equals_the_engine(client: openai.OpenAI, lm: LoadedModel) -> None:
    """One image, then two images in one message and one in a later turn; non-streaming and
    streaming give the engine's text; usage counts every image's rows."""
    one = [{"role": "user", "content": [image(data_url(png(1))), text("what is this?")]}]
    expected, prompt_tokens = engine_output(
        lm, [{"role": "user", "content": [{"type": "image"}, text("what is this?")]}], [png(1)]
    )
    r = ask(client, one)
    assert r.choices[0].message.content == expected
    assert r.usage is not None and r.usage.prompt_tokens == prompt_tokens
    assert prompt_tokens > 16  # the image's 16 rows are counted
    chunks = list(ask(client, one, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == prompt_tokens

    jpeg = io.BytesIO()
    Image.open(io.BytesIO(png(3, 40, 24))).save(jpeg, format="JPEG")
    many = [
        {
            "role": "user",
            "content": [
                image(data_url(png(2))),
                text("and"),
                image(data_url(jpeg.getvalue(), "image/jpeg")),
            ],
        },
        {"role": "assistant", "content": "two pictures"},
        {"role": "user", "content": [text("now this one:"), image(data_url(png(4)))]},
    ]
    template = [
        {"role": "user", "content": [{"type": "image"}, text("and"), {"type": "image"}]},
        many[1],
        {"role": "user", "content": [text("now this one:"), {"type": "image"}]},
    ]
    expected, prompt_tokens = engine_output(lm, template, [png(2), jpeg.getvalue(), png(4)])
    r = ask(client, many)
    assert r.choices[0].message.content == expected
    assert r.usage is not None and r.usage.prompt_tokens == prompt_tokens


def test_server_image_from_allowed_places(
    client: openai.OpenAI, lm: LoadedModel, image_server: str, media_dir: Path
) -> None:
    """An allowed host and an allowed directory give the same answer as the data: URL."""
    reference = ask(client, [{"role": "user", "content": [image(data_url(png(7))), text("hi")]}])
    for url in (f"{image_server}/ok.png", (media_dir / "ok.png").as_uri()):
        r = ask(client, [{"role": "user", "content": [image(url), text("hi")]}])
        assert r.choices[0].message.content == reference.choices[0].message.content


def bomb() -> bytes:
    out = io.BytesIO()
    Image.new("1", (30000, 30000)).save(out, format="PNG")
    return out.getvalue()


PART = "messages[0].content[0].image_url"
# (id, message content or whole messages, the param the 400 names)
BAD_IMAGES: list[tuple[str, Any, str]] = [
    ("bad-base64", [image("data:image/png;base64,@@@not base64@@@")], PART),
    ("not-base64-data-url", [image("data:image/png,rawbytes")], PART),
    ("not-an-image-type", [image(data_url(b"hello", "text/plain"))], PART),
    ("bytes-not-an-image", [image(data_url(b"GIF89a but not really"))], PART),
    ("decompression-bomb", [image(data_url(bomb()))], PART),
    ("over-max-image-pixels", [image(data_url(png(9, 300, 300)))], PART),
    (
        "too-many-images",
        [image(data_url(png(i))) for i in range(4)],
        "messages[0].content[3].image_url",
    ),
    ("remote-host-not-allowed", [image("http://192.0.2.1/cat.png")], PART),
    ("ftp-url", [image("ftp://127.0.0.1/cat.png")], PART),
    ("path-not-a-url", [image("/etc/passwd")], PART),
    ("file-outside-allowed-path", [image("file:///etc/hostname")], PART),
    ("unknown-part-type", [{"type": "input_audio", "input_audio": {}}], "messages[0].content[0]"),
    (
        "image-in-assistant-message",
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [image(data_url(png(1)))]},
        ],
        "messages[1].content",
    ),
]


@pytest.mark.parametrize("case", BAD_IMAGES, ids=[c[0] for c in BAD_IMAGES])
def test_server_bad_image_is_400_then_serves(
    client: openai.OpenAI, srv: BackgroundServer, case: tuple[str, Any, str]
) -> None:
    _, content, param = case
    messages = (
        content if content and "role" in content[0] else [{"role": "user", "content": content}]
    )
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, messages)
    assert exc.value.param == param and param in str(exc.value.body)
    r = ask(client, [{"role": "user", "content": [image(data_url(png(1))), text("ok")]}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_server_refuses_escapes_and_oversized_fetches(
    client: openai.OpenAI, image_server: str, media_dir: Path
) -> None:
    """A symlink out of the allowed directory, a file over the fetch limit by path and by URL,
    a missing file on the allowed host: each a 400 naming the part."""
    for url in (
        (media_dir / "escape.png").as_uri(),
        (media_dir / "big.bin").as_uri(),
        f"{image_server}/big.bin",
        f"{image_server}/missing.png",
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            ask(client, [{"role": "user", "content": [image(url)]}])
        assert exc.value.param == PART, url


def test_server_default_max_tokens_counts_the_image_rows(client: openai.OpenAI) -> None:
    """Without max_tokens the server fills the context left after the prompt: the prompt as
    the model sees it, each image expanded to its rows (three images here take 54 of the
    512 positions a placeholder each would have taken 3)."""
    content = [image(data_url(png(i))) for i in range(3)] + [text("go on")]
    r = client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": content}], temperature=0
    )
    assert r.usage is not None and r.usage.prompt_tokens > 3 * 16
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 512


def metric(srv: BackgroundServer, name: str) -> float:
    """A counter's value for model "vlm" from /metrics."""
    body = httpx.get(srv.url + "/metrics").text
    key = f'quickdraft:{name}{{model_name="vlm"}}'
    line = next(row for row in body.splitlines() if row.startswith(key))
    return float(line.rsplit(" ", 1)[1])


def test_server_metrics_count_images_and_encoder_cache_hits(
    client: openai.OpenAI, srv: BackgroundServer
) -> None:
    """The same picture twice: two lookups, one of them a hit, encoder time counted."""
    queries, hits = metric(srv, "mm_cache_queries_total"), metric(srv, "mm_cache_hits_total")
    seconds = metric(srv, "image_encoder_seconds_total")
    picture = data_url(png(41, 40, 40))
    for question in ("first", "second"):
        ask(client, [{"role": "user", "content": [image(picture), text(question)]}])
    assert metric(srv, "mm_cache_queries_total") == queries + 2
    assert metric(srv, "mm_cache_hits_total") == hits + 1
    assert metric(srv, "image_encoder_seconds_total") > seconds
    assert metric(srv, "mm_cache_bytes") > 0


def test_server_several_choices_share_the_image(client: openai.OpenAI, lm: LoadedModel) -> None:
    """n = 2 greedy choices of one image turn: each choice is a request of its own with the
    image, and both equal the engine's answer."""
    messages = [{"role": "user", "content": [image(data_url(png(51))), text("twice")]}]
    expected, _ = engine_output(
        lm, [{"role": "user", "content": [{"type": "image"}, text("twice")]}], [png(51)]
    )
    r = ask(client, messages, n=2)
    assert [c.message.content for c in r.choices] == [expected, expected]


def test_messages_api_image_blocks_equal_the_chat(
    srv: BackgroundServer, client: openai.OpenAI, image_server: str
) -> None:
    """Anthropic's image blocks (a base64 source, a URL source) are the chat's image parts:
    the same answer and usage; count_tokens counts the image rows too."""
    anth = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
    data = png(7)
    b64 = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    blocks = [
        {"type": "image", "source": b64},
        {"type": "image", "source": {"type": "url", "url": image_server + "/ok.png"}},
        {"type": "text", "text": "two pictures"},
    ]
    got = anth.messages.create(
        model="vlm",
        max_tokens=12,
        messages=[{"role": "user", "content": blocks}],
        extra_body={"temperature": 0},
    )
    parts = [image(data_url(data)), image(image_server + "/ok.png"), text("two pictures")]
    want = ask(client, [{"role": "user", "content": parts}])
    assert got.content[0].text == want.choices[0].message.content
    u = got.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == want.usage.prompt_tokens
    counted = anth.messages.count_tokens(
        model="vlm", messages=[{"role": "user", "content": blocks}]
    )
    assert counted.input_tokens == want.usage.prompt_tokens
