"""gpt-oss's harmony output at the HTTP edge: its channels split into `reasoning_content`
(what vLLM's gpt-oss reasoning parser returns), `content` and `tool_calls`, whole or streamed.

A harmony vocabulary (`<|start|>`, `<|channel|>`, `<|message|>`, `<|end|>`, `<|call|>`,
`<|return|>` as special tokens) marks the model; its requests are then detokenized with the
special tokens kept, and the text after the prompt's `<|start|>assistant` reads
    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
one message per header: the `analysis` channel is reasoning, `final` the answer, a
`commentary` message with a recipient (`to=functions.NAME`, in the header before or after the
channel) a tool call whose body is its JSON arguments, one without a recipient (a preamble)
content. `<|return|>` and `<|call|>` end generation (convert.py makes them the end-of-generation
ids instead of `<|end|>`, as llama.cpp does), so they never reach the text. Text outside any
message (a model that does not follow the format) is content.
"""

from __future__ import annotations

import functools
import re
import uuid
from dataclasses import dataclass, field

from quickdraft.server.protocol import FunctionCall
from quickdraft.server.responses import DeltaFunction, DeltaToolCall, OutputToolCall
from quickdraft.server.tools import partial_suffix
from quickdraft.tokenizer import Tokenizer

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
HARMONY = (START, CHANNEL, MESSAGE, *ENDS)
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


@functools.cache
def is_harmony(tokenizer: Tokenizer) -> bool:
    """Whether the vocabulary holds every harmony marker as one special token."""
    return all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in HARMONY) and all(
        tokenizer.decode(tokenizer.encode(t, add_special_tokens=False)) == "" for t in HARMONY
    )


@dataclass(frozen=True, slots=True)
class Header:
    channel: str  # analysis | final | commentary | "" (none given)
    recipient: str | None  # "functions.get_weather", or None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        return cls(channel[1] if channel else "", recipient[1] if recipient else None)

    @property
    def tool(self) -> str | None:
        """The function a commentary message calls (None: not a call)."""
        if self.recipient is None:
            return None
        return self.recipient.removeprefix("functions.")


@dataclass(frozen=True, slots=True)
class Parsed:
    reasoning: str | None
    content: str | None
    calls: list[OutputToolCall]


def _call(name: str, arguments: str) -> OutputToolCall:
    return OutputToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=name, arguments=arguments.strip()),
    )


def parse_harmony(text: str) -> Parsed:
    """A whole output -> its reasoning, content and tool calls."""
    stream = HarmonyStream()
    reasoning, content, _ = stream.push(text)
    r2, c2, _ = stream.flush()
    return Parsed(reasoning + r2 or None, content + c2 or None, stream.done)


@dataclass
class HarmonyStream:
    """Streamed text deltas -> (reasoning, content, tool-call deltas) deltas.

    A header is held until its `<|message|>`; a message body is passed on as it comes (a tool
    call's arguments held until the call ends), holding back any tail that could still be the
    start of a marker."""

    held: str = ""
    done: list[OutputToolCall] = field(default_factory=list)  # the calls closed so far
    _header: Header | None = field(default=None, repr=False)  # None: reading a header
    _args: str = field(default="", repr=False)

    def push(self, text: str) -> tuple[str, str, list[DeltaToolCall]]:
        self.held += text
        reasoning, content, deltas = "", "", list[DeltaToolCall]()
        while True:
            if self._header is None:
                at = self.held.find(MESSAGE)
                if at < 0:
                    return reasoning, content, deltas
                self._header = Header.parse(self.held[:at])
                self.held = self.held[at + len(MESSAGE) :]
                continue
            end, marker = _first(self.held, (*ENDS, START))
            body = self.held if end < 0 else self.held[:end]
            if end < 0:  # keep what could be a marker's start
                keep = max(partial_suffix(self.held, m) for m in (*ENDS, START))
                body = self.held[: len(self.held) - keep]
            r, c = self._route(body)
            reasoning, content = reasoning + r, content + c
            if end < 0:
                self.held = self.held[len(body) :]
                return reasoning, content, deltas
            self.held = self.held[end + len(marker) :]
            deltas += self._close()

    def flush(self) -> tuple[str, str, list[DeltaToolCall]]:
        """What is still held at the end: an unfinished body as its channel's text, an
        unfinished header (or text that never opened a message) as content."""
        text, self.held = self.held, ""
        if self._header is None:
            return "", text if not self.done else "", []
        r, c = self._route(text)
        return r, c, self._close()

    def _route(self, body: str) -> tuple[str, str]:
        assert self._header is not None
        if self._header.tool is not None:
            self._args += body
            return "", ""
        if self._header.channel == "analysis":
            return body, ""
        return "", body

    def _close(self) -> list[DeltaToolCall]:
        header, self._header = self._header, None
        if header is None or header.tool is None:
            return []
        call = _call(header.tool, self._args)
        self._args = ""
        self.done.append(call)
        return [
            DeltaToolCall(
                index=len(self.done) - 1,
                id=call.id,
                type="function",
                function=DeltaFunction(name=call.function.name, arguments=call.function.arguments),
            )
        ]


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of `markers` in `text`: (index, marker), or (-1, "")."""
    best, which = -1, ""
    for m in markers:
        at = text.find(m)
        if at >= 0 and (best < 0 or at < best):
            best, which = at, m
    return best, which
