"""A drafter's reduced draft vocabulary (EAGLE-3's `d2t`): the drafter scores only some of the
target's token ids with those rows of the target's lm_head, and every other id gets -inf.

Stage: shared by the drafters that score over the target's head (models/heads/dflash.py,
models/heads/mtp.py); training/loop.py writes it. Checkpoint layout: a tensor `d2t` [V_d] (logit
column i is token i + d2t[i], the ids ascending) and `draft_vocab_size` = V_d in config.json.
Contract:
  read_draft_vocabulary(files, vocab_size)   the ids [V_d] of a checkpoint's `d2t`, checked;
                                             None when it has none (the whole vocabulary)
  DraftVocab(head, ids, dtype)               the head's rows `ids` dequantized once into a GEMM
                                             operand packed like the head; `.full(logits)`
                                             widens [N, V_d] logits to [N, vocab] with -inf
Verification is untouched: a drafter that cannot propose a token only loses that acceptance,
and a restricted draft distribution is still a valid proposal for rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from quickdraft.kernels.gemm import Weight, dequantized_rows, project, to_panels
from quickdraft.models.families.llama import operand_converter

D2T = "d2t"  # a reduced draft vocabulary: logit column i is token i + d2t[i] (EAGLE-3's)


def read_draft_vocabulary(files: Sequence[Path], vocab_size: int) -> Tensor | None:
    """The token ids of a checkpoint's reduced draft vocabulary (tensor `d2t`), checked; None
    when it has none (the drafter scores the target's whole vocabulary)."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            if D2T in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                return draft_ids(f.get_tensor(D2T), vocab_size, str(file))
    return None


def draft_ids(d2t: Tensor, vocab_size: int, where: str) -> Tensor:
    """The ascending token ids [V_d] a `d2t` tensor names (id i + d2t[i]), checked against
    the target's `vocab_size`; `where` (the file) prefixes the error."""
    if d2t.dim() != 1 or not len(d2t):
        raise ValueError(f"{where}: d2t has shape {tuple(d2t.shape)}")
    ids = d2t.long() + torch.arange(len(d2t))
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{where}: d2t names ids outside the vocabulary ({vocab_size})")
    if not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{where}: d2t's token ids are not ascending")
    return ids


def first_ids(keep: int, vocab_size: int, extra: Sequence[int] = ()) -> Tensor:
    """The ascending ids [0, keep) and `extra` of a `vocab_size` vocabulary (`--draft-vocab`:
    a BPE vocabulary lists its tokens roughly by frequency)."""
    kept = {*range(min(keep, vocab_size)), *(i for i in extra if 0 <= i < vocab_size)}
    return torch.tensor(sorted(kept))


def widen(logits: Tensor, ids: Tensor, vocab_size: int) -> Tensor:
    """[N, V_d] logits over the draft vocabulary `ids` -> [N, vocab], -inf on every other id."""
    out = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    out[:, ids] = logits
    return out


def check_declared(path: Path, declared: int | None, ids: Tensor) -> None:
    """A clear error when config.json's `draft_vocab_size` disagrees with the `d2t` tensor."""
    if declared is not None and declared != len(ids):
        raise ValueError(f"{path}: draft_vocab_size {declared} but d2t has {len(ids)}")


class DraftVocab:
    """The rows `ids` of the target's head, as a GEMM operand (module docstring)."""

    def __init__(
        self, head: Weight, ids: Tensor, dtype: torch.dtype, fmt: str | None = None
    ) -> None:
        """`fmt` "int8" / "int4": the rows in that format (llama.operand_converter), else as
        the head is held (bf16 panels for a packed or GGUF head)."""
        rows = dequantized_rows(head, ids.tolist()).to(dtype)
        if fmt is not None:
            convert = operand_converter(fmt)
            assert convert is not None, fmt
            self.weight: Weight = convert(rows)
        else:
            self.weight = rows if isinstance(head, Tensor) else to_panels(rows)
        self.vocab_size = head.shape[0]
        self.ids = ids.to(rows.device)

    def full(self, logits: Tensor) -> Tensor:
        """[N, V_d] logits over the draft vocabulary -> [N, vocab], -inf on every other id."""
        return widen(logits, self.ids, self.vocab_size)

    def logits(self, x: Tensor, head: Weight) -> Tensor:
        """[N, hidden] final-norm rows -> [N, vocab] fp32, `head` being this vocabulary's
        `weight` (the call layers.VocabSubset.logits has, so a head holds either)."""
        return self.full(project(x, head).float())
