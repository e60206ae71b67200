"""`quickdraft serve` as a real process for tests: a free loopback port, start-up awaited on
/health, the process ended (and its log returned) however the test ends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ServeProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: str = field(default="")  # the whole log, once the process has ended

    def wait(self, timeout: float = 60) -> int:
        """The exit status, after the process has ended on its own (a liveness bound only)."""
        out, _ = self.proc.communicate(timeout=timeout)
        self.log = out.decode()
        return self.proc.returncode


@contextmanager
def serve_process(model_dir: Path, *args: str) -> Iterator[ServeProcess]:
    """`quickdraft serve model_dir --dtype fp32 --served-model-name tiny *args` on a free port."""
    port = free_port()
    cmd = [sys.executable, "-m", "quickdraft", "serve", str(model_dir), "--dtype", "fp32"]
    cmd += ["--served-model-name", "tiny", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ)
    server = ServeProcess(proc, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 120  # a liveness bound for start-up, not a speed claim
        while True:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read().decode())  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
        if not server.log:
            server.wait(30)
