"""Safe loopback defaults (issue 13): JSON bodies only (415), the Host check against DNS rebinding (403
unless allowed), Origin checks and CORS for listed origins, OPTIONS answered, the API key on /metrics."""
from __future__ import annotations

import pytest

# test-only dependencies (the [test] extra); a machine without them skips this file with the reason
httpx = pytest.importorskip("httpx")

from gdnserve.entrypoints.config import ServerConfig, is_loopback_name, split_host
from tests.entrypoints.fake_engine import Served, FakeEngine

C = "/v1/completions"
BODY = b'{"prompt": "abc", "max_tokens": 2}'


@pytest.fixture(scope="module")
def default():
    s = Served(FakeEngine())
    yield s
    s.stop()


def post(s: Served, headers: dict, path: str = C, body: bytes = BODY) -> httpx.Response:
    with httpx.Client(base_url=s.url, timeout=10) as c:
        return c.post(path, content=body, headers={"content-type": "application/json", **headers})


def code(r: httpx.Response) -> str | None:
    return r.json()["error"]["code"]


def test_json_only(default):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        r = post(default, {"content-type": ctype})
        assert r.status_code == 415 and code(r) == "unsupported_media_type", (ctype, r.text)
    with httpx.Client(base_url=default.url, timeout=10) as c:
        r = c.post(C, content=BODY)  # no content type at all
        assert r.status_code == 415
        for path in ("/v1/chat/completions", "/v1/score"):
            assert c.post(path, content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
    assert post(default, {"content-type": "application/json; charset=utf-8"}).status_code == 200
    assert post(default, {"content-type": "Application/JSON"}).status_code == 200


@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1", True), ("127.0.0.1:8000", True), ("localhost", True), ("LOCALHOST:1", True), ("127.8.9.10", True),
    ("[::1]:8000", True), ("[::1]", True), ("app.localhost:3000", True),
    ("evil.com", False), ("evil.com:8000", False), ("127.0.0.1.evil.com", False), ("localhost.evil.com", False),
    ("10.0.0.1", False), ("[::2]", False), ("0.0.0.0", False)])
def test_host_check_on_loopback(default, host, ok):
    r = post(default, {"host": host})
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 403 and code(r) == "host_not_allowed" and host in r.json()["error"]["message"]
    with httpx.Client(base_url=default.url, timeout=10) as c:  # GETs too (a rebinding page reads /v1/models)
        assert c.get("/v1/models", headers={"host": host}).status_code == (200 if ok else 403)


def test_allowed_hosts_and_other_binds():
    s = Served(FakeEngine(), config=ServerConfig(allowed_hosts=("my.box", "Other.Box")))
    try:
        assert post(s, {"host": "my.box:8000"}).status_code == 200
        assert post(s, {"host": "other.box"}).status_code == 200
        assert post(s, {"host": "evil.com"}).status_code == 403
        assert post(s, {"host": "localhost"}).status_code == 200
    finally:
        s.stop()
    s = Served(FakeEngine(), config=ServerConfig(host="0.0.0.0"))  # exposed on purpose: no Host check by default
    try:
        assert post(s, {"host": "my.server.example:8000"}).status_code == 200
    finally:
        s.stop()
    s = Served(FakeEngine(), config=ServerConfig(host="0.0.0.0", allowed_hosts=("gpu1.lan",)))
    try:
        assert post(s, {"host": "gpu1.lan"}).status_code == 200
        assert post(s, {"host": "evil.com"}).status_code == 403
    finally:
        s.stop()
    s = Served(FakeEngine(), config=ServerConfig(allowed_hosts=("*",)))
    try:
        assert post(s, {"host": "anything.example"}).status_code == 200
    finally:
        s.stop()


def test_foreign_origin_refused_same_origin_fine(default):
    r = post(default, {"origin": "http://evil.com"})
    assert r.status_code == 403 and code(r) == "origin_not_allowed" and "access-control-allow-origin" not in r.headers
    r = post(default, {"origin": "null"})  # sandboxed frames, file:// pages
    assert r.status_code == 403
    host = default.url.removeprefix("http://")
    assert post(default, {"origin": default.url}).status_code == 200  # a page of this very server
    assert post(default, {"origin": f"http://{host}", "host": host}).status_code == 200
    # the CSRF of the issue: a page POSTs JSON as text/plain (no preflight) with its own Origin
    r = post(default, {"origin": "http://evil.com", "content-type": "text/plain"})
    assert r.status_code == 403


def test_options(default):
    with httpx.Client(base_url=default.url, timeout=10) as c:
        r = c.options(C)
        assert r.status_code == 204 and "POST" in r.headers["allow"]
        r = c.options(C, headers={"origin": "http://evil.com", "access-control-request-method": "POST"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_cors_for_allowed_origins():
    s = Served(FakeEngine(), config=ServerConfig(allowed_origins=("http://app.example:3000", "https://ui.example")))
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.options(C, headers={"origin": "http://app.example:3000", "access-control-request-method": "POST",
                                      "access-control-request-headers": "authorization, content-type"})
            assert r.status_code == 204
            assert r.headers["access-control-allow-origin"] == "http://app.example:3000"
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = post(s, {"origin": "https://ui.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
        assert "Origin" in r.headers["vary"]
        r = post(s, {"origin": "https://ui.example"}, body=b'{"prompt": ""}')  # errors carry CORS headers too
        assert r.status_code == 400 and r.headers["access-control-allow-origin"] == "https://ui.example"
        assert post(s, {"origin": "https://evil.example"}).status_code == 403
    finally:
        s.stop()
    s = Served(FakeEngine(), config=ServerConfig(allowed_origins=("*",)))
    try:
        r = post(s, {"origin": "https://any.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://any.example"
    finally:
        s.stop()


def test_api_key_guards_metrics_unless_public():
    s = Served(FakeEngine(), config=ServerConfig(api_key="k3y"))
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.get("/metrics")
            assert r.status_code == 401 and code(r) == "invalid_api_key"
            assert c.get("/metrics", headers={"authorization": "Bearer k3y"}).status_code == 200
            assert c.get("/health").status_code == 200
            assert c.post(C, content=BODY, headers={"content-type": "application/json"}).status_code == 401
    finally:
        s.stop()
    s = Served(FakeEngine(), config=ServerConfig(api_key="k3y", public_metrics=True))
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            assert c.get("/metrics").status_code == 200
            assert c.get("/v1/models").status_code == 401
    finally:
        s.stop()


def test_host_helpers():
    assert split_host("[::1]:80") == "::1" and split_host("Example.COM:443") == "example.com"
    assert split_host("::1") == "::1" and split_host("a.b") == "a.b"
    assert all(map(is_loopback_name, ["127.0.0.1", "localhost", "x.localhost", "::1", "[::1]", "127.255.0.1"]))
    assert not any(map(is_loopback_name, ["0.0.0.0", "10.1.1.1", "localhost.com", "example.com", "::"]))
