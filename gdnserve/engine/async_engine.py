"""The engine as the server sees it (``engine_api.AsyncEngineClient``): the synchronous LLMEngine steps
on one worker thread; requests are added and aborted under a lock from the event loop, and each
request's outputs are handed to its own asyncio queue with ``call_soon_threadsafe``. A failing step
fails the requests that were in it, never the process."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator

from gdnserve.engine.engine_api import GenerateRequest, RequestOutput, ScoreResult
from gdnserve.engine.llm_engine import LLMEngine


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="gdnserve-engine", daemon=True)
        self._thread.start()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:                         # raises ValueError for bad input: the server answers 400
            rid = self.engine.add_request(req.request_id, req.prompt, req.params, req.checkpoint_at)
            self._queues[rid] = (loop, q)
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not finished:                     # the client went away or the consumer stopped early
                with self._lock:
                    self.engine.abort(rid)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)

    async def score(self, prefix, candidates, label_token_ids=None) -> ScoreResult:
        def run() -> ScoreResult:
            with self._lock:                     # between two engine steps
                return self.engine.score(prefix, candidates, label_token_ids)
        return await asyncio.to_thread(run)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self.engine.stats()

    def _deliver(self, rid: str, item: Any) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    continue
                in_step = [r.request_id for r in self.engine.running] + [r.request_id for r in self.engine.waiting]
                try:
                    outs = self.engine.step()
                    err = None
                except Exception as e:           # noqa: BLE001  one bad step fails its requests only
                    outs, err = [], e
                    for rid in in_step:
                        self.engine.abort(rid)
            if err is not None:
                for rid in in_step:
                    self._deliver(rid, RuntimeError(f"engine step failed: {err!r}"))
            for out in outs:
                self._deliver(out.request_id, out)
