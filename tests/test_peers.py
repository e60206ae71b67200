"""The llama.cpp peer (llama-cpp-python, the optional `peers` extra) on the packaged SmolLM2
GGUF: greedy, our token ids as the prompt, stops at max_tokens, and times the first token
apart from the rest. Skipped where the extra is not installed."""

from __future__ import annotations

import pytest
import torch

from quickdraft import hub
from quickdraft.bench.peers import LlamaCpp
from quickdraft.loading import load

pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")
pytestmark = pytest.mark.real


def test_peers_llama_cpp_greedy_on_the_same_gguf() -> None:
    lm = load("smollm2-135m", "fp32", progress=False)
    peer = LlamaCpp(hub.gguf_file("smollm2-135m"), torch.get_num_threads(), 512)
    ids = lm.tokenizer.encode("1, 2, 3, 4, 5,")  # no near tie: a wrong setup shows
    first = peer.generate(ids, 12, lm.eos_ids)
    assert len(first.tokens) == 12
    assert 0 < first.ttft < first.seconds
    assert lm.tokenizer.decode(first.tokens).startswith(" 6, 7, 8,")
    again = peer.generate(ids, 12, lm.eos_ids)  # a fresh cache each time, greedy: the same
    assert again.tokens == first.tokens
    assert len(peer.generate(ids, 3, lm.eos_ids).tokens) == 3
