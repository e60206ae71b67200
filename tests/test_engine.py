"""quickdraft.engine: the request API (submit / iterate / cancel / queue limit) on a tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from quickdraft.engine import Engine, QueueFullError, ServedModel
from quickdraft.generate import LoadedModel, load, stream
from quickdraft.request import FinishReason
from quickdraft.sampling import SamplingParams


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> LoadedModel:
    return load(str(tiny_model_dir), "fp32", progress=False)


def plain(lm: LoadedModel, ids: list[int], params: SamplingParams) -> list[int]:
    req = lm.new_request(ids, params)
    for _ in stream(lm, req):
        pass
    return req.output_ids


def test_engine_outputs_match_stream_and_end_with_reason(lm: LoadedModel) -> None:
    engine = Engine({"tiny": ServedModel(lm)})
    engine.start()
    try:
        ids = lm.tokenizer.encode("hello")
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        outs = list(engine.submit("tiny", ids, params))
        assert [t for o in outs for t in o.token_ids] == plain(lm, ids, params)
        assert outs[-1].finish_reason == FinishReason.LENGTH
        assert all(o.finish_reason is None for o in outs[:-1])
        assert outs[-1].completion_tokens == 20 and outs[-1].prompt_tokens == len(ids)
    finally:
        engine.stop()
    assert not engine.alive


def test_engine_async_cancel_frees_the_request(lm: LoadedModel) -> None:
    engine = Engine({"tiny": ServedModel(lm)})
    engine.start()

    async def consume() -> list[FinishReason | None]:
        handle = engine.submit(
            "tiny", lm.tokenizer.encode("abc"), SamplingParams(max_tokens=200, ignore_eos=True)
        ).bind_loop()
        reasons = []
        async for out in handle:
            reasons.append(out.finish_reason)
            handle.cancel()
        return reasons

    try:
        reasons = asyncio.run(consume())
        assert reasons[-1] == FinishReason.ABORT and len(reasons) < 200
        assert engine.num_running == 0
        outs = list(engine.submit("tiny", [1, 2, 3], SamplingParams(max_tokens=3)))
        assert outs[-1].finished  # the engine still serves after a cancellation
    finally:
        engine.stop()


def test_engine_rejects_unknown_model_and_full_queue(lm: LoadedModel) -> None:
    engine = Engine({"tiny": ServedModel(lm)}, max_waiting=0)
    engine.start()
    try:
        with pytest.raises(ValueError, match="unknown model 'nope'"):
            engine.submit("nope", [1], SamplingParams())
        with pytest.raises(QueueFullError):
            engine.submit("tiny", [1], SamplingParams())
    finally:
        engine.stop()
