"""Tool calling at the HTTP edge: the prompt side (tool definitions and results into the chat) and
the output side (the model's `<tool_call>` blocks into OpenAI `tool_calls`, whole or streamed).

Format: Hermes / Qwen2.5 (what Qwen2.5 and Qwen3 are trained on): a call is
    <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
and several calls follow each other. A chat template that knows tools renders them itself (it
reads `tools`, `message.tool_calls`, `role: tool`); for one that does not, `hermes_messages`
writes the same system prompt, calls and `<tool_response>` turns as plain messages, so any model
can be offered tools. A forced call (`tool_choice` required / named) is enforced by a grammar
(grammar.py), so it parses; with `auto`, text that is not a well-formed call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from quickdraft.server.protocol import (
    FunctionCall,
)
from quickdraft.server.responses import (
    DeltaFunction,
    DeltaToolCall,
    OutputToolCall,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The chat with tool definitions, calls and results written as plain text turns, for a
    template that has no place for them."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = _SYSTEM.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
            continue
        if m.get("tool_calls"):
            calls = [
                f"{OPEN}\n{json.dumps(_call_body(c), ensure_ascii=False)}\n{CLOSE}"
                for c in m["tool_calls"]
            ]
            content = "\n".join([m["content"], *calls] if m["content"] else calls)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": content}
        out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def _call_body(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"name": fn["name"], "arguments": fn["arguments"]}


def _new_call(body: str) -> OutputToolCall | None:
    """One block's JSON -> a tool call (None if it is not {"name": str, "arguments": ...})."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return OutputToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=value["name"], arguments=arguments),
    )


def parse_tool_calls(text: str) -> tuple[str | None, list[OutputToolCall]]:
    """Generated text -> (content outside the calls, or None if nothing is left; the calls).
    A block that does not parse stays in the content, as written."""
    calls: list[OutputToolCall] = []
    kept: list[str] = []
    done = 0
    for match in _BLOCK.finditer(text):
        call = _new_call(match.group(1))
        if call is None:
            continue
        kept.append(text[done : match.start()])
        calls.append(call)
        done = match.end()
    kept.append(text[done:])
    content = "".join(kept).strip() if calls else "".join(kept)
    return (content or None), calls


@dataclass
class ToolCallStream:
    """Streamed text deltas -> content deltas and whole tool-call deltas.

    Text that could still be the start of `<tool_call>` is held back; inside a block everything
    is held until `</tool_call>`, then the call is sent as one delta (id, name, arguments)."""

    held: str = ""
    calls: int = 0
    _in_block: bool = field(default=False, repr=False)

    def push(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        self.held += text
        content, deltas = "", list[DeltaToolCall]()
        while True:
            if not self._in_block:
                start = self.held.find(OPEN)
                if start < 0:
                    keep = partial_suffix(self.held, OPEN)
                    content += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep :]
                    return self._content(content), deltas
                content += self.held[:start]
                self.held = self.held[start:]
                self._in_block = True
            end = self.held.find(CLOSE)
            if end < 0:
                return self._content(content), deltas
            block = self.held[: end + len(CLOSE)]
            self.held = self.held[end + len(CLOSE) :]
            self._in_block = False
            call = _new_call(block[len(OPEN) : -len(CLOSE)])
            if call is None:
                content += block
                continue
            deltas.append(
                DeltaToolCall(
                    index=self.calls,
                    id=call.id,
                    type="function",
                    function=DeltaFunction(
                        name=call.function.name, arguments=call.function.arguments
                    ),
                )
            )
            self.calls += 1

    def _content(self, text: str) -> str:
        # the newlines between two calls are layout, not content
        return "" if self.calls and not text.strip() else text

    def flush(self) -> str:
        """What is still held at the end (an unfinished block stays text)."""
        text, self.held, self._in_block = self.held, "", False
        return text if self.calls == 0 else text.strip()


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
