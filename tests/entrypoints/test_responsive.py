"""The event loop stays free (issue 31): while one request makes the server parse, tokenize or format megabytes
(or sends a body built to make the nesting check backtrack), /health — and so every other request and stream
— still answers at once. Against the fake engine's server process, so that the test's own threads do not share
the server's GIL."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from tests.entrypoints.live_server import FAKE, start_server

HEALTH_S = 0.6  # the slowest /health allowed while the large request is in flight (before: 0.9-28 s)
MB8 = 8_000_000


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    proc, url, log = start_server([], tmp_path_factory.mktemp("responsive") / "server.log", timeout_s=60,
                                  command=FAKE)
    yield url
    proc.kill()
    proc.wait(10)
    log.close()


def _post(url: str, path: str, body: bytes, stream: bool = False) -> tuple[int, bytes]:
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post(path, content=body, headers={"content-type": "application/json"})
        return r.status_code, r.content


def _slowest_health_during(url: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    """(the slowest /health, ``fn()``): /health asked again and again while ``fn`` runs in a thread (and once
    more after)."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    t.start()
    slowest, running = 0.0, True
    with httpx.Client(base_url=url, timeout=30) as c:
        while running:
            running = t.is_alive()
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.02)
    t.join()
    return slowest, out["result"]


def test_a_body_built_to_backtrack_does_not_stall(url):
    # an unterminated string of escaped quotes: the old regex string skip backtracked in time quadratic in
    # its length (32 KB: 7 s on the event loop, 64 KB: 28 s)
    body = b'{"prompt":"' + b'\\"' * 16_000
    slowest, (status, content) = _slowest_health_during(url, lambda: _post(url, "/v1/completions", body))
    assert status == 400 and "Unterminated string" in json.loads(content)["error"]["message"]
    assert slowest < HEALTH_S, slowest


LARGE = {  # a body or response of megabytes: (path, body, expected status, what a 400 says)
    "chat content": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * MB8}]}, 400,
                     "context length"),
    "token ids": ("/v1/completions", {"prompt": [7] * (MB8 // 3)}, 400, "context length"),
    "400 K messages": ("/v1/chat/completions", {"messages": [{"role": "user"}] * 400_000}, 400, "arrays/objects"),
    "echo + logprobs response": ("/v1/completions", {"prompt": ["x" * 120] * 64, "echo": True, "logprobs": 20,
                                                     "n": 6, "max_tokens": 100}, 200, None),
}


@pytest.mark.parametrize("case", LARGE)
def test_megabytes_to_parse_tokenize_or_format_do_not_stall(url, case):
    path, body, status, says = LARGE[case]
    raw = json.dumps(body).encode()
    slowest, (got, content) = _slowest_health_during(url, lambda: _post(url, path, raw))
    assert got == status, content[:300]
    assert slowest < HEALTH_S, slowest
    if says is not None:  # parsed (and tokenized) in full, or counted before parsing, then refused
        assert says in json.loads(content)["error"]["message"]
    else:  # 384 choices, each the echoed prompt and 100 tokens with 20 top logprobs each
        choices = json.loads(content)["choices"]
        assert len(choices) == 384 and all(len(c["logprobs"]["tokens"]) == 220 for c in choices)
