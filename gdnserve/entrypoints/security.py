"""Who may talk to the server, checked before any route runs (an ASGI middleware), the way Jupyter guards
a local server:

- **Host** (DNS rebinding): bound to a loopback address, a request whose ``Host`` is not a loopback name
  (``localhost``, ``*.localhost``, 127.0.0.0/8, ``[::1]``) is refused with 403 unless ``--allowed-hosts``
  lists it. Bound elsewhere, the check applies only when ``--allowed-hosts`` is given.
- **Origin** (CSRF from a web page): a request that carries an ``Origin`` other than its own host is
  refused with 403 unless ``--allowed-origins`` lists it; listed origins get CORS headers, and their
  preflight ``OPTIONS`` is answered 204 with the allowed methods and headers. ``OPTIONS`` without an
  ``Origin`` is answered 204 with ``Allow``. (JSON-only bodies, 415 otherwise, are checked per route.)
"""
from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from gdnserve.entrypoints.config import ServerConfig, is_loopback_name, split_host

ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type"


def error_body(message: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": code}}).encode()


async def send_json(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class AccessGuard:
    """ASGI middleware: the Host and Origin checks, CORS headers and OPTIONS (module docstring)."""

    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app, self.cfg = app, config
        self.hosts = {h.strip().lower() for h in config.allowed_hosts if h.strip()}
        self.origins = {o.strip().rstrip("/").lower() for o in config.allowed_origins if o.strip()}

    def host_ok(self, host: str | None) -> bool:
        if host is None or "*" in self.hosts:
            return True   # HTTP/1.0 without Host: no browser sends that
        name = split_host(host)
        if is_loopback_name(name) or name in self.hosts:
            return True
        return not (self.cfg.loopback or self.hosts)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin.rstrip("/").lower() in self.origins

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not self.host_ok(host):
            return await send_json(send, 403, error_body(
                f"Host {host!r} is not allowed: this server is bound to {self.cfg.host} and answers loopback "
                "names only (start it with --allowed-hosts NAME to accept that name)", "host_not_allowed"))
        origin = headers.get("origin")
        cors = origin is not None and self.origin_allowed(origin)
        if origin is not None and not cors and not _same_origin(origin, host):
            return await send_json(send, 403, error_body(
                f"Origin {origin!r} is not allowed (start the server with --allowed-origins {origin} to let "
                "pages of that origin call it)", "origin_not_allowed"))
        if scope["method"] == "OPTIONS":
            extra = [(b"allow", ALLOW_METHODS.encode())]
            if cors:
                extra += _cors_headers(origin) + [
                    (b"access-control-allow-methods", ALLOW_METHODS.encode()),
                    (b"access-control-allow-headers",
                     headers.get("access-control-request-headers", ALLOW_HEADERS).encode("latin-1")),
                    (b"access-control-max-age", b"600")]
            await send({"type": "http.response.start", "status": 204, "headers": extra})
            return await send({"type": "http.response.body", "body": b""})
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
            await send(message)
        await self.app(scope, receive, send_with_cors)


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


def _same_origin(origin: str, host: str | None) -> bool:
    try:
        netloc = urlsplit(origin).netloc.lower()
    except ValueError:
        return False
    return bool(host) and netloc == host.strip().lower()
