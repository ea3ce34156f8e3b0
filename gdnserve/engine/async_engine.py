"""The engine as the server sees it (``engine_api.AsyncEngineClient``). The synchronous LLMEngine runs on its
own thread behind a command queue: the event loop only validates (pure functions of the frozen config),
enqueues and awaits. Nothing on the event loop takes an engine lock or waits for a step: ``generate``,
``abort`` and ``score`` post commands, ``stats`` reads the snapshot the engine thread publishes after every
step. Outputs go to each request's own asyncio queue (score results to a future) with
``call_soon_threadsafe``. A request the engine fails (its step raised and it was isolated as the cause) gets
the error; every other request continues."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, AsyncIterator

from gdnserve.engine.engine_api import EngineDeadError, GenerateRequest, RequestOutput, ScoreResult
from gdnserve.engine.llm_engine import LLMEngine
from gdnserve.engine.scheduling.engine_stats import StepReport

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._stats: dict[str, Any] = engine.stats()
        self.on_dead = None      # called once (engine thread) with the message when the engine dies (serve: exit 1)
        self._thread = threading.Thread(target=self._run, name="gdnserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the event loop's side
    def _post(self, cmd: tuple) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        # raises ValueError for bad input (the server answers 400); reads only the frozen config
        job = self.engine.make_request(req.request_id, req.prompt, req.params, req.checkpoint_at)
        rid = job.request_id
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        self._streams[rid] = (loop, q)
        self._post(("submit", job))
        finished = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished:                     # the client went away or the consumer stopped early
                self._post(("abort", rid))

    async def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    async def score(self, prefix, candidates, label_token_ids=None) -> ScoreResult:
        loop = asyncio.get_running_loop()
        job = self.engine.make_score(None, prefix, candidates, label_token_ids)    # ValueError: 400
        fut = loop.create_future()
        self._futures[job.request_id] = (loop, fut)
        self._post(("submit", job))
        try:
            return await fut
        finally:
            # a cancelled caller (its client went away) cancels ``fut`` too: abort unless a result came
            if self._futures.pop(job.request_id, None) is not None and (fut.cancelled() or not fut.done()):
                self._post(("abort", job.request_id))

    def stats(self) -> dict[str, Any]:
        """The snapshot published after the engine's last step (no lock, no wait)."""
        return dict(self._stats)

    def is_alive(self) -> bool:
        """The engine thread runs (a replica's health check)."""
        return self._thread.is_alive()

    def checkpoint_keys(self) -> tuple[list[bytes], list[bytes], list[int]]:
        """READY keys, PENDING keys and READY lengths of the engine's checkpoints, its host and disk tiers' included
        as READY (a replica's routing stats; read from another thread, as a snapshot may be)."""
        return self.engine.checkpoint_keys()

    def set_step_observer(self, observer: Callable[[StepReport], None] | None) -> None:
        """``observer(report)`` after every engine step, on the engine thread (the server's step-time and
        queue-time histograms); a later call replaces it."""
        self.engine.set_step_observer(observer)

    # ------------------------------------------------------------------ the engine thread
    def _deliver(self, rid: str, item: Any) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)
            return
        fut = self._futures.get(rid)
        if fut is not None:
            loop, f = fut
            setter = f.set_exception if isinstance(item, BaseException) else f.set_result
            loop.call_soon_threadsafe(lambda: None if f.done() else setter(item))

    def _drain(self) -> None:
        while True:
            try:
                cmd, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd == "submit":
                try:
                    self.engine.submit(arg)
                except (ValueError, EngineDeadError) as e:
                    self._deliver(arg.request_id, e)
            else:
                self.engine.abort(arg)

    def _run(self) -> None:
        e = self.engine
        while True:
            self._wake.clear()
            self._drain()
            if not e.has_unfinished():
                self._stats = e.stats()
                self._wake.wait()
                continue
            idle = e.counts.idle_steps
            try:
                outs = e.step()
            except Exception as err:             # noqa: BLE001  rolled back; the culprit is isolated next
                logger.warning("engine step failed (isolating the request that causes it): %r", err)
                outs = []
            for out in outs:
                self._deliver(out.request_id, RuntimeError(f"request failed in the engine: {out.error}")
                              if out.error else out)
            for rid in list(e.scores):
                self._deliver(rid, e.take_score(rid))
            self._stats = e.stats()
            if e.dead is not None and self.on_dead is not None:
                on_dead, self.on_dead = self.on_dead, None
                on_dead(e.dead)
            if e.counts.idle_steps != idle:      # nothing could run (waiting on room): do not spin
                self._wake.wait(0.005)
