"""Load a model by name/path, and single-stream generation on the engine's step machinery.

Stage: what `quickdraft generate`, the speculation benchmark and many tests call. `stream()` is
a one-request run of the same cycle the batching engine runs (quickdraft/core.py): prefill in
chunks, then per step
    k = policy.choose(...)                   (0 when speculation is off or cannot pay)
    draft = drafter.propose([job(tokens, k)])
    out = target([last, d_1..d_k])          one forward, k+1 logit rows
    verdict = verify(draft, out)             accepted drafts + one recovered/bonus token
    cache.commit(length + 1 + accepted)      rollback of the rejected rows is this commit
    request.append(verdict.tokens); drafter.commit(tokens, hidden of the kept rows)
Plain decoding is the same cycle with k = 0, and a request alone in the engine runs exactly
this, so there is one decode loop.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quickdraft import hub
from quickdraft.config import QUANTIZATIONS, parse_dtype
from quickdraft.core import EngineCore
from quickdraft.kernels.cpu_linear import kernels_available
from quickdraft.models.base import LanguageModel
from quickdraft.models.layers import panels_apply
from quickdraft.models.loader import load_model
from quickdraft.policy import StepCost, measure_step_cost
from quickdraft.request import Request
from quickdraft.sampling import SamplingParams
from quickdraft.scheduler import SchedulerConfig
from quickdraft.tokenizer import Tokenizer

if TYPE_CHECKING:
    from quickdraft.speculate import Speculation

PREFILL_CHUNK = 512  # bounds the [chunk, context] attention mask and activations of long prompts


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    dtype_name: str
    model: LanguageModel
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    _step_cost: StepCost | None = None

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings

    def new_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str = ""
    ) -> Request:
        total = len(prompt_ids) + params.max_tokens
        if total > self.context_length:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model context of {self.context_length} tokens"
            )
        return Request(prompt_ids, params, self.tokenizer, self.eos_ids, request_id)

    def step_cost(self) -> StepCost:
        """Measured seconds of a target forward over M packed rows (measured once, seconds)."""
        if self._step_cost is None:
            self._step_cost = measure_step_cost(self.model)
        return self._step_cost


def load(
    model: str,
    dtype: str = "bf16",
    device: str = "cpu",
    progress: bool = True,
    quantization: str = "none",
) -> LoadedModel:
    """`quantization="int8"`: per-row int8 projection weights (half the bytes of bf16, so a
    memory-bound step runs up to twice as fast); dense (Llama/Qwen2) models only."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: choose one of {QUANTIZATIONS}")
    path = hub.resolve(model, dtype, progress=progress)
    net = load_model(path, parse_dtype(dtype), device)
    if net.device.type == "cpu":
        # Build the C++ kernels (once per install, ~2 min on 2 cores) now, not inside the first
        # forward: there a server's first request waited for it, past its client's timeout.
        kernels_available()
    if quantization != "none":
        quantize = getattr(net, "quantize_", None)
        if quantize is None:
            raise ValueError(
                f"{model}: {quantization} weights are supported for dense models only, "
                f"not {type(net).__name__}"
            )
        quantize(quantization)
    elif panels_apply(net.dtype, net.device):
        pack = getattr(net, "pack_", None)  # bf16 on CPU: the layout the panel kernel streams
        if pack is not None:
            pack()
    tokenizer = Tokenizer(path)
    eos = set(net.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return LoadedModel(model, path, dtype, net, tokenizer, tuple(sorted(eos)))


def stream(
    lm: LoadedModel, req: Request, spec: Speculation | None = None
) -> Generator[str, None, None]:
    """Generate for `req`, yielding text deltas (stop-string safe) until it finishes.

    Closing the generator early aborts the request and frees its caches and drafter state."""
    core = EngineCore(lm, SchedulerConfig(max_running=1, max_step_tokens=PREFILL_CHUNK))
    seq = core.add(req, spec)
    try:
        while not req.finished:
            core.step()
            delta = req.stream_delta()
            if delta:
                yield delta
        if seq.error is not None:
            raise seq.error
    finally:
        core.abort(seq)  # no-op when finished; marks a consumer that stopped early
