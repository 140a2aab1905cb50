"""Start a real ``swiftserve serve`` process on 127.0.0.1 (for tests and benchmarks), and stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", headers=headers or {}).text
        values = {}
        for line in text.splitlines():
            if line.startswith("swiftserve:") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values


@contextlib.contextmanager
def running_server(
    model: Path | None,
    *args: str,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    startup_s: float = 180,
) -> Iterator[Server]:
    port = free_port()
    log = (log_dir or Path("/tmp")) / f"swiftserve-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "swiftserve.cli",
        "serve",
        *(["--model", str(model)] if model is not None else []),  # None: the built-in demo
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield Server(url, proc, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
