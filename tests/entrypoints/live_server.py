"""Start a real `gdnserve serve` process (the real-engine and the tensor-parallel server tests), or the fake
engine's server process (``FAKE``), on a free loopback port and wait for /health."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SERVE = ["gdnserve.cli", "serve", "--device", "cpu"]
FAKE = ["tests.entrypoints.fake_engine"]  # run_server over fake_engine.FakeEngine


def start_server(flags: list[str], log_path: Path, timeout_s: float = 120,
                 command: list[str] = SERVE) -> tuple[subprocess.Popen, str, object]:
    """`python -m *command --port P *flags` (default `gdnserve serve --device cpu`), its output in ``log_path`` (a
    file, not a pipe nobody reads: the access log would fill it). Returns (process, base url, open log file);
    raises with the log when the server exits or is not healthy within ``timeout_s``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", *command, "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            raise RuntimeError("server did not start:\n" + log_path.read_text(errors="replace"))
        time.sleep(0.2)
