"""/v1/embeddings on a real server on loopback with the openai client: the vectors equal the
pooled post-final-norm states of transformers' model (last, mean, cls), base64 and floats,
`dimensions`, `normalize`, token-id inputs and truncation as vLLM has them, bad inputs as 400s
naming the input; in the engine, pooled rows do not depend on chunking, on what else runs or
on the prefix cache (bf16, batch-invariant kernels), and never speculate; on a GGUF file that
declares its pooling, the vectors equal llama.cpp's (llama-cpp-python) on the same file."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from quickdraft.config import PrefixCacheConfig, SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.engine.scheduler import SchedulerConfig
from quickdraft.loading import LoadedModel, load
from quickdraft.request import SamplingParams
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.embeddings import declared_pooling
from quickdraft.server.main import BackgroundServer
from quickdraft.speculation.factory import make_speculation

TEXTS = ["def add(a, b):\n    return a + b", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


@pytest.fixture(scope="module")
def urls(lm: LoadedModel) -> Iterator[dict[str, str]]:
    """One engine that speculates (n-gram), three servers on it: the default pooling, mean, cls."""
    spec = SpeculativeConfig(method="ngram")
    engine = Engine({"tiny": ServedModel(lm, spec, make_speculation(lm, spec))}, max_waiting=64)
    engine.start()
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                BackgroundServer(create_app(engine, ServerConfig(pooling=pooling)))
            ).url
            for name, pooling in (("last", None), ("mean", "mean"), ("cls", "cls"))
        }
        yield urls
    engine.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def reference(model_dir: Path, ids: list[int], pooling: str) -> np.ndarray:
    """transformers' post-final-norm states of `ids`, pooled and L2-normalised."""
    import transformers

    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        states = hf.model(torch.tensor([ids])).last_hidden_state[0]
    v = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
    return (v / v.norm()).numpy()


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=60)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_vectors_equal_transformers_pooled_states(
    urls: dict[str, str], lm: LoadedModel, tiny_model_dir: Path, pooling: str
) -> None:
    got = client(urls[pooling]).embeddings.create(
        model="tiny", input=TEXTS, encoding_format="float"
    )
    ids = [lm.tokenizer.encode(t, parse_special=False) for t in TEXTS]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    assert [d.index for d in got.data] == [0, 1] and got.model == "tiny"
    for d, one in zip(got.data, ids, strict=True):
        v = np.asarray(d.embedding, dtype=np.float32)
        assert v.shape == (lm.model.config.hidden_size,)
        np.testing.assert_allclose(v, reference(tiny_model_dir, one, pooling), atol=2e-5)
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5


