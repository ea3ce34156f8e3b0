"""Shutdown past the grace period (issue 31): requests still open when ``--shutdown-timeout`` runs out are
answered, not cut: a stream ends with a 503 ``server_shutdown`` error event and ``data: [DONE]``, a
non-streamed request or a score gets that 503 as JSON, and their engine requests are aborted. A request that
finishes within the grace period is answered as usual. Against the fake engine's server process, stopped by
SIGTERM as a user or an orchestrator stops it."""
from __future__ import annotations

import json
import re
import signal
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from gdnserve.entrypoints.shutdown import ANSWER_S
from tests.entrypoints.live_server import FAKE, start_server

GRACE = 0.6


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as e:  # the assertions below name what the client saw
            out["error"] = repr(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_open_requests_are_answered_at_the_end_of_the_grace_period(tmp_path):
    log_path = tmp_path / "server.log"
    proc, url, log = start_server(["--shutdown-timeout", str(GRACE)], log_path, timeout_s=60, command=FAKE)
    try:
        first_event = threading.Event()

        def stream() -> list[str]:
            with httpx.Client(base_url=url, timeout=20) as c, c.stream(
                    "POST", "/v1/completions", json={"prompt": "HANG on", "max_tokens": 50, "stream": True}) as r:
                events = []
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        first_event.set()
                return events

        def post(path: str, body: dict) -> tuple[int, dict]:
            r = httpx.post(url + path, json=body, timeout=20)
            return r.status_code, r.json()

        streamed, s_out = _in_thread(stream)
        waiting, w_out = _in_thread(lambda: post("/v1/completions", {"prompt": "HANG here", "max_tokens": 50}))
        scoring, c_out = _in_thread(lambda: post("/v1/score", {"prefix": "HANG", "candidates": ["a"]}))
        assert first_event.wait(10), s_out
        time.sleep(0.3)  # the other two reach the engine
        # finishes within the grace period (10 tokens, 20 ms each): answered as usual
        quick, q_out = _in_thread(lambda: post("/v1/completions", {"prompt": "SLOW but done", "max_tokens": 10}))
        time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in (streamed, waiting, scoring, quick):
            t.join(GRACE + ANSWER_S + 5)
        answered = time.monotonic() - t0
        assert proc.wait(10) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught once it is done
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = log_path.read_text()

    assert q_out.get("result", (None,))[0] == 200, (q_out, text)
    assert GRACE - 0.1 < answered < GRACE + ANSWER_S - 1, answered  # after the grace, by the app (not uvicorn's cut)

    events = s_out.get("result")
    assert events is not None, (s_out, text)
    assert events[-1] == "data: [DONE]", events
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (err["code"], err["type"]) == ("server_shutdown", "server_error") and "shutting down" in err["message"]
    rid = json.loads(events[0].removeprefix("data: "))["id"]

    for out in (w_out, c_out):
        status, body = out.get("result", (None, out))
        assert status == 503, (out, text)
        assert (body["error"]["code"], body["error"]["type"]) == ("server_shutdown", "server_error")

    aborted = re.findall(r"^aborted (\S+)$", text, re.M)
    assert f"{rid}-0" in aborted and len(aborted) == 2, (aborted, text)  # the stream's and the waiting request's



def test_one_app_serves_several_event_loops_and_close_reaches_each():
    """One app, requests from two event loops in turn (tests and embedders start several in a process): the
    shutdown event is the running loop's own. One event made with the app bound itself to the first loop that
    waited on it; in a later loop every request's shutdown watcher then died ("bound to a different event loop")
    and close() no longer ended its requests: the slow one below ran to its end (200) instead of the 503."""
    import asyncio

    from tests.entrypoints.fake_engine import MODEL, FakeEngine, build_app, expected

    app = build_app(FakeEngine())
    srv = app.state.server

    async def post(prompt: str, max_tokens: int, close_after: float | None = None) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            req = asyncio.ensure_future(c.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                         "max_tokens": max_tokens}))
            if close_after is not None:
                await asyncio.sleep(close_after)
                srv.close()
            return await asyncio.wait_for(req, 10)

    r = asyncio.run(post("hello", 3))                       # the first loop
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected("hello", 3), r.text
    t0 = time.monotonic()
    r = asyncio.run(post("SLOW hello", 200, close_after=0.3))   # a second loop: 4 s of tokens, closed at 0.3 s
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown", r.text
    assert time.monotonic() - t0 < 2.0
    r = asyncio.run(post("hello", 3))                       # a loop started after close(): refused at once
    assert r.status_code == 503, r.text
