"""Graceful shutdown of a real `quickdraft serve` process: SIGTERM with streams in flight.

SIGTERM stops taking connections, lets the open requests run on (up to --shutdown-timeout),
ends every stream with a final chunk carrying `finish_reason` and `data: [DONE]` ("abort" when
the timeout cuts it), and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import ServeProcess, serve_process

STREAMS = 4


class Stream:
    """One streaming completion read on its own thread; `started` once its first token came."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.started = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "count: 1 2 3"}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            url = self.url + "/v1/chat/completions"
            with httpx.stream("POST", url, json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        if any(c.get("delta", {}).get("content") for c in self._choices(-1)):
                            self.started.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()

    def _choices(self, i: int) -> list[dict[str, Any]]:
        if self.events[i] == "[DONE]":
            return []
        choices: list[dict[str, Any]] = json.loads(self.events[i])["choices"]
        return choices

    def ending(self) -> tuple[str | None, int | None]:
        """(finish_reason of the final chunk, completion tokens in the usage chunk), after
        checking that the stream closed with `data: [DONE]`."""
        self.thread.join(120)  # a liveness bound only
        assert self.error is None, repr(self.error)
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        chunks = range(len(self.events) - 1)
        reasons = [c["finish_reason"] for i in chunks for c in self._choices(i)]
        assert all(r is None for r in reasons[:-1]), "only the final chunk carries a reason"
        usage = json.loads(self.events[-2])["usage"]
        return reasons[-1], usage["completion_tokens"]


def sigterm_during_streams(server: ServeProcess, max_tokens: int) -> list[Stream]:
    streams = [Stream(server.url, max_tokens) for _ in range(STREAMS)]
    for s in streams:
        assert s.started.wait(120) and s.error is None, s.error  # every stream is in flight
    server.proc.send_signal(signal.SIGTERM)
    return streams


def test_server_sigterm_lets_open_streams_finish_then_exits_0(tiny_model_dir: Path) -> None:
    with serve_process(tiny_model_dir, "--speculative-method", "none") as server:
        streams = sigterm_during_streams(server, max_tokens=64)
        # no new connection is taken while the open streams run on
        for _ in range(600):  # until the listening socket is closed (a liveness bound only)
            try:
                httpx.get(server.url + "/health", timeout=5)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                # refused, or reset unanswered: a probe that reached the kernel's backlog as
                # the listening socket closed is dropped, which is also "not taken"
                break
            time.sleep(0.05)
        else:
            pytest.fail("the server kept taking connections after SIGTERM")
        endings = [s.ending() for s in streams]
        assert server.wait() == 0, server.log
    assert endings == [("length", 64)] * STREAMS


def test_server_sigterm_timeout_aborts_open_streams_with_a_final_chunk(
    tiny_model_dir: Path,
) -> None:
    # --shutdown-timeout 0: the open requests are aborted at once, mid-way (of 470 tokens: the
    # most the 512-token context leaves after the prompt)
    args = ["--speculative-method", "none", "--shutdown-timeout", "0"]
    with serve_process(tiny_model_dir, *args) as server:
        streams = sigterm_during_streams(server, max_tokens=470)
        endings = [s.ending() for s in streams]
        assert server.wait() == 0, server.log
    for reason, tokens in endings:
        assert reason == "abort" and tokens is not None and 0 < tokens < 470
