"""Peer engines the benchmarks run beside ours, on the same GGUF file, prompts and threads.

llama.cpp runs through `llama-cpp-python` (the optional extra `peers`: `pip install -e
".[peers]"` builds llama.cpp from source for this CPU). The prompt goes in as our token ids,
so both engines see the same prompt; decoding is greedy (top-k 1, no repeat penalty) and stops
at the model's EOS or after `max_tokens`. Each run starts from an empty KV cache: llama-cpp-
python would otherwise reuse the previous prompt's common prefix, which our engines do not.
`llama_cpp_quantize` runs llama.cpp's quantizer, for benchmark files in its K-quant mixes
(Q4_K_M ...), which gguf-py cannot write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PEERS = ("llama.cpp",)


class PeerUnavailableError(RuntimeError):
    """The peer's package is not installed (or cannot load the file)."""


@dataclass(slots=True)
class PeerRun:
    tokens: list[int]
    seconds: float  # the whole request: prompt processing + decode
    ttft: float  # until the first output token


class LlamaCpp:
    """llama.cpp on `gguf` with `threads` threads and room for `context` tokens."""

    def __init__(self, gguf: Path, threads: int, context: int, logits_all: bool = False) -> None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise PeerUnavailableError(
                "the llama.cpp peer needs llama-cpp-python: pip install -e '.[peers]'"
            ) from exc
        self.llm: Any = llama_cpp.Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=context,
            seed=0,
            logits_all=logits_all,  # keep every position's logits (perplexity)
            verbose=False,
        )
        self.version: str = llama_cpp.__version__

    def prompt_logits(self, ids: list[int]) -> np.ndarray:
        """[len(ids), vocab] fp32 logits of every prompt position, one evaluation from an empty
        context (needs logits_all=True)."""
        self.llm.reset()
        self.llm.eval(ids)
        return np.asarray(self.llm.scores[: len(ids)], dtype=np.float32)

    def generate(self, prompt_ids: list[int], max_tokens: int, eos: tuple[int, ...]) -> PeerRun:
        llm = self.llm
        llm.reset()  # no prefix reuse across prompts
        out: list[int] = []
        t0 = time.perf_counter()
        first: float | None = None
        for token in llm.generate(
            prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            if first is None:
                first = time.perf_counter()
            if token in eos:
                break
            out.append(int(token))
            if len(out) >= max_tokens:
                break
        end = time.perf_counter()
        return PeerRun(out, end - t0, (end if first is None else first) - t0)


def llama_cpp_quantize(src: Path, dst: Path, ftype: str, threads: int) -> str:
    """llama.cpp's quantizer (llama-quantize) on GGUF `src` into `dst` as `ftype` (a llama.cpp
    file type: "Q4_K_M", "Q6_K", ...): the mix of block formats it picks per tensor, as in the
    files users download. Returns the llama-cpp-python version that wrote it."""
    import ctypes

    try:
        import llama_cpp
    except ImportError as exc:
        raise PeerUnavailableError(
            "quantizing with llama.cpp needs llama-cpp-python: pip install -e '.[peers]'"
        ) from exc
    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}", None)
    if code is None:
        kinds = sorted(
            n[len("LLAMA_FTYPE_MOSTLY_") :] for n in dir(llama_cpp) if "FTYPE_MOSTLY_" in n
        )
        raise ValueError(f"llama.cpp has no file type {ftype!r} (it has: {', '.join(kinds)})")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = code, threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantize {src.name} to {ftype}")
    return str(llama_cpp.__version__)
