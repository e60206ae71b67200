"""Tokenizer, chat template and incremental detokenizer.

Wraps a `tokenizers` tokenizer.json. Chat templates are untrusted code from model files: they are
rendered in jinja2's ImmutableSandboxedEnvironment with the same options and helpers transformers
uses (trim_blocks, lstrip_blocks, loopcontrols, tojson, raise_exception, strftime_now), so our
prompts are byte-identical to transformers' `apply_chat_template`.

Control tokens come from the template only. Text a client wrote (message content, any message
field) is tokenized as the characters it is, even where it spells a special token such as
`<|im_end|>` (transformers' `split_special_tokens`, llama.cpp's `parse_special=false`), so no one
can close their turn or forge a system turn. How: before rendering, every special token in the
messages' strings is broken by a marker character no input contains; in the rendered prompt the
special tokens still whole are the template's; the text between two of them that holds a marker
is encoded with special tokens read as text (markers dropped), everything else exactly as before.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
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


def _strings(value: Any) -> list[str]:
    """Every string inside a message list (values, not keys)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _unused_char(texts: list[str]) -> str:
    """A private-use character that occurs in none of `texts`."""
    seen = set().union(*map(set, texts))
    planes = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))
    return next(c for plane in planes for c in map(chr, plane) if c not in seen)


def _break_specials(value: Any, whole: re.Pattern[str], marker: str) -> Any:
    """`value` with every special token in its strings broken by `marker`: inserted after the
    first character (before a one-character token, which `whole` then skips). Repeated until
    none is left whole: breaking one match can expose an overlapping one."""
    if isinstance(value, str):

        def broken(match: re.Match[str]) -> str:
            token = match[0]
            return token[0] + marker + token[1:] if len(token) > 1 else marker + token

        while whole.search(value):
            value = whole.sub(broken, value)
        return value
    if isinstance(value, dict):
        return {k: _break_specials(v, whole, marker) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_break_specials(v, whole, marker) for v in value]
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        # encode() reads special tokens as plain text by switching the tokenizer's
        # `encode_special_tokens` for the call, under this lock: a second copy for it held
        # ~150 MB at a 248k-token vocabulary (Qwen3.6), as much as its first
        self._encoding = threading.Lock()
        added_by_id = self._tok.get_added_tokens_decoder()
        added = added_by_id.values()
        # longest first: at one position the longest token wins, as in the tokenizer itself
        self._specials = sorted({t.content for t in added if t.special}, key=len, reverse=True)
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
        self._added_ids = {t.content: i for i, t in added_by_id.items()}
        # the decoder's own JSON (serializing the whole tokenizer to read it took 0.6 s on a
        # 248k-token vocabulary)
        decoder = self._tok.decoder
        self._byte_level = decoder is not None and b"ByteLevel" in decoder.__getstate__()

    def __getstate__(self) -> dict[str, Any]:
        # pickled whole (a Ray Serve ingress holds one), less its lock, which cannot be
        state = self.__dict__.copy()
        del state["_encoding"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._encoding = threading.Lock()

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` tokenizer itself (for libraries that read the vocabulary)."""
        return self._tok

    def token_text(self, token_id: int) -> str:
        """One token decoded alone (special tokens as their text): a logprobs entry's
        `token`; a token holding part of a UTF-8 character decodes to U+FFFD, as in vLLM."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry (added tokens included) spelled exactly `text`."""
        found: int | None = self._tok.token_to_id(text)
        return found

    def vocab_entry(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` as spelled there (None past the vocabulary)."""
        text: str | None = self._tok.id_to_token(token_id)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a logprobs entry's `bytes`): exact also for a token
        that holds part of a multi-byte character."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in self._added_ids:
            return piece.encode()
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)) is not None:  # byte fallback
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # sentencepiece's word marker

    def fingerprint(self) -> int:
        """Identity of the id <-> token mapping (two tokenizers that agree here are
        interchangeable for speculative decoding)."""
        return hash(frozenset(self._tok.get_vocab(with_added_tokens=True).items()))

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True
    ) -> list[int]:
        """`parse_special`: read special-token text in `text` as those tokens (else as plain
        text). `add_special_tokens`: the tokenizer's own additions, such as a BOS."""
        with self._encoding:
            self._tok.encode_special_tokens = not parse_special
            try:
                return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
            finally:
                self._tok.encode_special_tokens = False

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template has a place for tool definitions (`tools`)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> str:
        """`variables`: the template's other variables (a request's chat_template_kwargs and
        reasoning_effort); the names set here are not among them (the request check refuses
        those). `continue_final`: the text ends with the last message's content, left open for
        the model to go on (transformers' `continue_final_message`: the rendering cut after
        that content's last occurrence)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        rendered = _compile(self.chat_template).render(
            **(variables or {}),
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        if not continue_final:
            return rendered
        final = messages[-1].get("content") if messages else None
        if isinstance(final, list):  # content parts: the last one's text
            final = final[-1].get("text") if final and isinstance(final[-1], dict) else None
        for text in (final, final.strip() if isinstance(final, str) else None):
            if text and (at := rendered.rfind(text)) >= 0:
                return rendered[: at + len(text)]
        raise ValueError("the final message's content is not in the rendered chat to continue")

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        expand: Callable[[str], str] | None = None,
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """The chat's token ids: the template's special tokens as control tokens, the messages'
        (and tool definitions') text as plain text (see the module docstring). `expand`
        rewrites the rendered text before it is encoded (a video placeholder into its frames':
        client text cannot spell a special token there, it is broken first)."""
        if not self._specials:
            rendered = self.render_chat(
                messages, add_generation_prompt, tools, variables, continue_final
            )
            rendered = rendered if expand is None else expand(rendered)
            return self.encode(rendered, add_special_tokens=False)
        texts = _strings([messages, tools, variables])
        fixed = [
            *self._specials,
            self.chat_template or "",
            self.bos_token or "",
            self.eos_token or "",
        ]
        marker = _unused_char([*texts, *fixed])
        alternatives = "|".join(map(re.escape, self._specials))
        # a special token not preceded by the marker (a broken one-character token is)
        whole = re.compile(f"(?<!{re.escape(marker)})(?:{alternatives})")
        rendered = self.render_chat(
            _break_specials(messages, whole, marker),
            add_generation_prompt,
            None if tools is None else _break_specials(tools, whole, marker),
            None if variables is None else _break_specials(variables, whole, marker),
            continue_final,
        )
        if expand is not None:
            rendered = expand(rendered)
        # Between two of the template's special tokens (and at either end): plain text where a
        # marker shows client text broke a token there; the rest encoded as one stretch.
        edges = [0, *(i for m in whole.finditer(rendered) for i in m.span()), len(rendered)]
        ids: list[int] = []
        done = 0  # rendered[:done] is encoded
        for start, end in zip(edges[::2], edges[1::2], strict=True):
            if marker in rendered[start:end]:
                ids += self.encode(rendered[done:start], add_special_tokens=False)
                text = rendered[start:end].replace(marker, "")
                ids += self.encode(text, add_special_tokens=False, parse_special=False)
                done = end
        return ids + self.encode(rendered[done:], add_special_tokens=False)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the character a byte-level BPE vocabulary
    writes for each byte -> that byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class IncrementalDetokenizer:
    """Text deltas for a growing id list, never splitting a multi-byte character.

    Decodes a short window [prefix_offset, end) and emits only what extends the previous window's
    text, holding back output while it ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        ids, skip = self.ids, self.skip
        prefix_text = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip)
        new_text = self.tokenizer.decode(ids[self.prefix_offset :], skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""
