"""The OpenAI-compatible HTTP server: ``build_app(engine)`` → a FastAPI app, ``run_server`` → uvicorn.

    POST /v1/completions       text_completion (+ SSE chunks), echo, logprobs, n, checkpoint_at
    POST /v1/chat/completions  chat.completion (+ chat.completion.chunk), logprobs + top_logprobs
    POST /v1/score             {prefix | query, candidates | items, label_token_ids?, apply_softmax?}
    GET  /v1/models, /health, /metrics (Prometheus, ``metrics.py``)

The server talks to the engine only through ``gdnserve.engine.engine_api``. It tokenizes prompts itself
(stripping a checkpoint marker into ``checkpoint_at``; special-token strings in user text stay plain text
unless ``parse_special_tokens``) so that every length and vocabulary check answers 400 before the engine
sees the request. Before any route: the Host / Origin checks (``security.py``); per POST route: the API
key, a JSON content type (415), the body size (413) and the limits of ``limits.py`` (400). Each response
carries a ``gdnserve`` field at its top level (streamed: on the chunk that finishes a choice): per prompt,
the checkpoint it started from (``hit_length``) or why it missed, and whether it published one. A client
that goes away (streaming or not) has its requests aborted, which frees their slots and pages.

The event loop serves every request, stream and /health at once, so no step may hold it for long: parsing,
tokenizing and formatting more than ``OFF_LOOP_AT`` bytes / characters / token entries runs in a worker thread
(``_Server.off_loop``). At shutdown (``shutdown.py``) the server gets ``close()`` once its grace period is over:
every open request then ends itself (streams: an error event and ``data: [DONE]``; others: a 503), its engine
requests aborted.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from gdnserve.engine.engine_api import (AsyncEngineClient, CompletionOutput, GenerateRequest, RequestOutput,
                                        make_sampling_params)
from gdnserve.entrypoints.config import ServerConfig
from gdnserve.entrypoints.metrics import CONTENT_TYPE, HTTPCounter, RequestTimer, ServerMetrics
from gdnserve.entrypoints.protocol import (APIError, ChatCompletionRequest, CompletionRequest, ContentPart,
                                           ScoreRequest, chat_logprobs, completion_logprobs, parse_request,
                                           provenance, usage)
from gdnserve.entrypoints.security import AccessGuard
from gdnserve.models.tokenizer import DEFAULT_MARKER

log = logging.getLogger("gdnserve.server")
T = TypeVar("T")

# Work on more bytes (a body), characters (a prompt) or token entries (a response's tokens times their top
# logprobs) runs in a worker thread: megabytes take seconds. Below, the thread hop (~0.1 ms) costs more than the
# work (a few ms at most).
OFF_LOOP_AT = 8192


class _ClientGone(Exception):
    pass


@dataclass(slots=True)
class _Prompt:
    ids: list[int]
    checkpoint_at: int | None
    text: str | None  # the prompt text without its marker (for echo); None for token-id prompts


@dataclass(slots=True)
class _Sent:
    """What one choice has streamed so far."""
    text: int = 0
    tokens: int = 0
    offset: int = 0  # text_offset of the next token (legacy completions logprobs)
    started: bool = False
    finished: bool = False


@dataclass(slots=True)
class _Job:
    """One HTTP generation request: its engine requests and how to format their outputs."""
    kind: str  # "completion" | "chat"
    rid: str
    prompts: list[_Prompt]
    gens: list[GenerateRequest]
    n: int
    k: int | None  # top logprobs per token; None = no logprobs
    echo: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)


def _shutdown_error() -> APIError:
    return APIError("the server is shutting down and this request was still open at the end of the grace period "
                    "(--shutdown-timeout); its generation was aborted", None, 503, "server_error", "server_shutdown")


async def _outputs(engine: AsyncEngineClient, gens: list[GenerateRequest], timer: RequestTimer,
                   closing: asyncio.Event) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The engine's outputs of several requests, merged as they come. Leaving early (an error, a client
    that went away, a cancelled task, ``closing`` set: a 503 ``server_shutdown`` error) aborts every request
    that has not finished; unless the engine refused the HTTP request (a 400), their samples count as finished by
    ``abort`` in the metrics."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, req: GenerateRequest) -> None:
        try:
            timer.submitted(i)
            it = engine.generate(req)
            if inspect.isawaitable(it):
                it = await it
            async for out in it:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # handed to the consumer; a failure stays within this HTTP request
            queue.put_nowait((i, e))

    async def stop_when_closing() -> None:
        await closing.wait()
        queue.put_nowait((-1, _shutdown_error()))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    tasks.append(asyncio.create_task(stop_when_closing()))
    live, finished = set(range(len(gens))), set()
    refused = False
    try:
        while live:
            i, item = await queue.get()
            if isinstance(item, ValueError):
                refused = True
                raise APIError(str(item), getattr(item, "param", None)) from item
            if isinstance(item, Exception):
                raise item
            if item is None:
                if i in finished:
                    continue
                # the generator ended before a finished output: an engine bug, not the client's
                raise RuntimeError(f"the engine ended request {gens[i].request_id} without a finished output")
            if item.finished:
                live.discard(i)
                finished.add(i)
            timer.output(i, item)
            yield i, item
    finally:
        timer.close()
        with anyio.CancelScope(shield=True):
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for i, g in enumerate(gens):
                if i not in finished:
                    await engine.abort(g.request_id)
                    if not refused:
                        timer.aborted(i, g.params.n)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless(coro: Any, stop: Any, error: Any) -> Any:
    """``await coro``, cancelled (→ ``error()`` raised) if the awaitable ``stop`` completes first."""
    work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(stop)
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise error()
    return work.result()


async def _unless_disconnected(request: Request, coro: Any) -> Any:
    """``await coro``, cancelled (→ _ClientGone) if the client disconnects first."""
    return await _unless(coro, _wait_disconnect(request), _ClientGone)


async def _unless_closing(closing: asyncio.Event, coro: Any) -> Any:
    """``await coro``, cancelled (→ a 503 ``server_shutdown``) if the server closes first."""
    return await _unless(coro, closing.wait(), _shutdown_error)


def _chat_size(req: ChatCompletionRequest) -> int:
    """What rendering and tokenizing the chat costs, for ``off_loop``: its characters, and 64 per message or
    content part (a template turn). Counted up to the threshold only: a million messages are a cost too."""
    size = 0
    for m in req.messages:
        for part in m.content if isinstance(m.content, list) else [m.content]:
            text = part.text if isinstance(part, ContentPart) else part
            size += 64 + len(text or "")
            if size > OFF_LOOP_AT:
                return size
    return size


class _SSEResponse(StreamingResponse):
    """Closes its stream however the response ends. Starlette cancels the sending task when the client
    disconnects and may leave the body generator suspended (or never started); closing the engine outputs
    is what aborts the engine requests."""

    def __init__(self, body: AsyncIterator[str], outputs: Any) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                         "X-Accel-Buffering": "no"})
        self._outputs = outputs

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._outputs.aclose()


def _json_bytes(body: dict[str, Any]) -> bytes:
    """``body`` as JSONResponse renders it, each choice dumped on its own: one json.dumps of megabytes holds the
    GIL throughout, and so the event loop, even from a worker thread."""
    dump = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    head, tail = dump({**body, "choices": []}).split('"choices":[]', 1)  # the key: quotes in values are escaped
    return "".join([head, '"choices":[', ",".join(map(dump, body["choices"])), "]", tail]).encode()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Server:
    def __init__(self, engine: AsyncEngineClient, config: ServerConfig) -> None:
        self.engine, self.tok, self.cfg = engine, engine.tokenizer, config
        self.api_key, self.limits = config.api_key, config.limits
        self.metrics = ServerMetrics(engine)
        self._closed = False            # set by close(): every open and new request ends with a 503
        self._closing: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        # a few threads: work on megabytes holds the GIL in turns anyway, and leaves anyio's default threads to
        # /health and /metrics
        self.workers = anyio.CapacityLimiter(4)

    def close(self) -> None:
        """End every open and new generation or score request now: streams with a 503 ``server_shutdown`` error
        event and ``data: [DONE]``, the others with that 503; their engine requests are aborted. Called on the
        event loop when the shutdown grace period is over (``shutdown.GracefulServer``)."""
        self._closed = True
        try:
            self.closing.set()
        except RuntimeError:        # no running loop: the next loop's event starts set
            pass

    @property
    def closing(self) -> asyncio.Event:
        """The running loop's shutdown event, set once ``close()`` ran. An asyncio.Event binds to the first loop
        that waits on it, and one app may be served by several loops in a process (each test client, server or
        ``asyncio.run`` starts its own): an event made once in ``__init__`` failed every request of a later loop
        with "bound to a different event loop". Made per loop, on first use in it."""
        loop = asyncio.get_running_loop()
        if self._closing is None or self._closing[0] is not loop:
            ev = asyncio.Event()
            if self._closed:
                ev.set()
            self._closing = (loop, ev)
        return self._closing[1]

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: inline when ``size`` (the bytes, characters or token entries it works on) is at most
        ``OFF_LOOP_AT``, else in a worker thread, so that parsing, tokenizing or formatting megabytes never holds
        the event loop (every other request and stream, /health) longer than a GIL switch interval."""
        if size <= OFF_LOOP_AT:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.workers)

    # ---- request checks ----------------------------------------------------------------------------

    async def read(self, request: Request, model: type) -> Any:
        """The request model from a JSON body: 415 unless the content type is JSON, 413 over the body limit
        (the Content-Length, or the bytes as they arrive when there is none), then ``parse_request``."""
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            raise APIError(f"the request body must be JSON, sent with 'Content-Type: application/json' (got "
                           f"{ctype or 'no content type'!r})", None, 415, code="unsupported_media_type")
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length")
        too_big = APIError(f"the request body is larger than {limit} bytes (--max-body-bytes)", None, 413,
                           code="request_too_large")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        return await self.off_loop(len(body), parse_request, bytes(body), model, self.limits)

    def special(self, req: Any) -> bool:
        flag = getattr(req, "parse_special_tokens", None)
        return self.cfg.parse_special_tokens if flag is None else flag

    def auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError("invalid or missing API key: send 'Authorization: Bearer <key>'", None, 401,
                           code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_name:
            raise APIError(f"The model '{model}' does not exist; this server serves '{self.engine.model_name}'",
                           "model", 404, code="model_not_found")

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tok.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"token id {bad} in {param} is outside the vocabulary [0, {vocab})", param)

    def prepare(self, prompt: str | list[int], checkpoint_at: int | None, param: str, special: bool) -> _Prompt:
        """Token ids with the marker stripped, the checkpoint offset (marker or checkpoint_at), checked."""
        if isinstance(prompt, str):
            try:
                ids, offset = self.tok.encode_with_marker(prompt, special=special)
            except ValueError as e:  # MarkerError: repeated marker, nothing before or after it
                raise APIError(f"{param}: {e}", param) from None
            return self.checked(ids, offset, checkpoint_at, param, prompt.replace(DEFAULT_MARKER, ""))
        ids = list(prompt)
        self.check_ids(ids, param)
        return self.checked(ids, None, checkpoint_at, param, None)

    def chat_prompt(self, req: ChatCompletionRequest) -> _Prompt:
        messages = req.plain_messages()  # outside the try: a content part it refuses names itself, not the template
        try:
            ids, offset, _ = self.tok.encode_chat(messages, special=self.special(req))
        except ValueError as e:  # MarkerError (a marker in a message): the client's
            raise APIError(f"messages: {e}", "messages") from None
        except Exception as e:  # a template that refuses the messages (raise_exception) is the client's fault
            raise APIError(f"the chat template refused the messages: {e}", "messages") from None
        return self.checked(ids, offset, req.checkpoint_at, "messages", None)

    def checked(self, ids: list[int], offset: int | None, checkpoint_at: int | None, param: str,
                text: str | None) -> _Prompt:
        if offset is not None and checkpoint_at is not None:
            raise APIError(f"{param} carries a checkpoint marker (offset {offset}) and checkpoint_at is "
                           f"{checkpoint_at}: give the checkpoint once", "checkpoint_at")
        checkpoint_at = offset if offset is not None else checkpoint_at
        if not ids:
            raise APIError(f"{param} must not be empty (it has no tokens)", param)
        if checkpoint_at is not None and not 0 < checkpoint_at < len(ids):
            raise APIError(f"checkpoint_at = {checkpoint_at} is not inside the prompt of {len(ids)} tokens "
                           f"(needs 1 <= checkpoint_at <= {len(ids) - 1})", "checkpoint_at")
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise APIError(f"{param} is {len(ids)} tokens; this model's context length is {limit} tokens "
                           f"(prompt + completion)", param)
        return _Prompt(ids, checkpoint_at, text)

    def max_tokens(self, requested: int | None, default: int, prompts: list[_Prompt], param: str) -> int:
        room = self.engine.max_model_len - max(len(p.ids) for p in prompts)
        if requested is None:
            return min(default, room)
        if requested > room:
            raise APIError(f"{param} = {requested} does not fit: this model's context length is "
                           f"{self.engine.max_model_len} tokens and the prompt takes "
                           f"{self.engine.max_model_len - room}", param)
        return requested

    def job(self, kind: str, req: CompletionRequest | ChatCompletionRequest, prompts: list[_Prompt],
            max_tokens: int, k: int | None, echo: bool) -> _Job:
        prompt_k = k if echo and k is not None else None
        fields = req.sampling_fields(max_tokens, k, prompt_k)
        try:
            params = make_sampling_params(**fields)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            name = str(e).split(" ", 1)[0]
            raise APIError(str(e), getattr(e, "param", name if name in fields else None)) from None
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        gens = [GenerateRequest(f"{rid}-{i}", p.ids, params, p.checkpoint_at) for i, p in enumerate(prompts)]
        return _Job(kind, rid, prompts, gens, req.n, k, echo, req.include_usage())

    # ---- formatting ------------------------------------------------------------------------------------

    def header(self, job: _Job, chunk: bool) -> dict[str, Any]:
        obj = {"completion": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}
        return {"id": job.rid, "object": obj[job.kind], "created": job.created, "model": self.engine.model_name,
                "system_fingerprint": None}

    def prov(self, job: _Job, i: int, out: RequestOutput) -> dict[str, Any]:
        return {"index": i, **provenance(out.checkpoint, len(out.prompt_token_ids), job.prompts[i].checkpoint_at)}

    def echo_text(self, job: _Job, i: int) -> str:
        p = job.prompts[i]
        return p.text if p.text is not None else self.tok.decode(p.ids, skip_special_tokens=False)

    def logprobs(self, job: _Job, i: int, out: RequestOutput, c: CompletionOutput, start: int,
                 echo: bool, offset: int = 0) -> dict[str, Any] | None:
        """Logprobs of ``c``'s tokens from ``start`` on (``offset``: text_offset of the first), with the
        prompt's first when ``echo``."""
        if job.k is None:
            return None
        ids, lps = c.token_ids[start:], (c.logprobs or [None] * len(c.token_ids))[start:]
        if job.kind == "chat":
            return chat_logprobs(self.tok, ids, lps, job.k)
        if echo:
            plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            ids, lps = list(out.prompt_token_ids) + ids, list(plp) + list(lps)
        return completion_logprobs(self.tok, ids, lps, job.k, offset)

    def choice(self, job: _Job, i: int, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        index = i * job.n + c.index
        lp = self.logprobs(job, i, out, c, 0, job.echo)
        if job.kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        text = self.echo_text(job, i) + c.text if job.echo else c.text
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}

    def final(self, job: _Job, outs: dict[int, RequestOutput]) -> dict[str, Any]:
        ordered = [(i, outs[i]) for i in sorted(outs)]
        choices = [self.choice(job, i, o, c) for i, o in ordered for c in sorted(o.outputs, key=lambda c: c.index)]
        prompt_tokens = sum(len(o.prompt_token_ids) for _, o in ordered)
        completion_tokens = sum(len(c.token_ids) for _, o in ordered for c in o.outputs)
        return {**self.header(job, False), "choices": choices, "usage": usage(prompt_tokens, completion_tokens),
                "gdnserve": {"prompts": [self.prov(job, i, o) for i, o in ordered]}}

    def chunks(self, job: _Job, i: int, out: RequestOutput, sent: dict[tuple[int, int], _Sent]) -> list[dict]:
        """The SSE chunks that bring each choice of prompt ``i`` up to ``out``."""
        choices: list[dict[str, Any]] = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            s = sent.setdefault((i, c.index), _Sent())
            if s.finished:
                continue
            index, chat = i * job.n + c.index, job.kind == "chat"
            delta, start, echo = c.text[s.text:], s.tokens, job.echo and not s.started
            if not s.started and chat:
                choices.append({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None})
            if echo:
                delta = self.echo_text(job, i) + delta
            s.started, s.text, s.tokens = True, len(c.text), len(c.token_ids)
            if delta or echo or (job.k is not None and len(c.token_ids) > start):
                lp = self.logprobs(job, i, out, c, start, echo, s.offset)
                if lp is not None and not chat and lp["tokens"]:
                    s.offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
                body = {"delta": {"content": delta}} if chat else {"text": delta}
                choices.append({"index": index, **body, "logprobs": lp, "finish_reason": None})
            if c.finish_reason is not None:
                s.finished = True
                body = {"delta": {}} if chat else {"text": ""}
                choices.append({"index": index, **body, "logprobs": None, "finish_reason": c.finish_reason})
        extra = {"usage": None} if job.include_usage else {}
        out_chunks = [{**self.header(job, True), "choices": [ch], **extra} for ch in choices]
        for ch in out_chunks:  # provenance at the top level, as in the non-streamed response
            if ch["choices"][0]["finish_reason"] is not None:
                ch["gdnserve"] = {"prompts": [self.prov(job, i, out)]}
        return out_chunks

    # ---- driving the engine ------------------------------------------------------------------------------

    async def run(self, request: Request, job: _Job, stream: bool) -> Response:
        outputs = _outputs(self.engine, job.gens, self.metrics.track(job.arrival, [g.request_id for g in job.gens]),
                           self.closing)
        try:
            first = await _unless_disconnected(request, anext(outputs, None))
        except BaseException:
            await outputs.aclose()
            raise
        if not stream:
            return await self.collect(request, job, outputs, first)
        return _SSEResponse(self.stream(job, outputs, first), outputs)

    async def collect(self, request: Request, job: _Job, outputs: AsyncIterator, first: Any) -> Response:
        async def rest() -> dict[int, RequestOutput]:
            last: dict[int, RequestOutput] = {} if first is None else {first[0]: first[1]}
            async for i, out in outputs:
                last[i] = out
            return last
        try:
            last = await _unless_disconnected(request, rest())
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        return await self.off_loop(self.entries(job, last.values()), self.response, job, last)

    def response(self, job: _Job, outs: dict[int, RequestOutput]) -> Response:
        return Response(_json_bytes(self.final(job, outs)), media_type="application/json")

    def entries(self, job: _Job, outs: Any, sent: dict[tuple[int, int], _Sent] | None = None,
                i: int = 0) -> int:
        """The token entries (tokens, echoed prompts' included, times 1 + top logprobs) a response formats from
        ``outs``; with ``sent``, those of prompt ``i``'s next stream chunks only."""
        tokens = 0
        for o in outs:
            for c in o.outputs:
                s = None if sent is None else sent.get((i, c.index))
                new = len(c.token_ids) - (s.tokens if s else 0)
                tokens += new + (len(o.prompt_token_ids) if job.echo and not (s and s.started) else 0)
        return tokens * (1 + (job.k or 0))

    def events(self, job: _Job, i: int, out: RequestOutput, sent: dict[tuple[int, int], _Sent]) -> list[str]:
        return [_sse(chunk) for chunk in self.chunks(job, i, out, sent)]

    async def stream(self, job: _Job, outputs: Any, first: Any) -> AsyncIterator[str]:
        sent: dict[tuple[int, int], _Sent] = {}
        prompt_tokens: dict[int, int] = {}
        try:
            item = first
            while item is not None:
                i, out = item
                prompt_tokens[i] = len(out.prompt_token_ids)
                for event in await self.off_loop(self.entries(job, [out], sent, i), self.events, job, i, out, sent):
                    yield event
                item = await anext(outputs, None)
            if job.include_usage:
                done = sum(s.tokens for s in sent.values())
                yield _sse({**self.header(job, True), "choices": [], "usage": usage(sum(prompt_tokens.values()), done)})
        except APIError as e:
            yield _sse(e.body())
        except Exception as e:  # headers are out: the error travels as an event, then [DONE]
            log.exception("request %s failed while streaming", job.rid)
            yield _sse(APIError(f"internal error in request {job.rid}: {type(e).__name__}: {e}", None, 500,
                                "server_error").body())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    async def score(self, request: Request, req: ScoreRequest) -> dict[str, Any]:
        prefix, cands = req.check(self.limits)
        cname = "candidates" if req.items is None else "items"
        pname = "prefix" if req.query is None else "query"
        special = self.special(req)
        prefix_ids = await self.off_loop(len(prefix), self.score_ids, prefix, pname, special)
        cand_ids = await self.off_loop(sum(map(len, cands)), lambda: [
            self.score_ids(c, f"{cname}[{j}]", special) for j, c in enumerate(cands)])
        limit = self.engine.max_model_len
        for j, c in enumerate(cand_ids):
            # the engine's rule: the context holds prefix + candidate and the next token (label_token_ids score it)
            if len(prefix_ids) + len(c) + 1 > limit:
                raise APIError(f"{pname} + {cname}[{j}] is {len(prefix_ids) + len(c)} tokens; this model's "
                               f"context length is {limit}, so at most {limit - 1} (room for the next token)",
                               f"{cname}[{j}]")
        labels = req.label_token_ids
        if labels is not None:
            self.check_ids(labels, "label_token_ids")
        try:  # a client that goes away cancels the wait, and that aborts the engine's score job; so does shutdown
            result = await _unless_disconnected(
                request, _unless_closing(self.closing, self.engine.score(prefix_ids, cand_ids, labels)))
        except ValueError as e:
            param = getattr(e, "param", None)     # the engine's names; the client's may be query / items
            if param is not None:
                param = param.replace("candidates", cname, 1).replace("prefix", pname, 1)
            raise APIError(str(e), param) from None
        data, scores = [], []
        for c in result.candidates:
            probs = None
            if labels is not None and c.label_probs is not None:
                probs = [c.label_probs.get(t, 0.0) for t in labels]
                total = sum(probs)
                if req.apply_softmax:  # softmax over the label logits = renormalised label probabilities
                    probs = [p / total for p in probs] if total > 0 else [1.0 / len(probs)] * len(probs)
                scores.append(probs)
            rec = provenance(c.checkpoint, len(prefix_ids) + c.num_tokens, len(prefix_ids))
            data.append({"index": c.index, "object": "score", "sum_logprob": c.sum_logprob,
                         "mean_logprob": c.mean_logprob, "num_tokens": c.num_tokens,
                         "label_probs": None if probs is None else {str(t): p for t, p in zip(labels, probs)},
                         "gdnserve": rec})
        total_tokens = len(prefix_ids) + sum(len(c) for c in cand_ids)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "scoring", "created": int(time.time()),
                "model": self.engine.model_name, "scores": scores if labels is not None else None, "data": data,
                "usage": usage(total_tokens, 0), "gdnserve": {"prefix_tokens": len(prefix_ids)}}

    def score_ids(self, x: str | list[int], param: str, special: bool) -> list[int]:
        if isinstance(x, str):
            if DEFAULT_MARKER in x:
                raise APIError(f"{param} contains the checkpoint marker; in /v1/score the prefix is the "
                               "checkpoint, no marker is needed", param)
            ids = self.tok.encode(x, special=special)
            if not ids:
                raise APIError(f"{param} has no tokens", param)
            return ids
        self.check_ids(list(x), param)
        return list(x)


