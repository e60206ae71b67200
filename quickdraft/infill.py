"""Fill-in-the-middle (FIM): the prompt that asks a code model for the text between a prefix and
a suffix, laid out as its training laid it out, and the tokens that end such an answer.

Stage: prompt construction, before the engine (server/app.py: /v1/completions' `suffix`,
llama.cpp's /infill). A model's FIM tokens are found by their spelling in its vocabulary, with
the spellings llama.cpp's vocabulary loader knows (Qwen2.5-Coder's `<|fim_prefix|>`, StarCoder's
`<fim_prefix>`, DeepSeek-Coder's `<｜fim▁begin｜>`, CodeLlama's `▁<PRE>`, ...); a model without
the prefix, suffix and middle tokens cannot infill. The pad, repository and file-separator tokens
end an answer as the end of text does (llama.cpp counts them as end of generation).

Two layouts:
* `completion_ids` (OpenAI's `suffix`, as Ollama renders it): PRE prompt SUF suffix MID.
* `infill_ids` (llama.cpp server's `format_prompt_infill`, the repository-level layout of
  Qwen2.5-Coder, arXiv 2409.12186), so that an editor plugin written for llama-server gets the
  same prompt here:

      [REP]myproject\\n [SEP]filename0\\n chunk 0 ... [SEP]filename\\n
      [PRE]prefix prompt [SUF]suffix [MID]

  llama.cpp's cuts too: the prefix keeps its last 3/4 of a 2048-token batch, the suffix its
  first quarter less the prompt and 2, the extra chunks their last tokens that the context
  leaves after a batch and twice the answer (llama.cpp passes its server's n_predict, -1 by
  default: here the request's max tokens, -1 when it gives none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quickdraft.tokenizer import Tokenizer

INFILL_BATCH = 2048  # llama-server's default n_batch: the window prefix and suffix share
REPO_NAME = "myproject\n"  # what llama-server writes after the repository token
FILE_NAME = "filename\n"  # ... and as the infilled file's name
CHUNK_FILE = "tmp"  # an extra chunk's name when it gives none
# an extra chunk's separator where the model has no file-separator token (llama-server's)
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"

_SPELLINGS = {
    "prefix": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "suffix": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "middle": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "file": ("<|file_sep|>",),
}


class InfillError(ValueError):
    """The model cannot infill, or the request's parts are malformed; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _find(tok: Tokenizer, role: str) -> int | None:
    for text in _SPELLINGS[role]:
        found = tok.token_id(text)
        if found is not None:
            return found
    return None


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    file: int | None = None

    @classmethod
    def of(cls, tok: Tokenizer, param: str | None = None) -> FimTokens:
        """The tokenizer's FIM tokens; InfillError naming those it lacks."""
        prefix, suffix, middle = (_find(tok, r) for r in ("prefix", "suffix", "middle"))
        if prefix is None or suffix is None or middle is None:
            lacks = [
                f"{role} ({_SPELLINGS[role][0]} or alike)"
                for role, got in (("prefix", prefix), ("suffix", suffix), ("middle", middle))
                if got is None
            ]
            msg = f"this model cannot fill in the middle: its vocabulary lacks {', '.join(lacks)}"
            raise InfillError(msg, param)
        pad, repo, file = (_find(tok, r) for r in ("pad", "repo", "file"))
        return cls(prefix, suffix, middle, pad, repo, file)

    @property
    def stops(self) -> tuple[int, ...]:
        """The tokens besides the end of text that end an infill."""
        return tuple(t for t in (self.pad, self.repo, self.file) if t is not None)


def _text(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False, parse_special=False)


def _bos(tok: Tokenizer) -> list[int]:
    """The tokenizer's own additions in front of a prompt (a BOS where it adds one)."""
    return tok.encode("", add_special_tokens=True)


def completion_ids(tok: Tokenizer, fim: FimTokens, prompt: list[int], suffix: str) -> list[int]:
    """OpenAI's completion with a `suffix`: `prompt` (ids) is the text before the gap."""
    return [*_bos(tok), fim.prefix, *prompt, fim.suffix, *_text(tok, suffix), fim.middle]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Another file of the project, given as context (llama.cpp's `input_extra` entry)."""

    text: str
    filename: str = CHUNK_FILE


def infill_ids(
    tok: Tokenizer,
    fim: FimTokens,
    prefix: str,
    suffix: str,
    extra: Sequence[Chunk] = (),
    prompt: str = "",
    context: int = 4096,
    n_predict: int = -1,
    spm: bool = False,
) -> list[int]:
    """llama-server's /infill prompt (module docstring). `prompt`: text the answer starts with
    (special-token text read as those tokens, as llama-server reads it); `spm`: the suffix
    before the prefix (llama-server's --spm-infill, for models trained that way)."""
    prompt_ids = tok.encode(prompt, add_special_tokens=False, parse_special=True) if prompt else []
    extra_ids: list[int] = []
    if fim.repo is not None:
        extra_ids += [fim.repo, *_text(tok, REPO_NAME)]
    for chunk in extra:
        if fim.file is not None:
            extra_ids += [fim.file, *_text(tok, chunk.filename + "\n")]
        else:
            extra_ids += _text(tok, CHUNK_SEPARATOR)
        extra_ids += _text(tok, chunk.text)
    if fim.file is not None:
        extra_ids += [fim.file, *_text(tok, FILE_NAME)]
    before, after = _text(tok, prefix), _text(tok, suffix)
    take_before = min(len(before), 3 * (INFILL_BATCH // 4))
    take_after = min(len(after), max(0, INFILL_BATCH // 4 - (2 + len(prompt_ids))))
    take_extra = min(max(0, context - INFILL_BATCH - 2 * n_predict), len(extra_ids))
    before = [fim.prefix, *before[len(before) - take_before :], *prompt_ids]
    after = [fim.suffix, *after[:take_after]]
    head = extra_ids[len(extra_ids) - take_extra :]
    first, then = (after, before) if spm else (before, after)
    return [*head, *_bos(tok), *first, *then, fim.middle]
