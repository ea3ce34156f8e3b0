"""Shutdown that ends open requests with an answer, not a cut connection.

uvicorn's shutdown stops accepting connections, waits ``timeout_graceful_shutdown`` seconds for the open
ones, then cancels the tasks that serve them: a stream stops mid-way with no error event and no
``data: [DONE]``, a waiting client sees its connection closed, and the app hears of the shutdown (the
lifespan event) only afterwards. ``GracefulServer`` instead calls ``end_requests`` (the app's
``_Server.close``) when the grace period is over, on the event loop: every open request then answers
for itself (a 503 ``server_shutdown``, as an SSE error event + ``[DONE]`` for a stream) and aborts its engine
requests. uvicorn's own timeout, ``ANSWER_S`` later, only cuts what could not answer (a client that
stopped reading).
"""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import uvicorn

ANSWER_S = 5.0  # seconds the open requests get to send their 503 before uvicorn cancels them


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose shutdown calls ``end_requests()`` after ``grace_s`` seconds; ``config``'s
    ``timeout_graceful_shutdown`` becomes ``grace_s + ANSWER_S``. With ``grace_s`` None open requests get
    all the time they need (uvicorn's None)."""

    def __init__(self, config: uvicorn.Config, end_requests: Callable[[], None], grace_s: float | None) -> None:
        config.timeout_graceful_shutdown = None if grace_s is None else grace_s + ANSWER_S
        super().__init__(config)
        self.end_requests, self.grace_s = end_requests, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = None
        if self.grace_s is not None:
            timer = asyncio.get_running_loop().call_later(self.grace_s, self.end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
