"""OpenAI's embeddings API (`POST /v1/embeddings`): the request body, the model's pooling, and
the response body. app.py admits the inputs (each a prefill-only request whose post-final-norm
rows the engine pools: request.py `SamplingParams.pooling`) and hands their vectors here.

Stage: the HTTP edge. What a serious user of vLLM or llama-server expects: a string, a list
of strings, token ids or a list of them (at most 2048 inputs, OpenAI's limit); `encoding_format`
"float" or "base64" (little-endian float32, what the openai client asks for by default);
`dimensions` (the first d values, renormalised: Matryoshka-trained models such as
Qwen3-Embedding); vLLM's `truncate_prompt_tokens` (keep the last N tokens; -1: the context),
`add_special_tokens` and `normalize`. The vectors are L2-normalised unless `normalize` is
false, as both peers do.

Pooling is the server's (`quickdraft serve --pooling`, as llama-server's `--pooling`): by
default what the model declares (a GGUF's `{arch}.pooling_type`, which convert writes to the
model directory's config.json as `pooling`; a sentence-transformers directory's
`1_Pooling/config.json`), else "last", vLLM's default for decoder-only models.
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from quickdraft.request import POOLINGS
from quickdraft.server.protocol import APIError, StrictBody, Text
from quickdraft.tokenizer import Tokenizer

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
# sentence-transformers' 1_Pooling/config.json modes -> ours
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}  # fmt: skip


class EmbeddingRequest(StrictBody):
    model: Text
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: Text | None = None  # the tenant, as on the other endpoints (access.py)
    # vLLM's extensions
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    normalize: bool = True

    def token_lists(self, tokenizer: Tokenizer, vocab: int, context: int) -> list[list[int]]:
        """Each input as token ids, truncated as asked; APIError 400 naming the input that is
        empty, out of the vocabulary or too long for the context."""
        raw: Any = self.input
        one = isinstance(raw, str) or bool(raw and isinstance(raw[0], int))  # a single input
        items: list[str | list[int]] = [raw] if one else list(raw)
        if not items:
            raise APIError(400, "input must not be empty", "input")
        if len(items) > MAX_INPUTS:
            raise APIError(400, f"input has {len(items)} items; at most {MAX_INPUTS}", "input")
        if self.truncate_prompt_tokens == 0:
            msg = "truncate_prompt_tokens must be -1 (the context) or >= 1"
            raise APIError(400, msg, "truncate_prompt_tokens")
        keep = context - 1 if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        out = []
        for i, item in enumerate(items):
            param = "input" if one else f"input[{i}]"
            if isinstance(item, str):
                ids = tokenizer.encode(item, self.add_special_tokens, parse_special=False)
            else:
                if any(not 0 <= t < vocab for t in item):
                    raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param)
                ids = list(item)
            if not ids:
                raise APIError(400, f"{param} must not be empty", param)
            if keep is not None and len(ids) > keep:
                ids = ids[len(ids) - keep :]
            if len(ids) >= context:  # the prefill also samples one token
                msg = (
                    f"{param} has {len(ids)} tokens; this model's context is {context} "
                    "(truncate_prompt_tokens keeps the last N)"
                )
                raise APIError(400, msg, param, "context_length_exceeded")
            out.append(ids)
        return out


@functools.lru_cache(maxsize=16)
def declared_pooling(path: Path) -> str | None:
    """The pooling a model directory declares (module docstring), or None."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    if cfg.get("pooling") in POOLINGS:
        return str(cfg["pooling"])
    try:
        st = json.loads((path / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return next((ours for mode, ours in _ST_MODES.items() if st.get(mode)), None)


def embedding_body(
    body: EmbeddingRequest, vectors: list[list[float]], prompt_tokens: int
) -> dict[str, Any]:
    """The response: each pooled vector cut to `dimensions`, normalised unless asked not to,
    as floats or base64 float32."""
    data = []
    for i, vec in enumerate(vectors):
        v = np.asarray(vec, dtype=np.float32)
        if body.dimensions is not None:
            if body.dimensions > len(v):
                msg = f"dimensions ({body.dimensions}) exceeds the model's {len(v)}"
                raise APIError(400, msg, "dimensions")
            v = v[: body.dimensions]
        if body.normalize:
            norm = float(np.linalg.norm(v.astype(np.float64)))
            if norm > 0.0:
                v = (v / np.float32(norm)).astype(np.float32)
        emb: list[float] | str = (
            base64.b64encode(v.astype("<f4").tobytes()).decode()
            if body.encoding_format == "base64"
            else v.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": emb})
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": body.model, "usage": usage}
