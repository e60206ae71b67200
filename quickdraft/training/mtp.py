"""Training an MTP head for a dense target that ships none (self-distillation, the target frozen).

Stage: the MTP half of `quickdraft train-drafter --kind mtp` (training/corpus.py makes its data,
training/loop.py holds the labels, loss, AL estimate and loop it shares with training/dflash.py).
Contract:
  MTPTrainModel(shape, steps, embed, head, seed, vocab_ids)
        the MTP head's forward (models/heads/mtp.py: x_i = fc([norm_e(embed(t_{i+1}));
        norm_h(h_i)]), one decoder layer of the target's family, final norm, the target's lm_head,
        or its rows of a reduced draft vocabulary) in plain differentiable torch; `state_dict()` is
        the standalone head checkpoint (`mtp.*` tensors, and `d2t` for a reduced vocabulary) that
        `--speculative-method mtp --draft-model DIR` loads.
  .rows_hidden(ids, taps, preds, anchors)   for an anchor a (the last token given), `steps`
        drafted rows, as the drafter runs them when serving (drafters/mtp.py):
        step 1   row a - 1 of one causal pass over every position i < T - 1, row i reading the
                 target's post-norm hidden h_i (the only tap: its last layer) and token
                 t_{i+1}, at position i; it guesses token a + 1.
        step j   (j >= 2) one row at position a + j - 2 reading the head's own post-norm output
                 of step j - 1 (the drafter's post_norm feed) and token a + j - 1 as the target
                 says it (preds[a + j - 2]: a chained step only counts when the drafts before it
                 were accepted, so the drafted token is the target's); it sees the step-1 rows
                 0 .. a - 1 and the anchor's own earlier chained rows, as the drafter's
                 chained rows see its committed KV and each other.
        The labels (the target's greedy tokens a + 1 .. a + steps, known while the corpus follows
        the target's chain) and the loss are the loop's.
  mtp_trainer_for(target, steps)   a fresh head for a loaded dense target.
The chained forward lives in `ChainTrainModel`, which the EAGLE-3 head shares
(training/eagle3.py): only where a row's residual and attention input come from differ.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quickdraft.config import ModelConfig
from quickdraft.models.base import LanguageModel, module_of
from quickdraft.models.heads.mtp import STANDALONE_ARCHITECTURE
from quickdraft.models.layers import Rope
from quickdraft.models.registry import DENSE_TYPES
from quickdraft.training.layers import Layer, Norm, frozen_target, init_stds, linear, rope_tables
from quickdraft.training.loop import DraftTrainModel


class _Head(nn.Module):
    """The parameters, named as the checkpoint names them after `mtp.`."""

    def __init__(self, shape: ModelConfig) -> None:
        super().__init__()
        h, eps = shape.hidden_size, shape.rms_norm_eps
        std, out_std = init_stds(1)
        self.pre_fc_norm_embedding = Norm(h, eps)
        self.pre_fc_norm_hidden = Norm(h, eps)
        self.fc = linear(2 * h, h, std / math.sqrt(2))
        self.layers = nn.ModuleList([Layer(shape, std, out_std)])
        self.norm = Norm(h, eps)

    @property
    def layer(self) -> Layer:
        layer = self.layers[0]
        assert isinstance(layer, Layer)
        return layer


class ChainTrainModel(DraftTrainModel, ABC):
    """A head that drafts by chaining one decoder layer (an MTP head, an EAGLE-3 head,
    training/eagle3.py): `rows_hidden` as the module docstring says, over three hooks:
    `start(taps)` the hidden a step-1 row reads from the target's taps, `inputs(tokens,
    hidden)` -> (residual, the attention's normed input) of rows, `feed(out)` the hidden a
    chained row reads from the previous step's layer output."""

    rope: Rope

    @property
    @abstractmethod
    def layer(self) -> Layer: ...

    @abstractmethod
    def start(self, taps: Tensor) -> Tensor: ...

    @abstractmethod
    def inputs(self, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]: ...

    @abstractmethod
    def feed(self, out: Tensor) -> Tensor: ...

    def rows_hidden(self, ids: Tensor, taps: Tensor, preds: Tensor, anchors: Tensor) -> Tensor:
        """ids, preds [S, T], taps [S, T, F], anchors [S, N] (>= 1) -> [S, N, steps, H], the
        layer's output (before `norm`) of each step (module docstring)."""
        s, t = ids.shape
        n = anchors.shape[1]
        layer = self.layer
        attn = layer.self_attn
        # row i at position i: token t_{i+1}, the taps of position i
        x, hn = self.inputs(ids[:, 1:], self.start(taps[:, :-1].float()))
        cos, sin = rope_tables(self.rope, torch.arange(t - 1).expand(s, t - 1))
        k, v = attn.keys(hn, cos, sin)
        x = layer.finish(x, attn.attend(attn.queries(hn, cos, sin), k, v, None, causal=True))
        rows = anchors - 1
        out = [x.gather(1, rows[..., None].expand(s, n, x.shape[-1]))]  # [S, N, H]
        keys, values = [k], [v]
        sees_rows = torch.arange(t - 1)[None, None, :] <= rows[:, :, None]  # [S, N, T-1]
        for step in range(1, self.rows):
            token = preds.gather(1, (anchors + step - 1).clamp(max=t - 1))  # [S, N]
            x, hn = self.inputs(token, self.feed(out[-1]))
            cos, sin = rope_tables(self.rope, rows + step)
            k, v = attn.keys(hn, cos, sin)
            keys.append(k)
            values.append(v)
            # [S, 1, N, T-1 + N * step]: the step-1 rows up to the anchor's, its chained rows
            own = torch.eye(n, dtype=torch.bool).repeat(1, step).expand(s, n, n * step)
            mask = torch.cat([sees_rows, own], -1)[:, None]
            q = attn.queries(hn, cos, sin)
            x = layer.finish(x, attn.attend(q, torch.cat(keys, 1), torch.cat(values, 1), mask))
            out.append(x)
        return torch.stack(out, 2)


class MTPTrainModel(ChainTrainModel):
    """The MTP head's forward in plain torch (module docstring)."""

    head: Tensor  # a buffer, typed

    def __init__(
        self,
        shape: ModelConfig,  # the target's
        steps: int,  # chained steps trained (drafted rows per anchor)
        embed: Callable[[Tensor], Tensor],  # token ids -> the target's raw embeddings [.., H]
        head: Tensor,  # [vocab, H] the target's lm_head, frozen
        seed: int = 0,
        vocab_ids: Tensor | None = None,  # [V_d] ascending: the token ids the head scores
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shape, self.rows = shape, steps
        self.mtp = _Head(shape)
        self._embed = embed
        self.register_buffer("head", self.scored_head(head, vocab_ids), persistent=False)
        self.rope = Rope(shape.head_dim, shape.rope_theta, torch.device("cpu"))

    @property
    def layer(self) -> Layer:
        return self.mtp.layer

    def start(self, taps: Tensor) -> Tensor:
        return taps  # the target's post-norm hidden (the one tap: its last layer)

    def inputs(self, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [S, L] (t_{i+1}), hidden [S, L, H] (h_i) -> x = fc([norm_e(e); norm_h(h)])
        and the layer's normed x."""
        m = self.mtp
        with torch.no_grad():
            emb = self._embed(tokens.flatten()).float().view(*tokens.shape, -1)
        x = m.fc(torch.cat([m.pre_fc_norm_embedding(emb), m.pre_fc_norm_hidden(hidden)], -1))
        return x, self.layer.input_layernorm(x)

    def feed(self, out: Tensor) -> Tensor:
        return self.mtp.norm(out)  # the drafter's post_norm feed

    def logits(self, hidden: Tensor) -> Tensor:
        """Layer outputs [..., H] -> logits [..., vocab] fp32 over the target's lm_head."""
        return F.linear(self.mtp.norm(hidden).to(self.head.dtype), self.head).float()

    def config_json(self, target_name: str, steps: int) -> dict[str, Any]:
        """The standalone head's config.json (models/heads/mtp.py)."""
        s = self.shape
        return {
            "architectures": [STANDALONE_ARCHITECTURE],
            "model_type": s.model_type,
            "hidden_size": s.hidden_size,
            "vocab_size": s.vocab_size,
            **self.vocab_json(),
            "num_nextn_predict_layers": 1,
            "torch_dtype": "float32",
            "quickdraft": {
                "trained_for": target_name,
                "steps": steps,
                "feed": "post_norm",
                "chained_steps_trained": self.rows,
            },
        }


def mtp_trainer_for(
    model: LanguageModel,
    steps: int,
    seed: int = 0,
    dtype: torch.dtype | None = None,  # the frozen head's (default: layers.head_dtype())
    vocab_ids: Tensor | None = None,  # the draft vocabulary (draft_vocabulary); None: all
) -> MTPTrainModel:
    """A fresh MTP head to train for dense target `model` (its embedding and head, frozen)."""
    target: Any = module_of(model)
    shape = target.config
    if not isinstance(shape, ModelConfig) or shape.model_type not in DENSE_TYPES:
        raise ValueError(
            f"--kind mtp trains heads for dense targets ({', '.join(DENSE_TYPES)}), not "
            f"{shape.model_type!r} (the hybrid Qwen3-Next / Qwen3.5 families ship their own)"
        )
    if shape.moe_layers and shape.moe_layers[0]:
        raise ValueError(f"{shape.model_type}: an MTP head with routed experts is not trained yet")
    if steps < 1:
        raise ValueError(f"MTP steps must be >= 1, got {steps}")
    frozen = frozen_target(target, dtype)
    head = MTPTrainModel(shape, steps, frozen.embed, frozen.head, seed, vocab_ids)
    with torch.no_grad():
        head.mtp.norm.weight.copy_(frozen.norm_scale)
    return head