def build_app(engine: AsyncEngineClient, api_key: str | None = None, config: ServerConfig | None = None) -> FastAPI:
    """The HTTP app over ``engine``, configured by ``config`` (defaults: ``ServerConfig()``, the safe loopback
    ones; ``api_key`` is a shortcut for ``ServerConfig(api_key=...)``). With an API key, /v1/* and /metrics
    want ``Authorization: Bearer <key>`` (401 otherwise; /metrics open with ``public_metrics``); /health
    stays open for probes."""
    if config is None:
        config = ServerConfig(api_key=api_key)
    elif api_key is not None:
        raise ValueError("give the API key once: in config or as api_key")
    srv = _Server(engine, config)
    app = FastAPI(title="gdnserve", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    app.add_middleware(AccessGuard, config=config)
    app.add_middleware(HTTPCounter, metrics=srv.metrics)  # outermost: counts the guard's 403s too
    limits = config.limits

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(f"{e.detail}: {request.method} {request.url.path}", None, e.status_code).body(),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("request to %s failed", request.url.path)
        return JSONResponse(APIError(f"internal error: {type(e).__name__}: {e}", None, 500, "server_error").body(),
                            status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        srv.auth(request)
        req = await srv.read(request, CompletionRequest)
        srv.check_model(req.model)
        req.check(limits)
        special = srv.special(req)
        prompts = [await srv.off_loop(len(p), srv.prepare, p, req.checkpoint_at, "prompt", special)
                   for p in req.prompts()]
        max_tokens = srv.max_tokens(req.max_tokens, config.default_max_tokens, prompts, "max_tokens")
        job = srv.job("completion", req, prompts, max_tokens, req.logprobs, req.echo)
        job.arrival = arrival
        return await _guarded(srv.run(request, job, req.stream), job.rid)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrival = time.monotonic()
        srv.auth(request)
        req = await srv.read(request, ChatCompletionRequest)
        srv.check_model(req.model)
        req.check(limits)
        prompts = [await srv.off_loop(_chat_size(req), srv.chat_prompt, req)]
        requested, param = req.token_limit()
        max_tokens = srv.max_tokens(requested, config.chat_default_max_tokens, prompts, param)
        k = (req.top_logprobs or 0) if req.logprobs else None
        job = srv.job("chat", req, prompts, max_tokens, k, echo=False)
        job.arrival = arrival
        return await _guarded(srv.run(request, job, req.stream), job.rid)

    @app.post("/v1/score")
    async def score(request: Request) -> Response:
        srv.auth(request)
        req = await srv.read(request, ScoreRequest)
        srv.check_model(req.model)
        return await _guarded(_json(srv.score(request, req)), "score request")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        srv.auth(request)
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "gdnserve", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        try:  # off the event loop: stats() may wait for a running step
            await run_in_threadpool(engine.stats)
        except Exception as e:
            return JSONResponse({"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}, status_code=503)
        return JSONResponse({"status": "ok", "model": engine.model_name})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not config.public_metrics:
            srv.auth(request)
        return Response(await run_in_threadpool(srv.metrics.render), media_type=CONTENT_TYPE)

    return app


async def _guarded(coro: Any, what: str) -> Response:
    """Run one request's engine work; a failure there is a 500 for this request alone. (Caught here, not by
    an app-wide handler, which Starlette re-raises after answering and which then resets the connection.)"""
    try:
        return await coro
    except _ClientGone:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    except APIError:
        raise
    except Exception as e:
        log.exception("%s failed", what)
        return JSONResponse(APIError(f"internal error in {what}: {type(e).__name__}: {e}", None, 500,
                                     "server_error").body(), status_code=500)


async def _json(coro: Any) -> JSONResponse:
    return JSONResponse(await coro)


def run_server(engine: AsyncEngineClient, config: ServerConfig | None = None, port: int = 8000,
               sock: Any = None, log_level: str = "info", shutdown_timeout: float | None = 10.0) -> None:
    """Serve ``engine`` until interrupted, on ``sock`` (a bound socket: the caller checked the port before
    loading the model) or on ``config.host:port``. Binds loopback by default: pass ``ServerConfig(host=
    "0.0.0.0", api_key=...)`` to expose it. On shutdown, open requests get ``shutdown_timeout`` seconds, then are
    answered 503 (``shutdown.py``). An engine that dies (``on_dead``) shuts the server down the same way (its
    requests have already failed)."""
    import uvicorn

    from gdnserve.entrypoints.shutdown import GracefulServer
    config = config or ServerConfig()
    app = build_app(engine, config=config)
    server = GracefulServer(uvicorn.Config(app, host=config.host, port=port, log_level=log_level),
                            app.state.server.close, shutdown_timeout)
    if hasattr(engine, "on_dead"):      # an engine that can die (AsyncEngine: a tensor-parallel worker gone) stops
        engine.on_dead = lambda message: setattr(server, "should_exit", True)   # the server; its caller exits 1
    server.run(sockets=None if sock is None else [sock])
