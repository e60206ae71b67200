"""Training an EAGLE-3 head for a target (self-distillation, the target frozen): the SpecForge
recipe at our scale.

Stage: the EAGLE-3 half of `quickdraft train-drafter --kind eagle3` (training/corpus.py makes
its data: the target regenerates the answers and its taps are recorded; training/loop.py holds
the labels, loss, AL estimate and loop; the chained forward is training/mtp.py's
`ChainTrainModel`, so every training-time-test step runs as the drafter runs it when serving).
Contract:
  Eagle3TrainModel(shape, taps, steps, embed, head, seed, vocab_ids)
        the head of models/heads/eagle3.py in plain differentiable torch: g = fc(taps of the inputs
        of target layers `taps`), a first layer over [input_layernorm(embed(t)), hidden_norm(g)]
        with residual g, `norm`, an lm_head over the draft vocabulary (the target's rows, frozen);
        step 1 reads the target's taps, each chained step the previous step's pre-norm output
        (EAGLE-3's training-time test). `state_dict()` is the checkpoint, in vLLM's `speculators`
        layout (`layers.0.*`, `fc`, `norm`, `lm_head`, `d2t`; no `t2d`, which vLLM and we derive
        from `d2t`), and `config_json` its config, which `--speculative-method eagle3
        --draft-model DIR` (and vLLM) load.
  eagle3_trainer_for(target, steps, taps)   a fresh head for a loaded target.
  default_taps(L)   (2, L // 2, L - 3): the inputs of those layers, as vLLM taps them.
The corpus stores layer OUTPUTS: the input of layer i is the output of layer i - 1
(`corpus_layers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.config import ModelConfig
from quickdraft.models.base import LanguageModel, module_of
from quickdraft.models.layers import Rope
from quickdraft.training.layers import Layer, Norm, frozen_target, init_stds, linear
from quickdraft.training.mtp import ChainTrainModel


def default_taps(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


def corpus_layers(taps: Sequence[int]) -> tuple[int, ...]:
    """The layer outputs the corpus records for taps that name layer inputs."""
    return tuple(t - 1 for t in taps)


class Eagle3TrainModel(ChainTrainModel):
    """The EAGLE-3 head's forward in plain torch (module docstring)."""

    def __init__(
        self,
        shape: ModelConfig,  # the target's: the head's layer has its shape
        taps: Sequence[int],  # target layers whose input is read
        steps: int,  # chained steps trained (training-time-test depth)
        embed: Callable[[Tensor], Tensor],  # token ids -> the target's raw embeddings [.., H]
        head: Tensor,  # [vocab, H] the target's lm_head, frozen
        seed: int = 0,
        vocab_ids: Tensor | None = None,  # [V_d] ascending: the token ids the head scores
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        h, eps = shape.hidden_size, shape.rms_norm_eps
        std, out_std = init_stds(1)
        self.shape, self.taps, self.rows = shape, tuple(taps), steps
        self.fc = linear(len(self.taps) * h, h, std)
        layer = Layer(shape, std, out_std, attn_in=2 * h)
        layer.add_module("hidden_norm", Norm(h, eps))
        self.layers = nn.ModuleList([layer])
        self.norm = Norm(h, eps)
        self.lm_head = nn.Module()  # frozen, but in the checkpoint (vLLM loads its own)
        self.lm_head.register_buffer("weight", self.scored_head(head, vocab_ids))
        self._embed = embed
        self.rope = Rope(shape.head_dim, shape.rope_theta, torch.device("cpu"))

    @property
    def layer(self) -> Layer:
        layer = self.layers[0]
        assert isinstance(layer, Layer)
        return layer

    def start(self, taps: Tensor) -> Tensor:
        return self.fc(taps)  # g: the fused taps

    def inputs(self, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [S, L], g [S, L, H] -> residual g and [input_layernorm(e); hidden_norm(g)]."""
        layer = self.layer
        with torch.no_grad():
            emb = self._embed(tokens.flatten()).float().view(*tokens.shape, -1)
        hidden_norm = layer.get_submodule("hidden_norm")
        return hidden, torch.cat([layer.input_layernorm(emb), hidden_norm(hidden)], -1)

    def feed(self, out: Tensor) -> Tensor:
        return out  # the pre-norm output, as the drafter feeds it

    def logits(self, hidden: Tensor) -> Tensor:
        head = self.lm_head.get_buffer("weight")
        return F.linear(self.norm(hidden).to(head.dtype), head).float()

    def config_json(self, target_name: str, steps: int) -> dict[str, Any]:
        """vLLM `speculators` layout (models/heads/eagle3.py reads it)."""
        s = self.shape
        layer = {
            "model_type": "llama",
            "vocab_size": s.vocab_size,
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim,
            "rms_norm_eps": s.rms_norm_eps,
            "rope_theta": s.rope_theta,
            "max_position_embeddings": s.max_position_embeddings,
            "hidden_act": "silu",
        }
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab or s.vocab_size,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": list(self.taps),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.rows}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target_name},
            },
            "torch_dtype": "float32",
            "quickdraft": {"trained_for": target_name, "steps": steps, "ttt_steps": self.rows},
        }


def eagle3_trainer_for(
    model: LanguageModel,
    steps: int,
    taps: Sequence[int] = (),
    seed: int = 0,
    dtype: torch.dtype | None = None,  # the frozen head's (default: layers.head_dtype())
    vocab_ids: Tensor | None = None,  # the draft vocabulary (draft_vocabulary); None: all
) -> Eagle3TrainModel:
    """A fresh EAGLE-3 head to train for `model` (its embedding and lm_head frozen); its layer
    has the target's shape (a plain Llama layer: no q/k norms, no biases), as SpecForge's."""
    target: Any = module_of(model)
    shape = target.config
    layers = shape.num_hidden_layers
    taps = tuple(taps) or default_taps(layers)
    if not all(1 <= t < layers for t in taps):
        raise ValueError(f"EAGLE-3 taps {list(taps)} (layer inputs) must lie in 1 .. {layers - 1}")
    if steps < 1:
        raise ValueError(f"EAGLE-3 training-time-test steps must be >= 1, got {steps}")
    plain = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": shape.vocab_size,
            "hidden_size": shape.hidden_size,
            "intermediate_size": getattr(shape, "intermediate_size", 0) or 4 * shape.hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": shape.num_attention_heads,
            "num_key_value_heads": shape.num_key_value_heads,
            "head_dim": shape.head_dim,
            "rms_norm_eps": shape.rms_norm_eps,
            "rope_theta": shape.rope_theta,
            "max_position_embeddings": shape.max_position_embeddings,
        }
    )
    frozen = frozen_target(target, dtype)
    head = Eagle3TrainModel(plain, taps, steps, frozen.embed, frozen.head, seed, vocab_ids)
    with torch.no_grad():
        head.norm.weight.copy_(frozen.norm_scale)
    return head
