"""A fake engine for the server tests: implements ``AsyncEngineClient`` deterministically, and ``Served``,
the real uvicorn server in a thread on loopback over an app built on it.

The fake "model" cycles through the prompt's plain (non-special) tokens: sample j of a prompt whose plain
bytes are ``b`` generates ``b[j], b[j+1], ...``, so every expected text is known. Token logprobs are
``-0.5 - 0.01 * step`` with alternatives one nat apart. A prompt holding SLOW generates slowly, RAISE
fails after two tokens, ENDEARLY ends without a finished output, HANG never finishes (one token, then
nothing until it is aborted; a score prefix too), BADVALUE is refused with a ValueError as the real engine
refuses bad markers.

``python -m tests.entrypoints.fake_engine --port P [--shutdown-timeout S]`` serves it through ``run_server``
in a process of its own (printing ``aborted <request id>`` for each abort), for the tests that need the server
out of the test's GIL or a real shutdown.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator

import pytest

uvicorn = pytest.importorskip("uvicorn")  # the server's own deps: a machine without them skips with the reason
pytest.importorskip("fastapi")

from gdnserve.engine.engine_api import (CandidateScore, CheckpointInfo, CompletionOutput, GenerateRequest,
                                        RequestOutput, ScoreResult)
from gdnserve.entrypoints.config import ServerConfig
from gdnserve.entrypoints.server import build_app, run_server
from gdnserve.entrypoints.shutdown import GracefulServer
from gdnserve.models.tokenizer import ByteTokenizer

MODEL = "fake-gdn"
MAX_LEN = 256
TOK = ByteTokenizer()


class FakeEngine:
    model_name = MODEL
    max_model_len = MAX_LEN

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.aborted: list[str] = []
        self.active: set[str] = set()
        self.seen: list[GenerateRequest] = []
        self.published: set[tuple[int, ...]] = set()
        self.counts = {"tokens_generated": 0, "checkpoint_hits": 0, "requests_finished": 0}
        self.misses: dict[str, int] = {}
        self.fail_score = False

    def _lookup(self, ids: list[int], publish_at: int | None) -> CheckpointInfo:
        hit = max((len(k) for k in self.published if len(k) < len(ids) and tuple(ids[:len(k)]) == k), default=0)
        if hit:
            self.counts["checkpoint_hits"] += 1
        else:
            self.misses["absent"] = self.misses.get("absent", 0) + 1
        published = publish_at is not None and tuple(ids[:publish_at]) not in self.published
        if published:
            self.published.add(tuple(ids[:publish_at]))
        return CheckpointInfo(hit, None if hit else "absent", published)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.seen.append(req)
        ids = req.prompt if isinstance(req.prompt, list) else self.tokenizer.encode(req.prompt)
        text = self.tokenizer.decode(ids)
        if "BADVALUE" in text:
            raise ValueError("the engine refuses this prompt (BADVALUE)")
        p = req.params
        source = [t for t in ids if t < 256] or [ord("x")]
        delay = 0.02 if "SLOW" in text else 0.0
        ckpt = self._lookup(ids, req.checkpoint_at)
        k = p.logprobs
        prompt_lps = None if p.prompt_logprobs is None else [None] + [{t: -1.0} for t in ids[1:]]
        outs = [CompletionOutput(j, "", [], [] if k is not None else None, 0.0) for j in range(p.n)]
        self.active.add(req.request_id)
        try:
            for step in range(p.max_tokens):
                await asyncio.sleep(delay)
                if req.request_id in self.aborted:
                    return
                if "RAISE" in text and step == 2:
                    raise RuntimeError("simulated engine failure")
                for o in outs:
                    if o.finish_reason is not None:
                        continue
                    tid = source[(step + o.index) % len(source)]
                    lp = -0.5 - 0.01 * step
                    o.token_ids = o.token_ids + [tid]
                    o.text = self.tokenizer.decode(o.token_ids)
                    o.cumulative_logprob += lp
                    if k is not None:
                        o.logprobs = o.logprobs + [{(tid + a) % 256: lp - a for a in range(max(k, 1))}]
                    self.counts["tokens_generated"] += 1
                    hits = [o.text.index(s) for s in p.stop if s in o.text]
                    if hits:
                        o.text, o.finish_reason = o.text[:min(hits)], "stop"
                    elif step == p.max_tokens - 1:
                        o.finish_reason = "length"
                done = all(o.finish_reason is not None for o in outs)
                yield RequestOutput(req.request_id, list(ids), [CompletionOutput(o.index, o.text, o.token_ids,
                                    o.logprobs, o.cumulative_logprob, o.finish_reason) for o in outs], done, ckpt,
                                    prompt_lps)
                if done:
                    self.counts["requests_finished"] += 1
                    return
                if "ENDEARLY" in text:
                    return  # breaks the contract: no finished output
                if "HANG" in text:
                    await asyncio.Event().wait()  # until cancelled (the request aborted)
        finally:
            self.active.discard(req.request_id)

    async def score(self, prefix, candidates, label_token_ids=None) -> ScoreResult:
        if self.fail_score:
            raise RuntimeError("simulated scoring failure")
        prefix = list(prefix)
        if "BADVALUE" in self.tokenizer.decode(prefix):
            raise ValueError("the engine refuses this prefix (BADVALUE)")
        if "HANG" in self.tokenizer.decode(prefix):
            await asyncio.Event().wait()  # until cancelled
        out = []
        for i, c in enumerate(candidates):
            lps = [-0.1 * (1 + t % 7) for t in c]
            labels = None if label_token_ids is None else {t: 0.05 * (1 + (t + i) % 3) for t in label_token_ids}
            out.append(CandidateScore(i, sum(lps), sum(lps) / len(lps), len(c), labels,
                                      self._lookup(prefix + list(c), len(prefix))))
        return ScoreResult(prefix, out)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict:
        return {"queue_depth": 0, "running": len(self.active), "state_pool_used": len(self.active),
                "state_pool_total": 64, "page_pool_used": 3, "page_pool_total": 128,
                "checkpoint_misses": dict(self.misses), **self.counts}


def expected(prompt: str, max_tokens: int, j: int = 0) -> str:
    src = bytes(t for t in TOK.encode(prompt) if t < 256)
    return bytes(src[(s + j) % len(src)] for s in range(max_tokens)).decode()


def chat_prompt(content: str) -> str:
    return TOK.apply_chat_template([{"role": "user", "content": content}])


class Served:
    def __init__(self, engine: FakeEngine, api_key: str | None = None, config=None,
                 shutdown_timeout: float | None = None) -> None:
        self.engine = engine
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = build_app(engine, api_key, config)
        self.server = GracefulServer(uvicorn.Config(app, log_level="warning", lifespan="off"), app.state.server.close,
                                     shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)




def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _LoggedAborts(FakeEngine):
    async def abort(self, request_id: str) -> None:
        print(f"aborted {request_id}", flush=True)
        await super().abort(request_id)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="the fake engine behind run_server, on loopback")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--shutdown-timeout", type=float, default=10.0)
    args = p.parse_args()
    run_server(_LoggedAborts(), ServerConfig(), port=args.port, log_level="warning",
               shutdown_timeout=args.shutdown_timeout)