def test_formats_dimensions_normalize_and_token_inputs(
    urls: dict[str, str], lm: LoadedModel
) -> None:
    url = urls["last"]

    def vector(**body: Any) -> Any:
        return post(url, {"input": TEXTS[0], **body}).json()["data"][0]["embedding"]

    floats = vector()
    # the openai client asks for base64 by default and decodes it
    decoded = client(url).embeddings.create(model="tiny", input=TEXTS[0]).data[0].embedding
    assert decoded == floats
    assert (
        np.frombuffer(base64.b64decode(vector(encoding_format="base64")), "<f4").tolist() == floats
    )
    v = np.asarray(floats, dtype=np.float32)
    cut = np.asarray(vector(dimensions=16))
    np.testing.assert_allclose(cut, v[:16] / np.linalg.norm(v[:16]), atol=1e-6)
    plain = np.asarray(vector(normalize=False))
    assert abs(float(np.linalg.norm(plain)) - 1.0) > 1e-3
    np.testing.assert_allclose(plain / np.linalg.norm(plain), v, atol=1e-6)
    ids = lm.tokenizer.encode(TEXTS[0], parse_special=False)
    assert post(url, {"input": ids}).json()["data"][0]["embedding"] == floats
    # two inputs run in one step; this fp32 model's attention (SDPA at head_dim 16) is not
    # batch-invariant, so equal to rounding here (bit for bit in bf16: below)
    both = post(url, {"input": [ids, ids[-5:]]}).json()
    assert both["usage"]["prompt_tokens"] == len(ids) + 5
    np.testing.assert_allclose(both["data"][0]["embedding"], floats, atol=1e-6)
    last5 = post(url, {"input": TEXTS[0], "truncate_prompt_tokens": 5}).json()
    np.testing.assert_allclose(
        last5["data"][0]["embedding"], both["data"][1]["embedding"], atol=1e-6
    )
    assert last5["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["fine", ""]}, 400, "input[1]"),
        ({"input": [[1, 2], [3, 100000]]}, 400, "input[1]"),
        ({"input": [7] * 600}, 400, "input"),  # the tiny model's context is 512
        ({"input": ["x"] * 2049}, 400, "input"),
        ({"input": "x", "dimensions": 1000}, 400, "dimensions"),
        ({"input": "x", "dimensions": 0}, 400, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ({"input": "x", "model": "nope"}, 404, "model"),
    ],
)
def test_bad_requests_name_the_field(
    urls: dict[str, str], body: dict[str, Any], status: int, param: str
) -> None:
    r = post(urls["last"], body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert post(urls["last"], {"input": "still serving"}).status_code == 200


def test_many_inputs_run_in_waves(urls: dict[str, str], lm: LoadedModel) -> None:
    """More inputs than the server admits at once (its 32 concurrent requests): in order."""
    texts = [f"item {i}: {TEXTS[i % 2]}" for i in range(70)]
    got = post(urls["last"], {"input": texts}).json()
    assert [d["index"] for d in got["data"]] == list(range(70))
    alone = post(urls["last"], {"input": texts[45]}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(got["data"][45]["embedding"], alone, atol=1e-6)


@pytest.fixture(scope="module")
def bf16_lm(bf16_pair: tuple[Path, Path]) -> LoadedModel:
    return load(str(bf16_pair[0]), "bf16", progress=False)


def embed(engine: Engine, ids: list[int], pooling: str) -> list[float]:
    outs = list(engine.submit("m", ids, SamplingParams(max_tokens=1, pooling=pooling)))
    assert outs[-1].spec.drafted == 0 and outs[-1].completion_tokens == 1
    vec = outs[-1].embedding
    assert vec is not None
    return vec


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_rows_do_not_depend_on_chunks_batches_or_the_prefix_cache(
    bf16_lm: LoadedModel, pooling: str
) -> None:
    """bf16, batch-invariant kernels: the vector of a 150-token prompt is the same bits
    prefilled in one chunk or in chunks of 16, alone or beside other requests' decode steps,
    and (last) with its first blocks from the prefix cache (mean runs every row)."""
    spec = SpeculativeConfig(method="ngram")
    served = ServedModel(bf16_lm, spec, make_speculation(bf16_lm, spec))
    ids = bf16_lm.tokenizer.encode(" ".join(TEXTS * 6), parse_special=False)[:150]
    assert len(ids) == 150
    base = Engine({"m": served}, prefix_cache=PrefixCacheConfig(enabled=False))
    chunked = Engine(
        {"m": served},
        scheduler=SchedulerConfig(max_step_tokens=16),
        prefix_cache=PrefixCacheConfig(block_size=32),
    )
    for e in (base, chunked):
        e.start()
    try:
        alone = embed(base, ids, pooling)
        assert embed(chunked, ids, pooling) == alone
        # beside requests that decode, and after one that cached the prompt's blocks
        others = [
            chunked.submit("m", [*ids[:128], 5, 6], SamplingParams(max_tokens=24)),
            chunked.submit("m", ids[:40], SamplingParams(max_tokens=24)),
        ]
        assert embed(chunked, ids, pooling) == alone
        for h in others:
            assert list(h)[-1].finished
        outs = list(chunked.submit("m", ids, SamplingParams(max_tokens=1, pooling=pooling)))
        assert outs[-1].embedding == alone
        assert (outs[-1].cached_tokens > 0) == (pooling == "last")
    finally:
        for e in (base, chunked):
            e.stop()


def test_declared_pooling_reads_the_config_then_sentence_transformers(tmp_path: Path) -> None:
    st, both, none = (tmp_path / n for n in ("st", "both", "none"))
    for d in (st, both, none):
        (d / "1_Pooling").mkdir(parents=True)
        (d / "config.json").write_text('{"model_type": "qwen3"}')
    for d in (st, both):
        (d / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (both / "config.json").write_text('{"pooling": "last"}')
    assert [declared_pooling(d) for d in (st, both, none)] == ["mean", "last", None]


def test_gguf_vectors_equal_llama_cpp(home: Path, tmp_path: Path) -> None:
    """A qwen3 F32 GGUF that declares its pooling (llama.cpp's `qwen3.pooling_type`, as
    Qwen3-Embedding's files do: 3 = last; and 1 = mean): the served default follows it, and
    the vectors equal llama.cpp's on the same file (both fp32)."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed"
    )
    from test_gguf_loader import PROMPT, TYPES, write_tiny_gguf

    for code, pooling in ((3, "last"), (1, "mean")):
        path = write_tiny_gguf(
            tmp_path / f"qwen3-{pooling}.gguf",
            "qwen3",
            dict.fromkeys(TYPES["qwen3"], "F32"),
            3,
            extra={"qwen3.pooling_type": code},
        )
        lm = load(str(path), "fp32", progress=False)
        assert declared_pooling(lm.path) == pooling
        engine = Engine({"tiny": ServedModel(lm)})
        engine.start()
        try:
            with BackgroundServer(create_app(engine, ServerConfig())) as srv:
                got = post(srv.url, {"input": PROMPT, "model": "tiny"}).json()
        finally:
            engine.stop()
        ours = np.asarray(got["data"][0]["embedding"], dtype=np.float32)
        f32 = llama_cpp.GGML_TYPE_F32  # its KV cache in fp32, as ours (its default is f16)
        llm = llama_cpp.Llama(
            model_path=str(path),
            embedding=True,
            n_ctx=256,
            n_threads=2,
            type_k=f32,
            type_v=f32,
            verbose=False,
        )
        ids = lm.tokenizer.encode(PROMPT, parse_special=False)
        assert llm.tokenize(PROMPT.encode(), add_bos=False, special=False) == ids
        assert got["usage"]["prompt_tokens"] == len(ids)
        theirs = np.asarray(llm.embed(PROMPT, normalize=True), dtype=np.float32)
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
