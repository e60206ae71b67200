"""Tokenizer, chat template and incremental detokenizer.

Wraps a `tokenizers` tokenizer.json. Chat templates are untrusted code from model files: they are
rendered in jinja2's ImmutableSandboxedEnvironment with the same options and helpers transformers
uses (trim_blocks, lstrip_blocks, loopcontrols, tojson, raise_exception, strftime_now), so our
prompts are byte-identical to transformers' `apply_chat_template`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a str or as {"content": str, ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id: int | None = eos_id
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def fingerprint(self) -> int:
        """Identity of the id <-> token mapping (two tokenizers that agree here are
        interchangeable for speculative decoding)."""
        return hash(frozenset(self._tok.get_vocab(with_added_tokens=True).items()))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return _compile(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The rendered template already holds every special token (transformers does the same).
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class IncrementalDetokenizer:
    """Text deltas for a growing id list, never splitting a multi-byte character.

    Decodes a short window [prefix_offset, end) and emits only what extends the previous window's
    text, holding back output while it ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""
